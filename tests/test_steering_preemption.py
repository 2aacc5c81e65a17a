"""Steered requests under preemption never run the steering table out (issue 37, item 1).

The table has ``max_num_seqs + 1`` rows. vLLM's runner keeps a preempted request in its
``requests``, so a slot freed only when a request leaves ``requests`` stays held while the
request waits. With ``scheduling_policy="priority"`` a later, more urgent arrival runs ahead
of a preempted request: running plus preempted steered requests then outnumber the table, and
the old code raised "no free steering slot" inside the forward pass, which ended the engine
and every request in it.

The arrivals are staged step by step on an in-process engine (deterministic, unlike wall-clock
arrivals): each request arrives ``GAP`` steps after the last, more urgent than all before it,
into a KV cache that holds about one and a half requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

REQUESTS = 6
MAX_TOKENS = 100
GAP = 12  # steps between arrivals
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8=", "2+2=", "9+1="]


def _params(steer: bool) -> Any:
    from probehook import SamplingParams

    options = {"steer": {"up": 3.0}} if steer else {}
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, extra_args={"probehook": options}
    )


def _staged(llm: Any, params: list[Any]) -> dict[str, Any]:
    """Adds request i at step i * GAP with priority REQUESTS - i (lower is more urgent in
    vLLM), steps the engine until all finish; returns finished outputs by prompt."""
    finished: dict[str, Any] = {}
    step = 0
    arrivals = list(enumerate(zip(PROMPTS, params, strict=True)))
    while arrivals or llm.llm_engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] * GAP <= step:
            i, (prompt, p) = arrivals.pop(0)
            llm._add_request(prompt, p, priority=REQUESTS - i)
        done = [o for o in llm.llm_engine.step() if o.finished]
        llm.session.fill(done)
        finished.update((o.prompt, o) for o in done)
        step += 1
    return finished


def test_steered_requests_survive_preemption_by_more_urgent_arrivals(
    llama_dir: Path, engine_defaults: dict
) -> None:
    from helpers import reference_steering

    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        layers=[3],
        enforce_eager=True,
        steering={"up": reference_steering()},
        scheduling_policy="priority",
        max_num_seqs=2,
        num_gpu_blocks_override=5,  # 160 tokens: one request (about 105) and a half
        block_size=32,
        enable_prefix_caching=False,
        **{**engine_defaults, "max_model_len": 128},
    )
    with llm:
        staged = _staged(llm, [_params(True)] * REQUESTS)
        stats = llm.collective_rpc("probehook_stats")[0]
        # The scenario happened: steered requests were preempted while others ran.
        assert stats["steering_slots_reclaimed"] > 0, stats
        assert sorted(staged) == sorted(PROMPTS)
        # Each steered request generated what it generates alone (no preemption): a request
        # that got its slot back after waiting is steered by the same sum as before.
        alone = {p: llm.generate([p], _params(True), use_tqdm=False)[0] for p in PROMPTS}
        plain = llm.generate(PROMPTS[:1], _params(False), use_tqdm=False)[0]
        for prompt in PROMPTS:
            tokens = list(staged[prompt].outputs[0].token_ids)
            assert len(tokens) == MAX_TOKENS
            assert tokens == list(alone[prompt].outputs[0].token_ids), prompt
            assert staged[prompt].hidden_states[3].shape[0] == MAX_TOKENS
        assert list(plain.outputs[0].token_ids) != list(alone[PROMPTS[0]].outputs[0].token_ids)
