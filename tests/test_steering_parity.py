"""Per-request steering agrees with Hugging Face: the acceptance test of engine steering.

One compiled engine (no enforce_eager) on the tiny fp32 Llama with named steering vectors on
layers 1 and 2, chunked prefill (32-token steps), prefix caching with 32-token blocks. 32
concurrent requests mix no steering, one vector, vectors on two layers, negative scales,
several scales of one vector and the three phases; most share a 66-token prefix so the
prefix cache is hit by requests steered differently. Every sampled token's raw logprob must
equal a teacher-forced HF forward with the same vectors added after the same layers at the
same positions (``probehook.testing_steering.hf_steered_logprobs``) within 1e-3, and every
steered request must differ from the unsteered forward by more than 0.05 nats somewhere (so
a steering that does nothing fails).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import first_record, random_probes

from probehook.testing import hf_residual_stream
from probehook.testing_steering import hf_steered_logprobs, phase_span, steering_terms

pytestmark = pytest.mark.engine

TOL = 1e-3
EFFECT = 0.05
HIDDEN = 128
PREFIX = "99+99=198. 3+4=7. 50+5=55. 12+34=46. 8+8=16. 21+21=42. 60+7=67. "
PROMPTS = [
    PREFIX + "1+2=",
    PREFIX + "17+25=",
    PREFIX + "3+",
    PREFIX,
    "Question: what is 17+25? Answer:",
]
# (steer, phase): one vector, the two-layer vector, two vectors on two layers, negative
# scales, several scales of "a", every phase; None: unsteered.
SPECS: list[tuple[dict[str, float] | None, str]] = [
    (None, "both"),
    ({"a": 1.0}, "both"),
    ({"a": 0.5}, "both"),
    ({"a": 2.0}, "both"),
    ({"a": -1.0}, "both"),
    ({"b": 1.0}, "both"),
    ({"b": -0.5}, "both"),
    ({"a": 1.0, "b": -1.0}, "both"),
    ({"ab": 1.0}, "both"),
    ({"ab": -1.0}, "both"),
    ({"a": 1.0}, "prefill"),
    ({"a": 1.0}, "decode"),
    ({"b": 1.0}, "prefill"),
    ({"b": -1.0}, "decode"),
    ({"a": 0.5, "ab": 0.5}, "decode"),
    (None, "both"),
]
MAX_TOKENS = 10


def _steering_vector_class():  # noqa: ANN202
    try:
        from probehook import SteeringVector
    except ImportError:
        from probehook.steering import SteeringVector
    return SteeringVector


@pytest.fixture(scope="module")
def vectors(llama_dir: Path) -> dict[str, dict[int, torch.Tensor]]:
    """Random directions with half the mean residual norm at their layer (HF, unsteered)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(llama_dir))(PROMPTS[0]).input_ids
    stream = hf_residual_stream(llama_dir, ids)
    g = torch.Generator().manual_seed(1234)

    def direction(layer: int) -> torch.Tensor:
        v = torch.randn(HIDDEN, generator=g)
        return v / v.norm() * 0.5 * stream[layer].norm(dim=-1).mean()

    return {
        "a": {1: direction(1)},
        "b": {2: direction(2)},
        "ab": {1: direction(1), 2: direction(2)},
    }


@pytest.fixture(scope="module")
def op_vectors(llama_dir: Path, vectors) -> dict[str, object]:
    """Every op but add, on the same directions: the cap's bounds at a fifth of the median
    |h.u| of the unsteered stream (so most rows are capped)."""
    from transformers import AutoTokenizer

    sv = _steering_vector_class()
    ids = AutoTokenizer.from_pretrained(str(llama_dir))(PROMPTS[0]).input_ids
    stream = hf_residual_stream(llama_dir, ids)
    u = vectors["ab"][1] / vectors["ab"][1].norm()
    bound = 0.2 * float((stream[1] @ u).abs().median())
    swap_to = {1: vectors["b"][2].clone(), 2: vectors["a"][1].clone()}
    return {
        "abl": sv(vectors["a"]).with_op("ablate"),
        "cap": sv(vectors["ab"]).with_op("cap", min=-bound, max=bound),
        "orth": sv(vectors["ab"]).with_op("orthogonal"),
        "norm": sv(vectors["b"]).with_op("norm_scaled"),
        "swap": sv.swap(from_=sv(vectors["ab"]), to=sv(swap_to)),
    }


@pytest.fixture(scope="module")
def steer_llm(llama_dir: Path, vectors, op_vectors) -> Iterator[object]:
    from probehook import LLM

    sv = _steering_vector_class()
    llm = LLM(
        str(llama_dir),
        steering={**{name: sv(dict(v), name=name) for name, v in vectors.items()}, **op_vectors},
        layers=[1, 3],  # decode rows (prompt rows would keep prompts out of the prefix cache)
        probes=random_probes(HIDDEN),
        dtype="float32",
        seed=0,
        max_model_len=256,
        gpu_memory_utilization=0.1,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        block_size=32,  # the CPU attention's block sizes are multiples of 32
    )
    yield llm
    llm.shutdown()


def _params(steer: dict[str, float] | None, phase: str, sample: bool = False, **extra):
    from probehook import SamplingParams

    options: dict = dict(extra)
    if steer is not None:
        options.update(steer=dict(steer), steer_phase=phase)
    # sample: random sampling at temperature 0.8 (vLLM's CPU build refuses per-request seeds:
    # "CPU Generator does not use offset"); the raw logprobs must still equal HF's
    sampling = dict(temperature=0.8) if sample else dict(temperature=0.0)
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logprobs=0,
        extra_args={"probehook": options} if options else None,
        **sampling,
    )


def _engine_logprobs(completion) -> list[float]:
    return [completion.logprobs[i][token].logprob for i, token in enumerate(completion.token_ids)]


def _check(llama_dir: Path, out, terms, label: str) -> tuple[float, float]:
    """Assert the completion's logprobs equal HF's under ``terms``; return the largest
    difference to HF and the largest steering effect (steered HF vs unsteered HF)."""
    completion = out.outputs[0]
    prompt, tokens = list(out.prompt_token_ids), list(completion.token_ids)
    assert len(tokens) == MAX_TOKENS, label
    got = _engine_logprobs(completion)
    want = hf_steered_logprobs(llama_dir, prompt, tokens, terms)
    diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert diff <= TOL, f"{label}: engine vs HF steered, max |diff| {diff:.2e}\n{got}\n{want}"
    effect = 0.0
    if terms:
        plain = hf_steered_logprobs(llama_dir, prompt, tokens, [])
        effect = max(abs(a - b) for a, b in zip(want, plain, strict=True))
    return diff, effect


def test_32_concurrent_requests_match_hf(steer_llm, llama_dir: Path, vectors) -> None:
    requests = []
    for i in range(32):
        steer, phase = SPECS[i % len(SPECS)]
        requests.append((PROMPTS[i % len(PROMPTS)], steer, phase, i >= 24))
    params = [_params(steer, phase, sample) for _, steer, phase, sample in requests]
    outs = steer_llm.generate([r[0] for r in requests], params, use_tqdm=False)
    worst, weakest = 0.0, float("inf")
    for i, ((_, steer, phase, sample), out) in enumerate(zip(requests, outs, strict=True)):
        p = len(out.prompt_token_ids)
        terms = [] if steer is None else steering_terms(vectors, steer, *phase_span(phase, p))
        label = f"request {i} steer={steer} phase={phase} sampled={sample} prompt_len={p}"
        diff, effect = _check(llama_dir, out, terms, label)
        worst = max(worst, diff)
        if terms:
            assert effect > EFFECT, f"{label}: steering moves HF logprobs by only {effect:.3f}"
            weakest = min(weakest, effect)
    # the prefix cache was used by this batch (requests after the first share PREFIX blocks)
    assert sum(out.num_cached_tokens or 0 for out in outs) > 0
    print(f"32 requests: max |engine - HF| {worst:.2e}; smallest steering effect {weakest:.3f}")


def test_prefix_cache_does_not_leak_steering(steer_llm, llama_dir: Path, vectors) -> None:
    """A prompt no earlier test used (two full 32-token blocks), steered (+), unsteered,
    steered (-), unsteered, steered (+): one generate call each, each equal to its own HF
    reference, so KV blocks computed under one steering never serve another (a leak shows as
    a logprob difference: "ab" steers layer 1, which changes the KV of layers 2 and 3)."""
    prompt = "Isolation check: 31+11=42. 5+6=11. 70+20=90. 13+13=26. 44+4=48. 9+"
    plus, minus = {"ab": 1.0}, {"ab": -1.0}
    cached = []
    for steer in (plus, None, minus, None, plus):
        (out,) = steer_llm.generate([prompt], _params(steer, "both"), use_tqdm=False)
        p = len(out.prompt_token_ids)
        assert p >= 64
        terms = [] if steer is None else steering_terms(vectors, steer, *phase_span("both", p))
        _, effect = _check(llama_dir, out, terms, f"steer={steer} (cached so far {cached})")
        assert steer is None or effect > EFFECT
        cached.append(out.num_cached_tokens or 0)
    # the repeated runs reuse blocks (the cache is on and exercised); the first is cold
    assert cached[0] == 0 and cached[3] >= 32 and cached[4] >= 32, cached


def test_probe_gated_steering_starts_after_the_crossing(steer_llm, llama_dir: Path, vectors):
    """A steer monitor on probe "truth" (layer 1): rows up to the first crossing score as
    unsteered, and the logprobs equal HF steered from ``completion.steering["start"]``; a
    monitor that never crosses (a probability above 1) leaves its request unsteered."""
    from probehook import ProbeMonitor

    prompt = "Question: what is 17+25? Answer:"
    (base,) = steer_llm.generate([prompt], _params(None, "both"), use_tqdm=False)
    scores = base.outputs[0].probe_scores["truth"]
    k, threshold, direction = first_record(scores, start=3)
    gated = ProbeMonitor("truth", threshold, action="steer", steer={"a": 1.5}, direction=direction)
    never = ProbeMonitor("truth", 1.0, action="steer", steer={"a": 1.5})  # p > 1: never
    params = [_params(None, "both", monitors=[m]) for m in (gated, never)]
    out, quiet = steer_llm.generate([prompt, prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    p = len(out.prompt_token_ids)
    assert completion.steering is not None and completion.steering["start"] == p + k
    # decode rows 0..k sit at positions P-1..P-1+k, before the first steered position P+k
    torch.testing.assert_close(
        completion.probe_scores["truth"][: k + 1], scores[: k + 1], atol=1e-4, rtol=0
    )
    assert list(completion.token_ids[: k + 1]) == list(base.outputs[0].token_ids[: k + 1])
    terms = steering_terms(vectors, {"a": 1.5}, completion.steering["start"])
    _, effect = _check(llama_dir, out, terms, f"gated, start {p + k}")
    assert effect > EFFECT
    assert quiet.outputs[0].steering is None or quiet.outputs[0].steering["start"] is None
    _check(llama_dir, quiet, [], "gate never crossed")
    assert list(quiet.outputs[0].token_ids) == list(base.outputs[0].token_ids)


def test_add_and_remove_in_compiled_mode_never_recompile(steer_llm, llama_dir: Path, vectors):
    """A vector added while the compiled engine runs steers equal to HF; adding, using and
    removing it leaves dynamo's graph counter (and vLLM's compile counters) where they were."""
    prompt = PROMPTS[4]
    before = steer_llm.collective_rpc("probehook_stats")[0]
    assert before["dynamo_graphs"] > 0  # the counter lives where the engine compiled
    late = {1: -vectors["a"][1]}
    steer_llm.add_steering("late", _steering_vector_class()(late))
    (out,) = steer_llm.generate([prompt], _params({"late": 1.0}, "both"), use_tqdm=False)
    terms = steering_terms({"late": late}, {"late": 1.0}, 0)
    _, effect = _check(llama_dir, out, terms, "added while running")
    assert effect > EFFECT
    steer_llm.remove_steering("late")
    after = steer_llm.collective_rpc("probehook_stats")[0]
    for counter in ("graphs_seen", "backend_compilations", "dynamo_graphs"):
        assert after[counter] == before[counter], (counter, before, after)


OP_SPECS: list[dict[str, float] | None] = [
    {"abl": 1.0},
    {"cap": 1.0},
    {"orth": 0.0},
    {"orth": 2.0},
    {"norm": 0.5},
    {"swap": 1.0},
    {"abl": 1.0, "a": 2.0},
    {"a": 2.0, "abl": 1.0},
    {"a": 1.0, "b": -1.0, "cap": 1.0, "swap": 0.5},
    None,
]


def _rows(out, layer: int) -> torch.Tensor:
    """The captured decode rows of ``layer``: positions P-1..P+n-2."""
    return out.outputs[0].hidden_states[layer]


def test_every_op_equals_hugging_face(steer_llm, llama_dir: Path, vectors, op_vectors) -> None:
    """Mixed ops in one batch beside unsteered requests (compiled, chunked prefill, prefix
    caching): the teacher-forced logprobs and the captured rows of the steered layer and a
    later one equal HF with each op's formula applied by a forward hook in the request's order;
    after ablate at scale 1 the captured row has no component along the direction; each
    completion names its ops."""
    from probehook.testing_steering import hf_steered_stream

    every = {**vectors, **op_vectors}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(2 * len(OP_SPECS))]
    specs = [OP_SPECS[i % len(OP_SPECS)] for i in range(len(prompts))]
    outs = steer_llm.generate(prompts, [_params(s, "both") for s in specs], use_tqdm=False)
    for steer, out in zip(specs, outs, strict=True):
        terms = [] if steer is None else steering_terms(every, steer, 0)
        _, effect = _check(llama_dir, out, terms, f"steer={steer}")
        assert steer is None or effect > EFFECT, f"{steer}: effect {effect:.3f}"
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
        want = hf_steered_stream(llama_dir, tokens, terms, layers=[1, 3])
        for layer in (1, 3):
            got = _rows(out, layer)
            want[layer] = want[layer][len(out.prompt_token_ids) - 1 :]
            torch.testing.assert_close(
                got, want[layer], rtol=0, atol=1e-3 * float(want[layer].abs().max())
            )
        steering = out.outputs[0].steering
        if steer is not None:
            assert list(steering["vectors"]) == list(steer), steering
            ops = {n: op_vectors[n].op for n in steer if n in op_vectors}
            assert {n: o.split("(")[0] for n, o in steering.get("ops", {}).items()} == ops
        if steer == {"abl": 1.0}:
            u = vectors["a"][1] / vectors["a"][1].norm()
            rows = _rows(out, 1).double()
            along = (rows @ u.double()).abs()
            assert bool((along <= 1e-5 * rows.norm(dim=-1)).all()), float(along.max())


def test_probe_gated_ops_start_after_the_crossing(steer_llm, llama_dir: Path, op_vectors) -> None:
    """A steer monitor naming vectors with other ops (an ablation, then a cap) steers them
    like additions: from the position after the crossing, in the monitor's order, equal to
    HF with the formulas applied from ``steering["start"]``; the completion names the ops."""
    from probehook import ProbeMonitor

    prompt = "Question: what is 17+25? Answer:"
    (base,) = steer_llm.generate([prompt], _params(None, "both"), use_tqdm=False)
    scores = base.outputs[0].probe_scores["truth"]
    k, threshold, direction = first_record(scores, start=3)
    steer = {"abl": 1.0, "cap": 1.0}
    gate = ProbeMonitor("truth", threshold, action="steer", steer=steer, direction=direction)
    (out,) = steer_llm.generate([prompt], _params(None, "both", monitors=[gate]), use_tqdm=False)
    completion = out.outputs[0]
    p = len(out.prompt_token_ids)
    assert completion.steering["start"] == p + k
    assert completion.steering["gate"]["vectors"] == steer
    assert set(completion.steering["ops"]) == {"abl", "cap"}
    terms = steering_terms(op_vectors, steer, completion.steering["start"])
    _, effect = _check(llama_dir, out, terms, f"gated ops, start {p + k}")
    assert effect > EFFECT
