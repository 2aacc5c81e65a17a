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
from test_attention_rows import assert_readings_match

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

    def tapping(model: Any, *args: Any, **kwargs: Any) -> Any:
        hook = install_taps(model, *args, **kwargs)
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


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_the_attention_readout_equals_hugging_face_offline(eager: bool, tmp_path) -> None:
    """``LLM(attention_layers=[0, 3], attention_top_k=4, include_prefill=True)``: every prompt
    and generated row's ``attention[layer]`` (positions, probs, entropy per head) equals
    Hugging Face's eager ``output_attentions`` of the same tokens; a request that narrows to
    one layer gets that layer; ``"attention": False`` gets none; a layer the engine does not
    read is refused by name, the engine alive. The store keeps every column bit-equal and the
    viewer shows a block per head with its top keys."""
    from transformers import AutoModelForCausalLM

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.errors import CaptureConfigError

    llm = LLM(str(tiny_model_path()), attention_layers=[0, 3], attention_top_k=K,
              include_prefill=True, block_size=32, enforce_eager=eager, max_model_len=64,
              seed=0, dtype="float32", store=tmp_path / "store")  # fmt: skip
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    try:
        outs = llm.generate(["12+34=", "1+2+3+4+5+6+7+8+9+10="], SamplingParams(**greedy),
                            use_tqdm=False)  # fmt: skip
        narrowed, off = llm.generate(["12+34="] * 2, [
            SamplingParams(**greedy, extra_args={"probehook": {"attention_layers": [3]}}),
            SamplingParams(**greedy, extra_args={"probehook": {"attention": False}})],
            use_tqdm=False)  # fmt: skip
        with pytest.raises(CaptureConfigError, match=r"names layer\(s\) \[1\], whose attention"):
            llm.generate(
                "1+1=", SamplingParams(extra_args={"probehook": {"attention_layers": [1]}})
            )
        assert llm.generate("1+1=", SamplingParams(max_tokens=1))[0].outputs[0].text is not None
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    for out in [*outs, narrowed]:
        ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
        n = len(out.prompt_token_ids)
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_attentions=True).attentions
        layers = [3] if out is narrowed else [0, 3]
        assert (
            sorted(out.outputs[0].attention) == layers and out.attention is out.outputs[0].attention
        )
        for layer in layers:
            probs = want[layer][0].transpose(0, 1)  # [rows, heads, keys]
            prompt, decode = out.prefill_attention[layer], out.outputs[0].attention[layer]
            assert prompt.positions.shape == (n, 4, K) and decode.heads == (0, 1, 2, 3)
            assert_readings_match(_readings(prompt), probs[:n], [])
            assert_readings_match(_readings(decode), probs[n - 1 :], [])
    assert off.outputs[0].attention == {} and off.prefill_attention == {}
    from probehook.store import ActivationStore
    from probehook.viewer.tokens import request_data

    stored = ActivationStore.open(tmp_path / "store")[outs[0].store_id]
    for got, want in (
        (stored.readout("attention")[3], outs[0].outputs[0].attention[3]),
        (stored.readout("attention", "prefill")[0], outs[0].prefill_attention[0]),
    ):
        for name, column in want.columns.items():
            assert torch.equal(got.columns[name], column), name  # fmt: skip
    data = request_data(outs[0], str)
    blocks = {t["name"]: t for t in data["top_k"] if t["name"].startswith("attention")}
    assert sorted(blocks) == [f"attention {layer} h{h}" for layer in (0, 3) for h in range(4)]
    n = len(outs[0].prompt_token_ids)
    first = outs[0].outputs[0].attention[3]
    assert [p for p, _ in blocks["attention 3 h2"]["rows"][n - 1]] == [
        p for p in first.positions[0, 2].tolist() if p >= 0]  # fmt: skip


def _readings(rows: Any) -> Any:
    """The readout's rows as ``head_readings`` gives them (no spans yet)."""
    from probehook.worker.attention_rows import HeadReadings

    return HeadReadings(rows.positions, rows.probs, rows.entropy,
                        torch.zeros(*rows.entropy.shape, 0))  # fmt: skip
