"""A readout is one entry of the readout table: the test-only toy readouts of
tests/toy_readout.py (each row's norm as a one-entry top-k; a top-k per head with a second
scalar column), registered by one line each and named nowhere in probehook, reach offline
outputs (prompt and generated rows, per-request picks and k), ``AsyncLLM`` streams,
``probehook serve`` choices and chunks (on tests/test_server.py's server:
``test_a_registered_readout_is_served_in_choices_and_chunks``), the store and the viewer,
equal to what the same rows the engine captures give.

An intervention is one entry of the write table: the test-only toy intervention of
tests/toy_intervention.py (the stream at a layer's input scaled by a request's factor), on the
same engines, equals Hugging Face with the same scale at the same layer's input, leaves the
other requests of its batch alone, and what it applied reaches outputs, streams, the server
(``test_a_registered_intervention_is_served``), the store and the viewer."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.engine

PROMPT = "12+34="
TOKENS = 4
ENGINE = dict(enforce_eager=True, max_model_len=64, seed=0, dtype="float32")


@pytest.fixture(scope="module")
def registered() -> Iterator[Any]:
    """The one registration line, in this process (the engines' other processes take the
    entry point below)."""
    from toy_intervention import RowScale
    from toy_readout import ChunkPeaks, RowNorm

    from probehook.outputs import OUTPUT_PROCESSORS

    list(OUTPUT_PROCESSORS)  # the entry points this process sees, loaded before (once)
    OUTPUT_PROCESSORS.register(RowNorm)
    OUTPUT_PROCESSORS.register(ChunkPeaks)
    OUTPUT_PROCESSORS.register(RowScale)
    yield RowNorm
    OUTPUT_PROCESSORS.unregister(RowNorm.name)
    OUTPUT_PROCESSORS.unregister(ChunkPeaks.name)
    OUTPUT_PROCESSORS.unregister(RowScale.name)


def norm_of(rows: torch.Tensor) -> torch.Tensor:
    return rows.float().norm(dim=1)


def assert_norms(got: Any, rows: torch.Tensor) -> None:
    assert got.indices.tolist() == [[0]] * len(rows) and got.l0.tolist() == [1] * len(rows)
    torch.testing.assert_close(got.values[:, 0], norm_of(rows), rtol=1e-5, atol=1e-5)


HEADS = 4


def assert_peaks(got: Any, rows: torch.Tensor, k: int) -> None:
    """The per-head toy readout of ``rows``: each chunk's top ``k`` (offsets exact: the same
    rows), its norm, and the row's mean (the second scalar)."""
    chunks = rows.float().reshape(len(rows), HEADS, -1)
    peaks, offsets = chunks.topk(k, dim=-1)
    assert got.offsets.shape == (len(rows), HEADS, k) and torch.equal(got.offsets, offsets)
    torch.testing.assert_close(got.peaks, peaks, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.chunk_norms, chunks.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.mean, rows.float().mean(dim=1), rtol=1e-5, atol=1e-4)


def halfway_below(values: torch.Tensor) -> float:
    """A threshold just below ``values[0]``, above every smaller value, at least 1e-4 from
    each (rows of another batch than these differ in the last bit)."""
    lower = values[torch.isfinite(values) & (values < values[0] - 1e-3)]
    below = float(lower.max()) if len(lower) else float(values[0]) - 1.0
    return (float(values[0]) + below) / 2


def discriminating_entry(peaks: Any) -> tuple[int, float]:
    """An offset among decode row 0's peaks and a threshold just below its value there (the
    largest among the heads), where reading the packed row as the three-column layout (the
    stop processor without the schema's entry count) would not cross: a forced stop on row 0
    then proves the worker reads the per-head layout."""
    from toy_readout import PeakRows

    from probehook.core.monitors import top_k_value
    from probehook.outputs.top_k_readout import pack

    first = peaks.rows(0, 1)
    row = pack(first.offsets, first.peaks, first.chunk_norms, PeakRows, mean=first.mean)[0]
    for offset in first.offsets.flatten().tolist():
        above = halfway_below(peaks.value_of(offset, -math.inf))
        if top_k_value(row.numpy(), offset, -math.inf) < above - 1e-3:
            return int(offset), above
    raise AssertionError("no peak tells the per-head layout from the three-column one")


def test_offline_outputs_picks_and_the_store(registered, tmp_path: Path) -> None:
    """Also the readout's own monitor (``NormMonitor``, declared in the toy's module alone):
    an engine flag monitor, a request's flag monitor in dict form, and a request's stop
    monitor that the worker forces (the stop token) and the front end names."""
    from toy_readout import NormMonitor, PeakMonitor

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.store import ActivationStore

    llm = LLM(str(tiny_model_path()), layers=[1, 3], include_prefill=True,
              norms={"n1": 1, "n3": 3}, store=tmp_path / "store",
              peaks={"p3": {"layer": 3, "heads": HEADS}}, peaks_top_k=3, scale_layers=[0, 2],
              monitors=[NormMonitor("n1", 0.0)], attention_layers=[3], attention_top_k=4,
              **ENGINE)  # fmt: skip
    try:
        params = [
            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
            SamplingParams(
                max_tokens=TOKENS,
                temperature=0,
                ignore_eos=True,
                extra_args={"probehook": {"norms": ["n3"], "peaks_top_k": 1}},
            ),  # fmt: skip
        ]
        every, picked = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
        # the per-head readout's monitors: an entry's largest value among the heads
        offset, above = discriminating_entry(every.outputs[0].chunk_peaks["p3"])
        peak_flag = {"peaks": "p3", "offset": offset, "threshold": above, "action": "flag"}
        peak_flagged = llm.generate(PROMPT, SamplingParams(
            max_tokens=TOKENS, temperature=0, ignore_eos=True,
            extra_args={"probehook": {"monitors": [peak_flag]}}), use_tqdm=False)[0]  # fmt: skip
        peak_stopped = llm.generate(PROMPT, SamplingParams(
            max_tokens=TOKENS, temperature=0, ignore_eos=True,
            extra_args={"probehook": {"monitors": [PeakMonitor("p3", offset, above, "stop")]}}),
            use_tqdm=False)[0]  # fmt: skip
        norms = every.outputs[0].row_norms["n3"].values[:, 0]
        # halfway between two norms (rows of another batch than these differ in the last bit)
        ordered = norms.sort().values
        half = len(ordered) // 2
        assert ordered[half] - ordered[half - 1] > 1e-4
        middle = float((ordered[half - 1] + ordered[half]) / 2)
        flag = {"norm": "n3", "threshold": middle, "action": "flag"}
        flagged = llm.generate(PROMPT, SamplingParams(
            max_tokens=TOKENS, temperature=0, ignore_eos=True,
            extra_args={"probehook": {"monitors": [flag]}}), use_tqdm=False)[0]  # fmt: skip
        first = int((norms > middle).nonzero()[0])
        stop = NormMonitor("n3", middle, action="stop")
        stopped = llm.generate(PROMPT, SamplingParams(
            max_tokens=TOKENS, temperature=0, ignore_eos=True,
            extra_args={"probehook": {"monitors": [stop]}}), use_tqdm=False)[0]  # fmt: skip
        eos = llm.get_tokenizer().eos_token_id
        # the toy intervention, beside a request that writes nothing (one batch)
        scaled, beside = llm.generate([PROMPT, PROMPT], [
            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                           extra_args={"probehook": {"scale": {"L2": 0.25}}}),
            params[0]], use_tqdm=False)  # fmt: skip
        embeddings_scaled = llm.generate(PROMPT, SamplingParams(
            max_tokens=TOKENS, temperature=0, ignore_eos=True,
            extra_args={"probehook": {"scale": {"L0": 3.0}}}), use_tqdm=False)[0]  # fmt: skip
        with pytest.raises(Exception, match=r"scale names 'L1'; this engine scales \['L0', 'L2'\]"):
            llm.generate(PROMPT, SamplingParams(extra_args={"probehook": {"scale": {"L1": 2}}}))
    finally:
        llm.shutdown()
    assert_scaled_like_hf(scaled, 2, 0.25)
    assert_scaled_like_hf(embeddings_scaled, 0, 3.0)
    for got, want in ((beside, every), (beside, scaled)):  # untouched, and not what it did
        same = torch.allclose(got.outputs[0].hidden_states[3], want.outputs[0].hidden_states[3],
                              rtol=1e-4, atol=1e-4)  # fmt: skip
        assert same is (want is every)
    assert scaled.outputs[0].steering == {
        "vectors": {}, "phase": "both", "start": 0, "scale": {"L2": 0.25}}  # fmt: skip
    assert every.outputs[0].steering is None
    # The engine's monitor flags every row (a norm is above 0); the request's replaces it.
    assert every.outputs[0].norm_flags == {"n1": list(range(TOKENS))}
    assert flagged.outputs[0].norm_flags == {
        "n3": [i for i, v in enumerate(norms.tolist()) if v > middle]
    }
    completion = stopped.outputs[0]
    assert list(completion.token_ids) == list(every.outputs[0].token_ids[:first]) + [eos]
    assert completion.stop_reason == "norm:n3"
    for name, layer in (("n1", 1), ("n3", 3)):
        assert_norms(every.outputs[0].row_norms[name], every.outputs[0].hidden_states[layer])
        assert_norms(every.prefill_row_norms[name], every.prefill_hidden_states[layer])
    assert every.row_norms is every.outputs[0].row_norms  # mirrored like every readout
    assert set(picked.outputs[0].row_norms) == {"n3"}
    assert_norms(picked.outputs[0].row_norms["n3"], picked.outputs[0].hidden_states[3])
    stored = ActivationStore.open(tmp_path / "store")[every.store_id]
    for name in ("n1", "n3"):
        for got, want in (
            (stored.top_k("norm")[name], every.outputs[0].row_norms[name]),
            (stored.top_k("norm", "prefill")[name], every.prefill_row_norms[name]),
        ):
            assert torch.equal(got.indices, want.indices) and torch.equal(got.l0, want.l0)
            assert torch.equal(got.values, want.values)
    assert stored.sae_features == {}  # the SAEs' own accessor sees SAEs only
    picked_stored = ActivationStore.open(tmp_path / "store")[picked.store_id]
    # what the toy intervention applied: stored, and marked in the viewer in its own words
    from probehook.viewer.tokens import request_data

    stored_scaled = ActivationStore.open(tmp_path / "store")[scaled.store_id]
    assert stored_scaled.steering == scaled.outputs[0].steering
    for output in (scaled, stored_scaled):
        marks = request_data(output, str)["marks"]
        assert marks["writes"] == {"scale": "scaled the input of L2 by 0.25"}
    assert request_data(every, str)["marks"]["writes"] == {}
    assert set(picked_stored.top_k("norm")) == {"n3"}
    # The per-head readout with a second scalar: outputs, a request's k, flags, a forced stop
    # and the store (every column; the request that kept 1 reads back 1, padded to the run's 3)
    assert_peaks(every.outputs[0].chunk_peaks["p3"], every.outputs[0].hidden_states[3], 3)
    assert_peaks(every.prefill_chunk_peaks["p3"], every.prefill_hidden_states[3], 3)
    assert_peaks(picked.outputs[0].chunk_peaks["p3"], picked.outputs[0].hidden_states[3], 1)
    crossed = peak_flagged.outputs[0].chunk_peaks["p3"].value_of(offset, -math.inf) > above
    assert crossed[0] and peak_flagged.outputs[0].peak_flags == {
        f"p3:{offset}": crossed.nonzero().flatten().tolist()
    }
    assert list(peak_stopped.outputs[0].token_ids) == [eos]  # crossed on decode row 0
    assert peak_stopped.outputs[0].stop_reason == f"peaks:p3:{offset}"
    for got, want in (
        (stored.readout("peaks")["p3"], every.outputs[0].chunk_peaks["p3"]),
        (stored.readout("peaks", "prefill")["p3"], every.prefill_chunk_peaks["p3"]),
        (picked_stored.readout("peaks")["p3"], picked.outputs[0].chunk_peaks["p3"]),
    ):
        assert got.columns.keys() == want.columns.keys() == {
            "offsets", "peaks", "chunk_norms", "mean"}  # fmt: skip
        for name, column in want.columns.items():
            assert torch.equal(got.columns[name], column), name
    # ... and the viewer: a block and a norm series per head, the second scalar as a series,
    # a labelled entry as a series of its own; the stored request shows the same
    from probehook.viewer.tokens import request_data

    last_prompt = len(every.prompt_token_ids) - 1  # where decode row 0 is painted
    for output in (every, stored):
        data = request_data(output, str, labels={"p3": {offset: "the peak"}})
        blocks = {t["name"]: t for t in data["top_k"] if t["name"].startswith("chunk_peaks")}
        assert sorted(blocks) == [f"chunk_peaks p3 h{h}" for h in range(HEADS)]
        peaks = every.outputs[0].chunk_peaks["p3"]
        for head in range(HEADS):
            block = blocks[f"chunk_peaks p3 h{head}"]
            assert [i for i, _ in block["rows"][last_prompt]] == peaks.offsets[0, head].tolist()
            assert block["labels"] == {str(offset): "the peak"}
        series = {s["name"]: s["values"] for s in data["series"]}
        assert series["chunk_peaks p3 mean"][last_prompt] == pytest.approx(float(peaks.mean[0]))
        assert series["chunk_peaks p3 h2 norm"][0] == pytest.approx(
            float(every.prefill_chunk_peaks["p3"].chunk_norms[0, 2]))  # fmt: skip
        hit = next(h for h in range(HEADS) if offset in peaks.offsets[0, h].tolist())
        assert series[f"chunk_peaks p3 h{hit} #{offset} the peak"][last_prompt] > above


def assert_scaled_like_hf(output: Any, layer: int, factor: float) -> None:
    """``output``'s rows (prompt and generated, layers 1 and 3) equal a Hugging Face forward
    of the same tokens whose layer ``layer`` input is scaled by ``factor``."""
    from probehook import tiny_model_path
    from probehook.testing import _hf_model, hf_residual_stream

    model = _hf_model(str(tiny_model_path()), torch.float32)

    def scale(_module: Any, args: tuple, kwargs: dict) -> tuple:
        if args:
            return (args[0] * factor, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * factor}

    handle = model.model.layers[layer].register_forward_pre_hook(scale, with_kwargs=True)
    try:
        completion = output.outputs[0]
        ids = [*output.prompt_token_ids, *completion.token_ids[:-1]]
        want = hf_residual_stream(tiny_model_path(), ids)
    finally:
        handle.remove()
    n = len(output.prompt_token_ids)
    for at in (1, 3):
        got = torch.cat([output.prefill_hidden_states[at], completion.hidden_states[at][1:]])
        torch.testing.assert_close(got, want[at], rtol=1e-4, atol=1e-4)
    assert len(completion.hidden_states[1]) == TOKENS and n + TOKENS - 1 == len(ids)
    # the attention readout reads the scaled run's queries and keys (issue 51)
    assert_attention_matches_hf(output.prompt_token_ids, completion.token_ids,
                                completion.attention[3], 3, scaled=(layer, factor),
                                prefill=output.prefill_attention[3])  # fmt: skip


def test_async_llm_streams_it(registered, entry_point_root: Path, monkeypatch) -> None:
    """Every cumulative yield holds every token's norm to date; the engine core (a process of
    its own, spawned with this process's sys.path) knows the readout by its entry point (and
    the toy intervention: every yield of a scaled request says what it applied). A
    built-in top-k readout beside it (the logit lens at the last layer) streams the same way:
    every yield holds every token's reading to date, each token's target log-prob vLLM's own
    log-prob of the sampled token. Attention per head streams too (issue 51): every yield of a
    request that names a head and a span holds every token's reading to date, those heads and
    spans, the last equal to Hugging Face's eager attention."""
    from transformers import AutoTokenizer

    from probehook import AsyncLLM, SamplingParams, tiny_model_path

    monkeypatch.syspath_prepend(str(entry_point_root))
    engine = AsyncLLM(
        str(tiny_model_path()), layers=[3], norms={"n3": 3}, lenses={"l": "logit"},
        lens_layers=[3], peaks={"p3": {"layer": 3, "heads": HEADS}}, scale_layers=[1],
        attention_layers=[2], attention_top_k=4, **ENGINE,
    )  # fmt: skip
    # A lens flag monitor on the stream: every yield flags the rows to date where token 10's
    # log-prob under the lens is above -1 (the tiny model's "6": "12+34=46").
    watch = {"lens": "l", "layer": 3, "token": 10, "threshold": -1.0}
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0,
                            extra_args={"probehook": {"monitors": [watch]}})  # fmt: skip

    flags: list[list[int]] = []
    applied: list[Any] = []
    attention: list[Any] = []

    async def main() -> list[tuple[int, Any, Any, Any, Any]]:
        seen = []
        async for out in engine.generate(PROMPT, params, "stream"):
            c = out.outputs[0]
            seen.append((len(c.token_ids), c.row_norms["n3"], c.hidden_states[3],
                         c.lens["l"][3], c.logprobs))  # fmt: skip
            assert_peaks(c.chunk_peaks["p3"], c.hidden_states[3], 2)  # the per-head one
            flagged = torch.nonzero(c.lens["l"][3].value_of(10, -math.inf) > -1.0).flatten()
            assert c.lens_flags == {"l@3:10": flagged.tolist()}
            flags.append(c.lens_flags["l@3:10"])
        scaled = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                extra_args={"probehook": {"scale": 0.5}})  # fmt: skip
        async for out in engine.generate(PROMPT, scaled, "scaled"):  # the toy intervention
            applied.append(out.outputs[0].steering)
        asking = {"attention_heads": [1, 3], "attention_spans": {"s": [0, 3]}}
        attending = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                                   extra_args={"probehook": asking})  # fmt: skip
        async for out in engine.generate(PROMPT, attending, "attending"):
            attention.append((list(out.outputs[0].token_ids), out.outputs[0].attention[2]))
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        engine.shutdown()
    assert seen and seen[-1][0] == TOKENS
    assert flags[-1] == [1]  # "6", the second token
    assert applied and all(a["scale"] == {"L1": 0.5} for a in applied)
    for tokens, norms, rows, lens, _ in seen:
        assert len(norms) == tokens == len(lens)
        assert_norms(norms, rows)
        assert torch.equal(lens.token_ids, seen[-1][3].token_ids[:tokens])
    final = seen[-1]
    vllm = torch.tensor([next(iter(p.values())).logprob for p in final[4]])
    torch.testing.assert_close(final[3].target_logprob, vllm, atol=1e-4, rtol=0)
    assert len(attention) > 1 and len(attention[-1][0]) == TOKENS
    token_ids, last = attention[-1]
    for tokens, rows in attention:
        assert len(rows) == len(tokens) and rows.heads == (1, 3) and list(rows.spans) == ["s"]
        for name, column in rows.columns.items():
            assert torch.equal(column, last.columns[name][: len(tokens)]), name
    prompt_ids = AutoTokenizer.from_pretrained(str(tiny_model_path()))(PROMPT).input_ids
    assert_attention_matches_hf(prompt_ids, token_ids, last, 2, heads=[1, 3], span=(0, 3))


def assert_attention_matches_hf(
    prompt_ids: list[int],
    token_ids: list[int],
    rows: Any,
    layer: int,
    heads: list[int] | None = None,
    span: tuple[int, int] | None = None,
    scaled: tuple[int, float] | None = None,
    prefill: Any = None,
) -> None:
    """Generated rows (and the prompt's, ``prefill``) of one layer's attention readout equal
    the tiny model's eager attention (test_attention_rows' bounds): those heads, that span's
    mass; ``scaled``: with layer ``scaled[0]``'s input scaled by ``scaled[1]`` (the toy
    intervention)."""
    from test_attention_rows import assert_readings_match, readings_of
    from transformers import AutoModelForCausalLM

    from probehook import tiny_model_path

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    if scaled is not None:
        at, factor = scaled

        def scale(_module: Any, args: tuple, kwargs: dict) -> tuple:
            if args:
                return (args[0] * factor, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * factor}

        hf.model.layers[at].register_forward_pre_hook(scale, with_kwargs=True)
    with torch.no_grad():
        want = hf(torch.tensor([[*prompt_ids, *token_ids[:-1]]]), output_attentions=True)
    probs = want.attentions[layer][0].transpose(0, 1)  # [rows, heads, keys]
    probs = probs if heads is None else probs[:, heads]
    n = len(prompt_ids)
    for got, expected in ((rows, probs[n - 1 :]), (prefill, probs[:n])):
        if got is not None:
            assert len(got) == len(expected)
            assert_readings_match(readings_of(got), expected, [span] if span else [])


def test_a_readout_that_reads_next_tokens_gets_them_from_the_generic_bank() -> None:
    """``reads_next_token`` is generic (review D10: only the lens bank got next tokens): the
    toy ``NextToken`` readout's rows hold each row's next token, the prompt's next prompt token
    and each generated token after sampling; on prompt rows and generated rows alike."""
    from toy_readout import NextToken

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.outputs import OUTPUT_PROCESSORS

    list(OUTPUT_PROCESSORS)
    OUTPUT_PROCESSORS.register(NextToken)
    try:
        llm = LLM(str(tiny_model_path()), include_prefill=True, nexts={"t": 2}, **ENGINE)
        try:
            params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
            out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        finally:
            llm.shutdown()
    finally:
        OUTPUT_PROCESSORS.unregister(NextToken.name)
    decode = out.outputs[0].next_tokens["t"]
    generated = list(out.outputs[0].token_ids)
    # decode row i is computed on position n_prompt - 1 + i; the token after it is token i
    assert decode.indices[:, 0].tolist() == generated[: len(decode)]
    prompt = out.prefill_next_tokens["t"]
    assert prompt.indices[:, 0].tolist() == list(out.prompt_token_ids[1:]) + generated[:1]


def test_an_intervention_alone_writes_on_an_engine_that_captures_nothing(registered) -> None:
    """``scale_layers=`` is the engine's only probehook option: the scaled request's greedy
    tokens are Hugging Face's with the same scale at layer 1's input, a request beside it in
    the batch gets the plain model's, and what it applied is on its completion."""
    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.testing import _hf_model

    llm = LLM(str(tiny_model_path()), scale_layers=[1], **ENGINE)
    try:
        greedy = dict(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        plain, scaled = llm.generate([PROMPT, PROMPT], [
            SamplingParams(**greedy),
            SamplingParams(**greedy, extra_args={"probehook": {"scale": -0.5}})],
            use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    model = _hf_model(str(tiny_model_path()), torch.float32)

    def assert_greedy_under_hf(output: Any, factor: float) -> None:
        """Each generated token is Hugging Face's argmax (within 1e-4 of its largest logit:
        a near tie may go either way on another CPU) with the prompt and the tokens before
        it as input, layer 1's input scaled by ``factor``."""

        def scale(_module: Any, args: tuple, kwargs: dict) -> tuple:
            if args:
                return (args[0] * factor, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * factor}

        handle = model.model.layers[1].register_forward_pre_hook(scale, with_kwargs=True)
        generated = list(output.outputs[0].token_ids)
        ids = [*output.prompt_token_ids, *generated]
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids[:-1]])).logits[0, -len(generated) :]
        finally:
            handle.remove()
        chosen = logits.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
        assert (chosen >= logits.max(dim=1).values - 1e-4).all(), (factor, generated)

    assert_greedy_under_hf(scaled, -0.5)
    assert_greedy_under_hf(plain, 1.0)
    assert scaled.outputs[0].token_ids != plain.outputs[0].token_ids  # it did something
    assert scaled.outputs[0].steering["scale"] == {"L1": -0.5}


@pytest.mark.parametrize("option", ["norms", "peaks"])
def test_each_toy_readout_alone_equals_its_reading_of_hugging_face_s_rows(
    registered, option: str
) -> None:
    """Each toy readout's engine option as the engine's only probehook option (no layers
    captured): its prompt and generated rows equal the readout applied to Hugging Face's
    stream after layer 3 for the same tokens (within 1e-4: another batch shape)."""
    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.testing import hf_residual_stream

    given = {"norms": {"n3": 3}, "peaks": {"p3": {"layer": 3, "heads": HEADS}}}[option]
    llm = LLM(str(tiny_model_path()), include_prefill=True, **{option: given}, **ENGINE)
    try:
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
    rows = hf_residual_stream(tiny_model_path(), ids)[3]
    n = len(out.prompt_token_ids)
    if option == "norms":
        got = [
            out.prefill_row_norms["n3"].values[:, 0],
            out.outputs[0].row_norms["n3"].values[:, 0],
        ]
        want = norm_of(rows)
    else:
        peaks = (out.prefill_chunk_peaks["p3"], out.outputs[0].chunk_peaks["p3"])
        got = [p.chunk_norms for p in peaks]
        want = rows.reshape(len(rows), HEADS, -1).norm(dim=-1)
        top = rows.reshape(len(rows), HEADS, -1).topk(2, dim=-1).values  # values: ties may swap
        torch.testing.assert_close(peaks[0].peaks, top[:n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(peaks[1].peaks, top[n - 1 :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[n - 1 :], rtol=1e-4, atol=1e-4)
    assert out.outputs[0].hidden_states == {}  # nothing else captured
