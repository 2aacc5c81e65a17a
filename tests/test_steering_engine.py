"""Steering in a real engine: attribution under load, the bank while the engine runs,
probe-gated steering, the store, and the errors a user gets before anything reaches the engine.

The engine here is eager (its checks are about attribution, not compilation); compiled mode,
Hugging Face parity and "no recompilation" are tests/test_steering_parity.py's compiled engine.

The checks use an identity that needs no reference model: the residual stream after the first
steered layer ``L`` at a position is the unsteered stream there plus the request's vector sum,
as long as nothing before ``L`` was steered (the layer's inputs are then unchanged). The
Hugging Face comparison of steered generation is tests/test_steering_parity.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# The topology set's offline LLM (tests/README.md): capture, probes, steering and the store in
# one generate, with the engine core and worker in their own processes.
pytestmark = [pytest.mark.engine, pytest.mark.topology]
HIDDEN = 128
TOL = 1e-4
PROMPTS = [
    "12+34=56. 7+8=15. 9+",
    "1+2=",
    "99+99=198. 3+4=7. 50+5",
    "0",
    "7+7=14. 8+",
    "31+4=35. 2+2=4. 6+6=12. 1+",
]


def _vector(layer: int, seed: int, norm: float = 4.0) -> Any:
    from probehook import SteeringVector

    g = torch.Generator().manual_seed(seed)
    v = torch.randn(HIDDEN, generator=g)
    return SteeringVector({layer: v / v.norm() * norm})


@pytest.fixture(scope="module")
def vectors() -> dict[str, Any]:
    return {f"v{i}": _vector(1, seed=i) for i in range(4)}


@pytest.fixture(scope="module")
def steer_llm(
    llama_dir: Path, vectors: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """Under pressure (small prefill chunks, a KV cache small enough to force preemption,
    prefix caching on), steering layer 1 (and 2, for vectors added later), with a store."""
    from engine_layout import users_layout
    from helpers import random_probes

    from probehook import LLM

    with users_layout():
        llm = LLM(
            str(llama_dir),
            layers=[0, 1],
            include_prefill=True,
            probes={"g": random_probes(HIDDEN)["truth"]},
            store=tmp_path_factory.mktemp("steer") / "store",
            enforce_eager=True,
            steering=vectors,
            steering_layers=[2],
            steering_capacity=8,
            max_num_batched_tokens=32,
            max_num_seqs=16,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            num_gpu_blocks_override=12,
            block_size=32,
            dtype="float32",
            max_model_len=256,
            seed=0,
        )
    yield llm
    llm.shutdown()


def _params(steer: dict[str, float] | None = None, **kwargs: Any) -> Any:
    from probehook import SamplingParams

    options = dict(kwargs.pop("options", {}))
    if steer is not None:
        options["steer"] = steer
    defaults = dict(max_tokens=6, temperature=0, ignore_eos=True)
    return SamplingParams(**{**defaults, **kwargs}, extra_args={"probehook": options})


def _sum(vectors: dict[str, Any], steer: dict[str, float], layer: int) -> torch.Tensor:
    out = torch.zeros(HIDDEN)
    for name, scale in steer.items():
        if layer in vectors[name].layers:
            out += scale * vectors[name].vector(layer)
    return out


def test_engine_processes_were_started_with_v1(steer_llm) -> None:
    """In the user's layout the worker is a process of its own, started with probehook's V1
    setting in its environment (moved here from test_vllm_paths.py: an in-process worker
    shares the front end's environment, whose setting is restored after start-up)."""
    import os

    assert steer_llm.capture_info["runner_env"] == "0"
    assert steer_llm.capture_info["runner"].startswith("vllm.v1.worker.cpu_model_runner")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_banks_are_allocated_at_model_load(steer_llm, vectors) -> None:
    """The probe and steering banks come from the banks the loader decodes at model load
    (inside vLLM's memory profiling), not from an RPC after start-up: the worker's report says
    what it allocated there."""
    assert steer_llm.capture_info["banks"] == {
        "probe_outputs": 1,
        "steering_capacity": 8,
        "steering_vectors": sorted(vectors),
        "readouts": {},
    }


def test_64_combinations_in_one_batch_each_get_their_own_sum(steer_llm, vectors) -> None:
    """64 requests, each its own (vectors, scales), with n=2 on some, chunked prefill and
    preemption: every prompt row after layer 1 is the unsteered row plus that request's sum;
    layer 0 (before any steering) is untouched."""
    names = sorted(vectors)
    combos = []
    for i in range(64):
        a, b = names[i % 4], names[(i // 4) % 4]
        combos.append({a: 0.25 * (i + 1)} if a == b else {a: 0.5 + i / 8, b: -1.0 - i / 16})
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    plain = {p: o for p, o in zip(PROMPTS, steer_llm.generate(PROMPTS, _params()), strict=True)}
    before = steer_llm.collective_rpc("probehook_stats")[0]
    params = [
        _params(c, n=2, temperature=1.0) if i % 8 == 0 else _params(c) for i, c in enumerate(combos)
    ]
    outs = steer_llm.generate(prompts, params)
    after = steer_llm.collective_rpc("probehook_stats")[0]
    assert after["steps_steered"] > before["steps_steered"]
    for out, prompt, combo in zip(outs, prompts, combos, strict=True):
        base = plain[prompt]
        torch.testing.assert_close(
            out.prefill_hidden_states[0], base.prefill_hidden_states[0], atol=TOL, rtol=0
        )
        expected = base.prefill_hidden_states[1] + _sum(vectors, combo, 1)
        torch.testing.assert_close(out.prefill_hidden_states[1], expected, atol=TOL, rtol=0)
        for completion in out.outputs:
            assert completion.steering == {"vectors": combo, "phase": "both", "start": 0}
        # The first decode row is the prompt's last position: steered too.
        torch.testing.assert_close(
            out.outputs[0].hidden_states[1][0], expected[-1], atol=TOL, rtol=0
        )
    # Unsteered requests in a later batch are untouched (the slots were freed and cleared).
    again = steer_llm.generate(PROMPTS, _params())
    for out in again:
        base = plain[out.prompt]
        assert out.outputs[0].steering is None
        assert out.outputs[0].token_ids == base.outputs[0].token_ids
        torch.testing.assert_close(
            out.prefill_hidden_states[1], base.prefill_hidden_states[1], atol=TOL, rtol=0
        )


def test_phases_steer_only_their_positions(steer_llm, vectors) -> None:
    prompt = PROMPTS[0]
    plain = steer_llm.generate([prompt], _params())[0]
    prefill, decode = steer_llm.generate(
        [prompt, prompt],
        [
            _params({"v0": 2.0}, options={"steer_phase": "prefill"}),
            _params({"v0": 2.0}, options={"steer_phase": "decode"}),
        ],
    )
    v = 2.0 * vectors["v0"].vector(1)
    rows = plain.prefill_hidden_states[1]
    torch.testing.assert_close(prefill.prefill_hidden_states[1], rows + v, atol=TOL, rtol=0)
    # Decode phase: the prompt is untouched, so the first token is the unsteered one; the
    # first generated token's position (decode row 1) is steered.
    torch.testing.assert_close(decode.prefill_hidden_states[1], rows, atol=TOL, rtol=0)
    assert decode.outputs[0].token_ids[0] == plain.outputs[0].token_ids[0]
    prompt_len = len(plain.prompt_token_ids)
    assert decode.outputs[0].steering["start"] == prompt_len
    assert prefill.outputs[0].steering["start"] == 0


def test_prefix_cache_never_mixes_steering(steer_llm) -> None:
    """The same prompt steered (+), unsteered, steered (-), twice over, with prefix caching on
    and no prompt rows asked (so cached blocks are read): each run equals the same request
    computed without reading the cache (asking for prompt rows turns cache reads off)."""
    from probehook import SamplingParams

    prompt = "12+34=56. 7+8=15. 9+1=10. 33+3=36. 4+4=8. 5+5=10. 61+1=62. 2+7=9. 3+"  # 2 blocks

    def run(steer: dict[str, float] | None, read_cache: bool) -> list[int]:
        options: dict[str, Any] = {"include_prefill": not read_cache}
        if steer is not None:
            options["steer"] = steer
        params = SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, extra_args={"probehook": options}
        )
        return list(steer_llm.generate([prompt], params)[0].outputs[0].token_ids)

    kinds = [{"v1": 3.0}, None, {"v1": -3.0}]
    cold = [run(steer, read_cache=False) for steer in kinds]
    assert len({tuple(t) for t in cold}) == 3, cold  # the steering changes the tokens
    for _ in range(2):
        assert [run(steer, read_cache=True) for steer in kinds] == cold


def test_add_and_remove_while_running(steer_llm, vectors) -> None:
    from probehook import CaptureConfigError

    prompt = PROMPTS[2]
    plain = steer_llm.generate([prompt], _params())[0]
    new = _vector(1, seed=99, norm=3.0)
    steer_llm.add_steering("late", new)
    assert "late" in steer_llm.steering
    out = steer_llm.generate([prompt], _params({"late": 1.5}))[0]
    torch.testing.assert_close(
        out.prefill_hidden_states[1],
        plain.prefill_hidden_states[1] + 1.5 * new.vector(1),
        atol=TOL,
        rtol=0,
    )
    # A vector on layer 2 (a steering layer with no vector at construction): layer 1 rows stay.
    deep = _vector(2, seed=7)
    steer_llm.add_steering("deep", deep)
    out2 = steer_llm.generate([prompt], _params({"deep": 1.0}))[0]
    torch.testing.assert_close(
        out2.prefill_hidden_states[1], plain.prefill_hidden_states[1], atol=TOL, rtol=0
    )
    assert out2.outputs[0].token_ids != plain.outputs[0].token_ids
    steer_llm.remove_steering("late")
    steer_llm.remove_steering("deep")
    with pytest.raises(CaptureConfigError, match=r"'late'.*its vectors are \['v0'"):
        steer_llm.generate([prompt], _params({"late": 1.0}))
    # The bank holds 8: 4 at construction, then 4 more, then a clear error.
    for i in range(4):
        steer_llm.add_steering(f"extra{i}", _vector(1, seed=100 + i))
    with pytest.raises(CaptureConfigError, match=r"steering bank is full: 8 vectors"):
        steer_llm.add_steering("one_too_many", _vector(1, seed=200))
    for i in range(4):
        steer_llm.remove_steering(f"extra{i}")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda v: ("v0", v["v0"]), r"already in the bank"),
        (lambda v: ("x", _vector(5, seed=1)), r"layer 5.*4"),
        (lambda v: ("x", _vector(3, seed=1)), r"layer\(s\) \[3\].*steers only layers \[1, 2\]"),
        (lambda v: ("x", "not a vector"), r"probehook.SteeringVector"),
        (lambda v: ("", v["v0"]), r"non-empty string"),
    ],
)
def test_add_steering_refuses_what_the_engine_cannot_hold(steer_llm, vectors, build, message):
    from probehook import CaptureConfigError, SteeringVector

    name, vector = build(vectors)
    if name == "x" and isinstance(vector, SteeringVector) and vector.layers == (5,):
        message = r"layer 5"
    with pytest.raises(CaptureConfigError, match=message):
        steer_llm.add_steering(name, vector)


def test_wrong_hidden_size_names_both_sizes(steer_llm) -> None:
    from probehook import CaptureConfigError, SteeringVector

    with pytest.raises(CaptureConfigError, match=r"64.*128|128.*64"):
        steer_llm.add_steering("small", SteeringVector({1: torch.ones(64)}))


@pytest.mark.parametrize(
    ("steer", "options", "message"),
    [
        ({"nope": 1.0}, {}, r"'nope'.*its vectors are \['v0', 'v1', 'v2', 'v3'\]"),
        ({"v0": float("nan")}, {}, r"scale of 'v0' is nan.*finite"),
        ({"v0": float("inf")}, {}, r"scale of 'v0' is inf.*finite"),
        ({"v0": "1"}, {}, r"not a number"),
        ({"v0": 1.0}, {"steer_phase": "middle"}, r"steer_phase='middle'.*both"),
    ],
)
def test_bad_steering_in_a_request_is_refused_before_the_engine(
    steer_llm, steer, options, message
) -> None:
    from probehook import CaptureConfigError

    ok = _params()
    with pytest.raises(CaptureConfigError, match=message):
        steer_llm.generate(["1+2=", "3+4="], [ok, _params(steer, options=options)])
    assert steer_llm.generate(["1+2="], ok)[0].outputs[0].token_ids  # the engine is fine


def test_probe_gated_steering_starts_after_the_crossing(steer_llm, vectors) -> None:
    """The gate watches probe g's decode scores: rows and scores up to the crossing row equal
    the unsteered run's; the row of the next position is the unsteered one plus the vector."""
    from probehook import ProbeMonitor

    prompt = PROMPTS[1]
    plain = steer_llm.generate([prompt], _params(max_tokens=10))[0]
    scores = plain.outputs[0].probe_scores["g"].numpy()
    # a new maximum by a margin: another batch shape moves scores in their last bits only
    k = next(i for i in range(2, len(scores)) if scores[i] > scores[:i].max() + 1e-4)
    threshold = float((scores[:k].max() + scores[k]) / 2)
    gate = ProbeMonitor("g", threshold, action="steer", steer={"v2": 3.0})
    out = steer_llm.generate(
        [prompt], _params(max_tokens=10, options={"monitors": [gate.to_dict()]})
    )[0]
    completion = out.outputs[0]
    prompt_len = len(out.prompt_token_ids)
    assert completion.steering["start"] == prompt_len + k
    assert completion.steering["gate"]["probe"] == "g"
    assert completion.token_ids[: k + 1] == plain.outputs[0].token_ids[: k + 1]
    np.testing.assert_allclose(completion.probe_scores["g"][: k + 1], scores[: k + 1], atol=1e-5)
    rows, base = completion.hidden_states[1], plain.outputs[0].hidden_states[1]
    torch.testing.assert_close(rows[: k + 1], base[: k + 1], atol=TOL, rtol=0)
    # Decode row k + 1 is the position of token k (the same token in both runs), steered.
    v = 3.0 * vectors["v2"].vector(1)
    torch.testing.assert_close(rows[k + 1], base[k + 1] + v, atol=TOL, rtol=0)
    # A gate that never crosses: never steered, start None, tokens unchanged.
    never = ProbeMonitor("g", 1.0, action="steer", steer={"v2": 3.0})
    quiet = steer_llm.generate(
        [prompt], _params(max_tokens=10, options={"monitors": [never.to_dict()]})
    )[0]
    assert quiet.outputs[0].steering["start"] is None
    assert quiet.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_stored_record_says_which_steering_applied(steer_llm) -> None:
    from probehook import ActivationStore

    steered, plain = steer_llm.generate(["1+2=", "1+2="], [_params({"v3": 2.0}), _params()])
    store = ActivationStore.open(steer_llm.store.root)
    assert store[steered.store_id].steering == {
        "vectors": {"v3": 2.0},
        "phase": "both",
        "start": 0,
    }
    assert store[plain.store_id].steering is None
