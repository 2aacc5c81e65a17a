"""Steering's ops (docs/steering.md "Ops"): the worker's one op form against each op's formula
written out in float64 (``probehook.testing_steering.apply_op``), through the real bank, step
tables and op, eager and under ``torch.compile``; order; the identities; what a vector records
in its file; the errors; the prefix-cache salt. The engine against Hugging Face is
tests/test_steering_parity.py::test_every_op_equals_hugging_face."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from probehook import CaptureConfigError, SteeringVector
from probehook.core.steering_wire import vector_rows, vector_wire, vectors_from_wire
from probehook.testing_steering import apply_op
from probehook.worker.steer_op import steer
from probehook.worker.steering_bank import (
    MAX_TERMS,
    RequestSteering,
    SteeringBank,
    SteeringBankError,
    SteerTable,
    StepSteering,
)

HIDDEN = 16
LAYER = 1


def _direction(seed: int) -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


VECTORS = {
    "add": SteeringVector({LAYER: _direction(1)}),
    "add2": SteeringVector({LAYER: _direction(2)}),
    "ablate": SteeringVector({LAYER: _direction(3)}).with_op("ablate"),
    "cap": SteeringVector({LAYER: _direction(4)}).with_op("cap", min=-0.5, max=0.5),
    "floor": SteeringVector({LAYER: _direction(5)}).with_op("cap", min=1.0),
    "orthogonal": SteeringVector({LAYER: _direction(6)}).with_op("orthogonal"),
    "norm_scaled": SteeringVector({LAYER: _direction(7)}).with_op("norm_scaled"),
    "swap": SteeringVector.swap(
        from_=SteeringVector({LAYER: _direction(8)}), to=SteeringVector({LAYER: _direction(9)})
    ),
}
REQUESTS = [
    (),
    (("add", 2.0),),
    (("ablate", 1.0),),
    (("cap", 1.0),),
    (("floor", 0.7),),
    (("orthogonal", 0.0),),
    (("orthogonal", 0.5),),
    (("norm_scaled", 0.3),),
    (("swap", 1.0),),
    (("ablate", 1.0), ("add", 3.0)),
    (("add", 3.0), ("ablate", 1.0)),
    (("add", 1.0), ("add2", -2.0), ("cap", 1.0), ("add", 0.5), ("add2", 1.0)),
    (("swap", 0.5), ("norm_scaled", -0.2), ("orthogonal", 2.0), ("ablate", 0.5)),
]


def _step(slots: int) -> StepSteering:
    bank = SteeringBank([LAYER], HIDDEN, capacity=len(VECTORS), device="cpu", slots=slots)
    for name, vector in VECTORS.items():
        bank.add(name, vectors_from_wire(vector_wire(vector), HIDDEN))
    return StepSteering(
        bank, {LAYER: SteerTable.allocate(slots, "cpu")}, torch.zeros(64, dtype=torch.int64)
    )


def _reference(h: torch.Tensor, terms: tuple[tuple[str, float], ...]) -> torch.Tensor:
    out = h.double()
    for name, scale in terms:
        vector = VECTORS[name]
        to = vector.swap_to.get(LAYER)
        out = apply_op(out, vector.op, vector.op_params, vector.vector(LAYER), scale, to)
    return out


class _Layer(torch.nn.Module):
    """The op on a layer's ``(hidden, residual)`` output, as the surgery installs it."""

    def __init__(self, step: StepSteering) -> None:
        super().__init__()
        self.step = step

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        table, bank = self.step.tables[LAYER], self.step.bank
        steer(hidden, residual, self.step.index, table.rows, table.scalars, bank.units[LAYER],
              bank.writes[LAYER])  # fmt: skip
        return hidden + residual


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_op_equals_its_formula_in_float64(compiled: bool) -> None:
    """Three tokens per request, every request's terms in one step, the stream split into
    hidden and a deferred residual; unsteered rows are untouched bit for bit."""
    step = _step(len(REQUESTS) + 1)
    plans = {
        f"r{i}": RequestSteering(t, 0, 10**9, 3) if t else None for i, t in enumerate(REQUESTS)
    }
    ids = list(plans)
    starts = np.arange(0, 3 * len(ids) + 1, 3)
    step.prepare(ids, starts, np.zeros(len(ids), dtype=np.int64), plans.get)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3 * len(ids), HIDDEN, generator=g) * 2
    residual = torch.randn(3 * len(ids), HIDDEN, generator=g)
    layer = _Layer(step)
    run = torch.compile(layer, fullgraph=False) if compiled else layer
    got = run(hidden.clone(), residual)
    for i, terms in enumerate(REQUESTS):
        rows = slice(3 * i, 3 * i + 3)
        want = _reference(hidden[rows] + residual[rows], terms)
        if not terms:
            assert torch.equal(got[rows], hidden[rows] + residual[rows]), "unsteered rows moved"
            continue
        error = (got[rows].double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(error.max()) < 2e-6, f"request {terms}: relative error {float(error.max())}"
    # the order matters: ablate then add is not add then ablate
    first, second = got[27:30], got[30:33]
    assert (first - second).abs().max() > 0.1


def _apply(terms: tuple[tuple[str, float], ...], h: torch.Tensor) -> torch.Tensor:
    step = _step(2)
    step.prepare(
        ["r"], np.array([0, len(h)]), np.array([0]), {"r": RequestSteering(terms, 0, 99, 1)}.get
    )
    out = h.clone()
    table, bank = step.tables[LAYER], step.bank
    steer(out, None, step.index, table.rows, table.scalars, bank.units[LAYER], bank.writes[LAYER])
    return out


def test_the_identities_hold_exactly_and_ablation_leaves_no_component() -> None:
    h = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(30)) * 3
    for name in VECTORS:  # scale 0: identity for every op but orthogonal
        if name != "orthogonal":
            assert torch.equal(_apply(((name, 0.0),), h), h), name
    assert torch.equal(_apply((("orthogonal", 1.0),), h), h)
    u = VECTORS["cap"].vector(LAYER) / VECTORS["cap"].vector(LAYER).norm()
    inside = h - (h @ u)[:, None] * u + 0.25 * u  # projection 0.25, inside [-0.5, 0.5]
    torch.testing.assert_close(_apply((("cap", 1.0),), inside), inside, rtol=0, atol=1e-6)
    to_itself = SteeringVector.swap(from_=VECTORS["add"], to=VECTORS["add"])
    rows = vector_rows(to_itself)
    assert not rows.writes[LAYER].any()  # u_to - u_from: nothing moves
    ablated = _apply((("ablate", 1.0),), h)
    u = VECTORS["ablate"].vector(LAYER).double()
    u = u / u.norm()
    along = (ablated.double() @ u).abs()
    assert bool((along <= 1e-5 * ablated.double().norm(dim=-1)).all()), along
    orthogonal_0 = _apply((("orthogonal", 0.0),), h)  # s = 0 removes the component
    u = VECTORS["orthogonal"].vector(LAYER).double()
    assert float((orthogonal_0.double() @ (u / u.norm())).abs().max()) < 1e-5 * float(
        h.norm(dim=-1).min()
    )


def test_too_many_terms_at_a_layer_are_refused_and_the_request_runs_unsteered() -> None:
    step = _step(2)
    names = ["ablate", "orthogonal"] * (MAX_TERMS // 2) + ["swap"]
    plan = RequestSteering(tuple((n, 1.0) for n in names), 0, 99, 1)
    step.prepare(["r"], np.array([0, 1]), np.array([0]), {"r": plan}.get)
    assert step.failures == 1 and f"at most {MAX_TERMS}" in step.take_failed()["r"]
    with pytest.raises(SteeringBankError, match="at most"):
        step.bank.write(step.tables[LAYER], 1, LAYER, plan.terms)


def test_a_removed_vector_keeps_steering_the_requests_that_use_it() -> None:
    """Its bank row is not reused while a live request reads it."""
    step = _step(3)
    plan = RequestSteering((("ablate", 1.0),), 0, 99, 1)
    step.prepare(["r"], np.array([0, 1]), np.array([0]), {"r": plan}.get)
    row = step.bank.rows["ablate"]
    step.bank.remove("ablate")
    with pytest.raises(SteeringBankError, match="full"):
        step.add_vector("new", vector_rows(SteeringVector({LAYER: _direction(11)})))
    step.finish(["r"])
    step.add_vector("new", vector_rows(SteeringVector({LAYER: _direction(11)})))
    assert step.bank.rows["new"] == row


def test_files_record_the_op_its_parameters_and_the_site(tmp_path) -> None:
    for name, vector in VECTORS.items():
        path = vector.save(tmp_path / f"{name}.safetensors")
        loaded = SteeringVector.load(path)
        assert (loaded.op, loaded.op_params, loaded.site) == (
            vector.op,
            vector.op_params,
            "resid_post",
        )
        assert loaded.digest == vector.digest
        assert {k: v.tolist() for k, v in loaded.swap_to.items()} == {
            k: v.tolist() for k, v in vector.swap_to.items()
        }
    # an older file (no op in its header) loads as an addition
    from safetensors.torch import save_file

    header = {"format_version": 1, "name": "old", "layers": [LAYER], "hidden_size": HIDDEN,
              "model_fingerprint": None, "made_by": {}, "probehook_version": "0.1"}  # fmt: skip
    old = tmp_path / "old.safetensors"
    save_file({f"layer.{LAYER}": _direction(1)}, str(old),
              metadata={"probehook_steering": json.dumps(header)})  # fmt: skip
    assert SteeringVector.load(old).op == "add"
    assert SteeringVector.load(old).digest == VECTORS["add"].digest  # an add's digest as before
    # a file naming another site is refused, not applied at resid_post
    elsewhere = tmp_path / "pre.safetensors"
    save_file({f"layer.{LAYER}": _direction(1)}, str(elsewhere),
              metadata={"probehook_steering": json.dumps({**header, "op": "ablate",
                                                          "site": "resid_pre"})})  # fmt: skip
    with pytest.raises(CaptureConfigError, match="site 'resid_pre'"):
        SteeringVector.load(elsewhere)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda v: v.with_op("subtract"), r"op 'subtract' is not one of \['add', 'ablate'"),
        (lambda v: v.with_op("cap"), r"cap needs min, max or both"),
        (lambda v: v.with_op("cap", min=2.0, max=1.0), r"cap min=2.0 is above max=1.0"),
        (lambda v: v.with_op("cap", max=math.nan), r"cap max=nan must be finite"),
        (lambda v: v.with_op("cap", max="4"), r"cap max='4' must be a number"),
        (lambda v: v.with_op("ablate", max=1.0), r"only 'cap' takes min and max"),
        (lambda v: v.with_op("swap"), r"SteeringVector.swap\(from_=..., to=...\)"),
        (lambda v: SteeringVector({LAYER: torch.zeros(HIDDEN)}).with_op("ablate"),
         r"layer 1's direction is all zeros; op 'ablate' divides by its norm"),
        (lambda v: SteeringVector.swap(from_=v, to=SteeringVector({2: _direction(1)})),
         r"from_ has layers \[1\] .* but to has layers \[2\]"),
        (lambda v: SteeringVector.swap(from_=v, to=SteeringVector({LAYER: torch.ones(4)})),
         r"same layers and hidden size"),
        (lambda v: SteeringVector.swap(from_=v, to=SteeringVector({LAYER: torch.zeros(HIDDEN)})),
         r"layer 1's to direction is all zeros"),
    ],
)  # fmt: skip
def test_bad_ops_are_refused_by_name(make, message) -> None:
    with pytest.raises(CaptureConfigError, match=message):
        make(VECTORS["add"])


def test_salts_cover_each_op_its_parameters_and_the_order() -> None:
    from probehook.frontend.steering_set import SteeringSet

    base = VECTORS["add"]
    vectors = {
        "a": base,
        "b": VECTORS["add2"],
        "abl": base.with_op("ablate"),
        "cap4": base.with_op("cap", max=4.0),
        "cap5": base.with_op("cap", max=5.0),
    }
    steering = SteeringSet(vectors, layers=[LAYER], capacity=8, num_layers=2,
                           hidden_size=HIDDEN, model_fingerprint=None)  # fmt: skip

    def salt(*terms: tuple[str, float]) -> str:
        return steering.request_steer(list(terms), "both", ()).salt

    salts = {salt(("a", 1.0)), salt(("abl", 1.0)), salt(("cap4", 1.0)), salt(("cap5", 1.0))}
    assert len(salts) == 4  # same direction, another op or bound: another salt
    assert salt(("abl", 1.0), ("a", 1.0)) != salt(("a", 1.0), ("abl", 1.0))  # order matters
    assert salt(("a", 1.0), ("b", 1.0)) == salt(("b", 1.0), ("a", 1.0))  # a sum is a sum
    described = steering.request_steer([("cap4", 1.0), ("a", 2.0)], "both", ()).describe()
    assert described["vectors"] == {"cap4": 1.0, "a": 2.0}
    assert list(described["vectors"]) == ["cap4", "a"] and described["ops"] == {
        "cap4": "cap(max=4)"
    }
    assert steering.describe()["vectors"]["abl"]["op"] == "ablate"


@pytest.mark.engine
def test_ops_alone_and_stored_through_fsck_and_compaction(llama_dir, tmp_path) -> None:
    """An engine with steering ops and nothing else of probehook's (compiled) equals HF with
    the formulas; an engine that stores what ops applied keeps it, rows included, bit-equal
    through fsck and compaction."""
    from probehook import LLM, ActivationStore, SamplingParams
    from probehook.store.maintenance import compact, fsck
    from probehook.testing_steering import hf_steered_logprobs, steering_terms

    def direction(seed: int) -> torch.Tensor:
        v = torch.randn(128, generator=torch.Generator().manual_seed(seed))
        return v / v.norm() * 4.0

    vectors = {
        "abl": SteeringVector({1: direction(1)}).with_op("ablate"),
        "cap": SteeringVector({1: direction(2)}).with_op("cap", min=-0.5, max=0.5),
        "push": SteeringVector({1: direction(3)}).with_op("norm_scaled"),
    }
    steer = {"abl": 1.0, "push": 0.3, "cap": 1.0}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                            extra_args={"probehook": {"steer": steer}})  # fmt: skip
    llm = LLM(str(llama_dir), steering=vectors, dtype="float32", max_model_len=128, seed=0)
    try:
        (out,) = llm.generate(["12+34=46. 7+"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
    want = hf_steered_logprobs(llama_dir, out.prompt_token_ids, completion.token_ids,
                               steering_terms(vectors, steer, 0))  # fmt: skip
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3
    plain = hf_steered_logprobs(llama_dir, out.prompt_token_ids, completion.token_ids, [])
    assert max(abs(a - b) for a, b in zip(want, plain, strict=True)) > 0.05  # the ops act

    root = tmp_path / "store"
    stored_llm = LLM(str(llama_dir), steering=vectors, layers=[1], store=root, dtype="float32",
                     max_model_len=128, seed=0, enforce_eager=True)  # fmt: skip
    try:
        outs = stored_llm.generate(["12+34=46. 7+", "3+4="], params, use_tqdm=False)
    finally:
        stored_llm.shutdown()
    for maintained in (False, True):
        if maintained:
            assert fsck(root).ok
            compact(root, progress=False)
            assert fsck(root).ok
        store = ActivationStore.open(root)
        for o in outs:
            record = store[o.store_id]
            assert record.steering == o.outputs[0].steering
            assert record.steering["ops"] == {"abl": "ablate", "cap": "cap(max=0.5, min=-0.5)",
                                              "push": "norm_scaled"}  # fmt: skip
            assert torch.equal(record.hidden_states[1], o.outputs[0].hidden_states[1])
