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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.engine

REQUESTS = 6
MAX_TOKENS = 100
GAP = 12  # steps between arrivals
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8=", "2+2=", "9+1="]


def _params(steer: bool, **kwargs: Any) -> Any:
    from probehook import SamplingParams

    options = {"steer": {"up": 3.0}} if steer else {}
    settings = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kwargs}
    return SamplingParams(**settings, extra_args={"probehook": options})


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


@pytest.fixture(scope="module")
def steered(llama_dir: Path, engine_defaults: dict) -> Iterator[Any]:
    """In-process, steering "up" at layer 2, capturing layer 3, priority scheduling, two
    requests at a time in a KV cache of 160 tokens (one request of about 105 and a half)."""
    from helpers import reference_steering

    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        layers=[3],
        enforce_eager=True,
        steering={"up": reference_steering()},
        scheduling_policy="priority",
        max_num_seqs=2,
        num_gpu_blocks_override=5,
        block_size=32,
        enable_prefix_caching=False,
        **{**engine_defaults, "max_model_len": 128},
    )
    yield llm
    llm.shutdown()


def test_steered_requests_survive_preemption_by_more_urgent_arrivals(steered: Any) -> None:
    llm = steered
    staged = _staged(llm, [_params(True)] * REQUESTS)
    stats = llm.collective_rpc("probehook_stats")[0]
    # The scenario happened: steered requests were preempted while others ran.
    assert stats["steering_slots_reclaimed"] > 0, stats
    assert stats["steering_failures"] == 0, stats
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


STEERING_CORRUPTIONS = [
    # (key, value) set in a valid wire of a steered request, past the front end: what a path
    # that skipped it could send the worker
    ("steer", "up"),
    ("steer", ["up"]),
    ("steer", {"up": "x"}),
    ("steer", {"up": float("nan")}),
    ("steer", {"up": [1.0]}),
    ("steer", {"gone": 1.0}),  # a vector the bank does not hold
    ("steer", {"": 1.0}),
    ("steer_phase", "middle"),
    ("steer_phase", None),
    ("monitors", [{"probe": "truth", "threshold": 0.5, "column": 0, "action": "steer"}]),
    (
        "monitors",
        [{"probe": "g", "threshold": 0.5, "column": 0, "action": "steer", "steer": {"gone": 1}}],
    ),
]


def test_a_corrupt_steering_wire_fails_its_request_alone(steered: Any, monkeypatch) -> None:
    """Steering wires the front end would never write, each between two good steered
    requests in one batch: the engine never raises in the step, the corrupt request ends
    with its capture failed and the reason named, its neighbours are steered as alone."""
    from helpers import corrupt_wires_past_the_front_end

    from probehook import CaptureError

    llm = steered
    prompts = [f"{i}+{i % 7}=" for i in range(2 * len(STEERING_CORRUPTIONS) + 1)]
    short = dict(max_tokens=4)
    reference = {
        p: llm.generate([p], _params(True, **short), use_tqdm=False)[0] for p in prompts[::2]
    }
    corrupt_wires_past_the_front_end(llm.session, monkeypatch, STEERING_CORRUPTIONS)
    params = [_params(True, seed=i, **short) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    for out in outs:
        i = prompts.index(out.prompt)
        assert len(out.outputs[0].token_ids) == 4
        if i % 2 == 0:
            want = reference[out.prompt]
            assert list(out.outputs[0].token_ids) == list(want.outputs[0].token_ids), i
            torch.testing.assert_close(out.hidden_states[3], want.hidden_states[3])
            continue
        with pytest.raises(CaptureError, match="could not read this request's probehook"):
            out.hidden_states[3]


def test_a_request_the_worker_cannot_steer_fails_alone(steered: Any) -> None:
    """Whatever goes wrong while the worker gives a request its steering (staged here: the
    bank's sum raises for one scale) fails that request's capture with the reason, and the
    step, the engine and the other requests go on (issue 37, item 1): here writing its terms
    into its table row raises for one scale."""
    from probehook import CaptureError

    llm = steered

    def break_sums(worker: Any) -> None:  # runs in the worker: this process (in-process)
        bank = _steer(worker).bank
        write = type(bank).write

        def failing(table: Any, slot: int, layer: int, terms: Any) -> Any:
            if any(scale == 7.0 for _, scale in terms):
                raise RuntimeError("staged: this sum cannot be made")
            return write(bank, table, slot, layer, terms)

        bank.write = failing

    def mend(worker: Any) -> None:
        del _steer(worker).bank.write

    prompts = ["1+2=", "3+4=", "5+6="]
    short = {"max_tokens": 4}
    alone = {p: llm.generate([p], _params(True, **short), use_tqdm=False)[0] for p in prompts}
    before = llm.collective_rpc("probehook_stats")[0]["steering_failures"]
    llm.collective_rpc(break_sums)
    try:
        bad = _params(True, **short)
        bad.extra_args["probehook"]["steer"] = {"up": 7.0}
        params = [_params(True, **short), bad, _params(True, **short)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.collective_rpc(mend)
    assert llm.collective_rpc("probehook_stats")[0]["steering_failures"] == before + 1
    for i, out in enumerate(outs):
        assert len(out.outputs[0].token_ids) == 4
        if i == 1:
            with pytest.raises(CaptureError, match="could not steer it .*staged: this sum"):
                out.hidden_states[3]
            continue
        assert list(out.outputs[0].token_ids) == list(alone[out.prompt].outputs[0].token_ids)


def _steer(worker: Any) -> Any:
    """The worker's steering (the step hook's, allocated at load)."""
    from probehook.adapter.worker.surgery import step_hook

    return step_hook(worker.model_runner.get_model()).steer
