"""Issue 51's mechanism on a running engine, before its readout entry: the query tapped at each
layer's attention input (``install_query_taps``, the ``attn_q`` site), the keys read from the
paged cache through each request's block table (``request_keys``) and the layer's kernel terms
(``attention_terms``), read in the recorder window of every step, give every row's attention
per head equal to Hugging Face's eager ``output_attentions`` on the same tokens: prompt and
generated rows, two requests of different lengths in one batch, over several blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_rows import assert_readings_match, readings_of

pytestmark = pytest.mark.engine

K = 4


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_every_row_s_attention_equals_hugging_face_s(monkeypatch, eager: bool) -> None:
    from transformers import AutoModelForCausalLM

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.adapter.worker import loader, runner_v1
    from probehook.adapter.worker.kv_cache import attention_of, attention_terms, request_keys
    from probehook.adapter.worker.surgery import install_query_taps, locate_layers
    from probehook.worker.attention_rows import head_readings

    queries: dict[int, torch.Tensor] = {}
    install_taps = loader.install_taps

    tapped: list[Any] = []

    def tapping(model: Any, *args: Any, **kwargs: Any) -> Any:
        hook = install_taps(model, *args, **kwargs)
        tapped.extend(locate_layers(model)[1])
        layers = range(len(locate_layers(model)[1]))
        queries.update(install_query_taps(model, layers, args[2]))  # args: config, taps, T
        return hook

    read: dict[str, list[list[Any]]] = {}
    record_step = runner_v1.record_step

    def reading(runner: Any, recorders: Any, defer: bool = False) -> Any:
        if defer:  # the step's second call (the recorders that complete after sampling)
            return record_step(runner, recorders, defer)
        batch, starts = runner.input_batch, runner.query_start_loc.np
        layers = locate_layers(runner.get_model())[1]
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            lo, hi = int(starts[i]), int(starts[i + 1])
            first = int(batch.num_computed_tokens_cpu[i])
            positions = torch.arange(first, first + hi - lo)
            per_layer = read.setdefault(req_id, [[] for _ in layers])
            for index, layer in enumerate(layers):
                attention = attention_of(layer)
                q = queries[index][lo:hi].float().view(hi - lo, attention.num_heads, -1)
                keys = request_keys(runner, attention, i, torch.arange(first + hi - lo))
                per_layer[index].append(head_readings(
                    q, positions, keys.float(), torch.arange(first + hi - lo),
                    attention_terms(attention), K, spans=torch.tensor([[0, 3]])))  # fmt: skip
        return record_step(runner, recorders, defer)

    monkeypatch.setattr(loader, "install_taps", tapping)
    monkeypatch.setattr(runner_v1, "record_step", reading)
    llm = LLM(str(tiny_model_path()), layers=[1], block_size=32, enforce_eager=eager,
              max_model_len=64, seed=0, dtype="float32")  # fmt: skip
    try:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        outs = llm.generate(["12+34=", "1+2+3+4+5+6+7+8+9+10="], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_the_tripwire_refuses_what_it_has_not_classified(attention_of(tapped[0]))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    assert len(read) == 2
    for out in outs:
        ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
        steps = next(r for r in read.values() if sum(len(s.entropy) for s in r[0]) == len(ids))
        assert len(ids) > 32  # over more than one block
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_attentions=True).attentions
        fields = ("positions", "probs", "entropy", "spans")
        for index, per_step in enumerate(steps):  # the steps' rows joined, in order
            got = type(per_step[0])(*(torch.cat([getattr(s, f) for s in per_step]) for f in fields))
            assert_readings_match(got, want[index][0].transpose(0, 1), [(0, 3)])


def assert_the_tripwire_refuses_what_it_has_not_classified(attention: Any) -> None:
    """A running engine's attention layer is classified; the same layer with any one setting
    probehook has not classified is refused by name (``check_readable``, at load)."""
    import copy

    from probehook.adapter.worker.kv_cache import check_readable
    from probehook.errors import UnsupportedModelError

    check_readable(attention)
    for setting, value, match in [
        ("kv_cache_dtype", "fp8", r"\{'kv_cache_dtype': 'fp8'\}"),
        ("kv_sharing_target_layer_name", "model.layers.0.self_attn.attn",
         r"'kv_sharing_target_layer_name': 'model.layers.0"),
        ("use_mm_prefix", True, r"\{'use_mm_prefix': True\}"),
        ("attn_type", "encoder_only", r"\{'attn_type': 'encoder_only'\}"),
    ]:  # fmt: skip
        changed = copy.copy(attention)
        changed.__dict__[setting] = value
        with pytest.raises(UnsupportedModelError, match=match):
            check_readable(changed)
    alibi = copy.copy(attention)
    alibi.__dict__["impl"] = copy.copy(attention.impl)
    alibi.impl.alibi_slopes = torch.ones(4)
    with pytest.raises(UnsupportedModelError, match=r"\{'alibi_slopes': True\}"):
        check_readable(alibi)
    chunked = copy.copy(attention)
    chunked.__class__ = type("ChunkedLocalAttention", (type(attention),), {})
    with pytest.raises(UnsupportedModelError, match=r"vLLM's ChunkedLocalAttention, whose"):
        check_readable(chunked)
    other = copy.copy(attention)
    other.__dict__["impl"] = object()
    with pytest.raises(UnsupportedModelError, match=r"runs vLLM's object, whose key cache"):
        check_readable(other)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_the_attention_readout_equals_hugging_face_offline(eager: bool, tmp_path) -> None:
    """``LLM(attention_layers=[0, 3], attention_top_k=4, include_prefill=True)`` (compiled:
    with ``attention_min_p=0.05``): every prompt and generated row's ``attention[layer]``
    (positions, probs, entropy per head) equals Hugging Face's eager ``output_attentions`` of
    the same tokens; a request that narrows to one layer gets that layer, one that names heads
    gets those (a list: every layer; ``{layer: heads}``: that layer), one that names spans gets
    their masses; ``"attention": False`` gets none; each bad option is refused by name, the
    engine alive. The store keeps every column, heads and spans bit-equal, through fsck and
    compaction too, and the viewer shows a block per head with its top keys."""
    from transformers import AutoModelForCausalLM

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.errors import CaptureConfigError

    min_p = 0.0 if eager else 0.05
    llm = LLM(str(tiny_model_path()), attention_layers=[0, 3], attention_top_k=K,
              include_prefill=True, block_size=32, enforce_eager=eager, max_model_len=64,
              seed=0, dtype="float32", store=tmp_path / "store",
              **({} if eager else {"attention_min_p": min_p}))  # fmt: skip
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)

    def asking(**options: Any) -> Any:
        return SamplingParams(**greedy, extra_args={"probehook": options})

    spans = {"head": [0, 3], "tail": [5, 40]}
    try:
        outs = llm.generate(["12+34=", "1+2+3+4+5+6+7+8+9+10="], SamplingParams(**greedy),
                            use_tqdm=False)  # fmt: skip
        narrowed, off, by_layer, listed = llm.generate(["12+34="] * 4, [
            asking(attention_layers=[3]), asking(attention=False),
            asking(attention_heads={3: [3, 1]}, attention_spans=spans),
            asking(attention_heads=[2])], use_tqdm=False)  # fmt: skip
        for options, match in [
            ({"attention_layers": [1]}, r"names layer\(s\) \[1\], whose attention"),
            ({"attention_heads": [4]}, r"head\(s\) \[4\] of layer 0, which has 4 query heads"),
            ({"attention_heads": {1: [0]}}, r"names layer 1, whose attention this request"),
            ({"attention_heads": []}, r"non-empty list of distinct query heads in 0\.\.3"),
            ({"attention_spans": {"s": [5, 5]}}, r"'s': \[5, 5\] is not a span"),
            ({"attention_spans": {"s": [0, 2.5]}}, r"'s': \[0, 2\.5\] is not a span"),
            ({"attention_spans": {f"s{i}": [0, 1] for i in range(17)}}, r"17 spans; at most 16"),
            ({"attention_top_k": K + 1}, rf"attention_top_k={K + 1} is not valid: .*1\.\.{K}"),
        ]:
            with pytest.raises(CaptureConfigError, match=match):
                llm.generate("1+1=", asking(**options))
        assert llm.generate("1+1=", SamplingParams(max_tokens=1))[0].outputs[0].text is not None
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    heads_of = {
        id(narrowed): {3: (0, 1, 2, 3)},
        id(by_layer): {0: (0, 1, 2, 3), 3: (1, 3)},
        id(listed): {0: (2,), 3: (2,)},
    }
    for out in [*outs, narrowed, by_layer, listed]:
        ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
        n = len(out.prompt_token_ids)
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_attentions=True).attentions
        heads = heads_of.get(id(out), {0: (0, 1, 2, 3), 3: (0, 1, 2, 3)})
        named = list(spans) if out is by_layer else []
        assert (
            sorted(out.outputs[0].attention) == sorted(heads)
            and out.attention is out.outputs[0].attention
        )
        for layer, chosen in heads.items():
            probs = want[layer][0].transpose(0, 1)[:, list(chosen)]  # [rows, heads, keys]
            prompt, decode = out.prefill_attention[layer], out.outputs[0].attention[layer]
            assert prompt.positions.shape == (n, len(chosen), K) and decode.heads == chosen
            assert list(decode.spans) == named and list(prompt.spans) == named
            bounds = [tuple(spans[name]) for name in named]
            assert_readings_match(readings_of(prompt), probs[:n], bounds, min_p)
            assert_readings_match(readings_of(decode), probs[n - 1 :], bounds, min_p)
    assert off.outputs[0].attention == {} and off.prefill_attention == {}
    from probehook.store import ActivationStore
    from probehook.store.maintenance import compact, fsck
    from probehook.viewer.tokens import request_data

    root = tmp_path / "store"
    for maintained in (False, True):  # as written; then after fsck and compaction
        if maintained:
            assert fsck(root).ok
            report = compact(root, progress=False)
            assert fsck(root).ok and report.shards_after < report.shards_before
        store = ActivationStore.open(root)
        for out, layer in ((outs[0], 3), (by_layer, 3), (by_layer, 0)):
            stored = store[out.store_id]
            for got, want in (
                (stored.readout("attention")[layer], out.outputs[0].attention[layer]),
                (stored.readout("attention", "prefill")[layer], out.prefill_attention[layer]),
            ):
                assert got.heads == want.heads and list(got.spans) == list(want.spans)
                for name, column in want.columns.items():
                    assert torch.equal(got.columns[name], column), name
    data = request_data(outs[0], str)
    blocks = {t["name"]: t for t in data["top_k"] if t["name"].startswith("attention")}
    assert sorted(blocks) == [f"attention {layer} h{h}" for layer in (0, 3) for h in range(4)]
    n = len(outs[0].prompt_token_ids)
    first = outs[0].outputs[0].attention[3]
    assert [p for p, _ in blocks["attention 3 h2"]["rows"][n - 1]] == [
        p for p in first.positions[0, 2].tolist() if p >= 0]  # fmt: skip
    if eager:
        assert_the_page_shades_what_the_pointed_token_attends_to(by_layer, tmp_path)


def assert_the_page_shades_what_the_pointed_token_attends_to(out: Any, tmp_path) -> None:
    """The viewer names a request's heads as it chose them (``h1``, ``h3``) and offers, per
    head, to shade every token by how much the pointed token attends to it: in Chromium, the
    first output token pointed, each token's colour is its probability's."""
    from browser import chromium, open_page
    from transformers import AutoTokenizer

    from probehook import tiny_model_path, view
    from probehook.viewer.page import shade

    shown = view(out, AutoTokenizer.from_pretrained(str(tiny_model_path())))
    names = [t["name"] for t in shown.requests[0]["top_k"]]
    assert [name for name in names if name.startswith("attention 3")] == [
        "attention 3 h1", "attention 3 h3"]  # fmt: skip
    n = len(out.prompt_token_ids)
    rows = out.outputs[0].attention[3]
    # decode row 1 (position n), head 3
    pairs = zip(rows.positions[1, 1].tolist(), rows.probs[1, 1].tolist(), strict=True)
    weights = {p: w for p, w in pairs if p >= 0}
    path = shown.save(tmp_path / "attention.html")
    with chromium() as browser:
        page, errors, _ = open_page(browser, path.as_uri(), path.as_uri())
        option = page.locator("select.ph-series option", has_text="attention 3 h3: attention")
        page.select_option("select.ph-series", option.get_attribute("value"))
        page.hover(f".ph-token[data-i='{n}']")
        spans = page.locator(".ph-token")
        for q in range(spans.count()):
            got = spans.nth(q).evaluate("e => getComputedStyle(e).backgroundColor")
            want = shade(min(1.0, weights[q])) if q in weights else "rgba(0, 0, 0, 0)"
            assert got == want, (q, weights)
        assert errors == []


def test_attention_pattern_equals_hugging_face_s_matrix() -> None:
    """``llm.attention_pattern(prompt, layer)``: every head's whole ``[n, n]`` matrix of a
    prompt equals Hugging Face's eager ``output_attentions`` within 1e-4 (text and token ids
    alike); a layer the engine does not read, a prompt longer than the engine's k and a matrix
    over ``max_bytes`` are refused by name, the engine alive."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probehook import LLM, tiny_model_path
    from probehook.errors import CaptureConfigError

    path = str(tiny_model_path())
    prompt = "1+2+3+4+5+6=21"
    ids = AutoTokenizer.from_pretrained(path)(prompt).input_ids
    n = len(ids)
    llm = LLM(path, attention_layers=[1, -1], attention_top_k=n, include_prefill=True,
              enforce_eager=True, max_model_len=64, seed=0, dtype="float32")  # fmt: skip
    try:
        from_text, from_ids = llm.attention_pattern(prompt, 3), llm.attention_pattern(ids, -1)
        first = llm.attention_pattern(prompt, 1)
        for call, match in [
            (lambda: llm.attention_pattern(prompt, 2), r"attention_layers: \[1, 3\]"),
            (lambda: llm.attention_pattern(prompt + "0", 1),
             rf"has {n + 1} tokens, the engine keeps attention_top_k={n}"),
            (lambda: llm.attention_pattern(prompt, 1, max_bytes=1000),
             rf"{4 * n * n * 4:,} bytes, over max_bytes=1,000"),
            (lambda: llm.attention_pattern([], 1), r"a non-empty list of token ids"),
        ]:  # fmt: skip
            with pytest.raises(CaptureConfigError, match=match):
                call()
        assert llm.generate("1+1=")[0].outputs[0].text is not None
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_attentions=True).attentions
    assert from_text.shape == (4, n, n) and from_text.dtype == torch.float32
    torch.testing.assert_close(from_text, want[3][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(from_ids, from_text, rtol=0, atol=0)
    torch.testing.assert_close(first, want[1][0], rtol=0, atol=1e-4)


def test_a_layer_the_tripwire_refuses_fails_the_engine_s_construction(monkeypatch) -> None:
    """A refusal of ``check_readable`` at load (an unclassified attention setting) ends the
    construction with the refusal's words, not a later read of wrong numbers."""
    from probehook import LLM, tiny_model_path
    from probehook.adapter.worker import kv_cache
    from probehook.errors import UnsupportedModelError

    def refuse(attention: Any, loading: bool = False) -> None:
        raise UnsupportedModelError(f"{attention.layer_name}: an unclassified setting")

    monkeypatch.setattr(kv_cache, "check_readable", refuse)
    with pytest.raises(Exception, match=r"model.layers.2.self_attn.attn: an unclassified setting"):
        LLM(str(tiny_model_path()), attention_layers=[2], enforce_eager=True, max_model_len=64,
            dtype="float32")  # fmt: skip


def test_a_capture_only_engine_reads_the_attention_of_the_layers_it_keeps() -> None:
    """``LLM(capture_only=True, attention_layers=[2])``: one forward pass per prompt that
    stops after layer 2, and every prompt row's attention at layer 2 (nothing else asked)
    equal to Hugging Face's eager attention."""
    from transformers import AutoModelForCausalLM

    from probehook import LLM, tiny_model_path

    path = str(tiny_model_path())
    llm = LLM(path, capture_only=True, attention_layers=[2], attention_top_k=K,
              enforce_eager=True, max_model_len=64, dtype="float32")  # fmt: skip
    try:
        outs = llm.capture(["12+34=46.", "1+2+3="], use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    for out in outs:
        with torch.no_grad():
            want = hf(torch.tensor([out.prompt_token_ids]), output_attentions=True).attentions
        rows = out.prefill_attention[2]
        assert sorted(out.prefill_attention) == [2] and len(rows) == len(out.prompt_token_ids)
        assert_readings_match(readings_of(rows), want[2][0].transpose(0, 1), [])


def test_attention_layers_alone() -> None:
    """``LLM(model, attention_layers=[1])`` and nothing else of probehook's: the generated
    rows' attention at the default k (8), no prompt rows (``include_prefill`` off), equal to
    Hugging Face; ``attention_min_p`` or ``attention_top_k`` without ``attention_layers`` is
    refused by name before an engine starts."""
    from transformers import AutoModelForCausalLM

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.errors import CaptureConfigError

    path = str(tiny_model_path())
    for option in ("attention_min_p", "attention_top_k"):
        with pytest.raises(CaptureConfigError, match=rf"{option}=.*attention_layers"):
            LLM(path, **{option: 0.5 if option.endswith("min_p") else 4})
    llm = LLM(path, attention_layers=[1], enforce_eager=True, max_model_len=64, dtype="float32")
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        out = llm.generate("12+34=", params)[0]
    finally:
        llm.shutdown()
    rows = out.outputs[0].attention[1]
    assert rows.k == 8 and out.prefill_attention == {} and len(rows) == 6
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_attentions=True).attentions[1][0].transpose(0, 1)
    probs = want[len(out.prompt_token_ids) - 1 :]
    top = probs.topk(8, dim=-1)
    torch.testing.assert_close(rows.probs[..., : top.values.shape[-1]], top.values, rtol=0,
                               atol=1e-4)  # fmt: skip
    assert_readings_match(readings_of(rows.top(4)), probs, [])  # its bounds at k = 4
