"""Unit tests of the worker's steering bookkeeping and the front end's steering set (no engine):
the per-token slot index, table rows, slot reuse, gates, and prefix-cache salts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probehook.core.spans import OPEN
from probehook.worker.steer_op import steer
from probehook.worker.steering_bank import (
    Gate,
    RequestSteering,
    SteeringBank,
    SteeringBankError,
    SteerTable,
    StepSteering,
    phase_range,
)

HIDDEN = 4


def _engine(slots: int = 4) -> StepSteering:
    bank = SteeringBank([1, 2], HIDDEN, capacity=3, device="cpu", slots=slots)
    bank.add("a", {1: np.ones(HIDDEN, dtype=np.float32)})
    bank.add("b", {1: np.arange(HIDDEN, dtype=np.float32), 2: -np.ones(HIDDEN, np.float32)})
    tables = {layer: SteerTable.allocate(slots, "cpu") for layer in (1, 2)}
    return StepSteering(bank, tables, torch.zeros(32, dtype=torch.int64))


def effect(step: StepSteering, layer: int, slot: int) -> torch.Tensor:
    """What the op adds to a zero row at ``layer`` for table slot ``slot``."""
    table, bank = step.tables[layer], step.bank
    hidden = torch.zeros(1, HIDDEN)
    steer(hidden, None, torch.tensor([slot]), table.rows, table.scalars, bank.units[layer],
          bank.writes[layer])  # fmt: skip
    return hidden[0]


def test_index_follows_batch_metadata_and_phases() -> None:
    step = _engine()
    plans = {
        "r0": RequestSteering((("a", 2.0),), *phase_range("both", 3), prompt_len=3),
        "r1": None,
        "r2": RequestSteering((("b", -1.0),), *phase_range("decode", 2), prompt_len=2),
    }
    # r0: 3 prompt tokens; r1: 2 tokens; r2: its prompt (2) plus its first decode position.
    query_start = np.array([0, 3, 5, 8])
    step.prepare(["r0", "r1", "r2"], query_start, np.array([0, 0, 0]), plans.get)
    index = step.index[:8].tolist()
    s0, s2 = plans["r0"].slot, plans["r2"].slot
    assert s0 and s2 and s0 != s2
    assert index == [s0, s0, s0, 0, 0, 0, 0, s2]  # r2's prompt is not steered, position 2 is
    torch.testing.assert_close(effect(step, 1, s0), torch.full((HIDDEN,), 2.0))
    torch.testing.assert_close(effect(step, 2, s0), torch.zeros(HIDDEN))  # a has no layer 2
    torch.testing.assert_close(effect(step, 1, s2), -torch.arange(HIDDEN, dtype=torch.float32))
    torch.testing.assert_close(effect(step, 2, s2), torch.ones(HIDDEN))
    # The next step has no steered token: the index is cleared, row 0 stays zero.
    step.prepare(["r1"], np.array([0, 1]), np.array([2]), plans.get)
    assert step.index[:8].tolist() == [0] * 8
    assert step.tables[1].rows[0].abs().sum() == 0 and step.tables[1].scalars[0].abs().sum() == 0


def test_the_op_adds_each_tokens_row() -> None:
    step = _engine()
    plan = RequestSteering((("a", 1.0),), 1, 3, prompt_len=3)  # positions 1, 2 only
    step.prepare(["r"], np.array([0, 4]), np.array([0]), {"r": plan}.get)
    hidden = torch.zeros(4, HIDDEN)
    table = step.tables[1]
    steer(hidden, None, step.index, table.rows, table.scalars, step.bank.units[1],
          step.bank.writes[1])  # fmt: skip
    assert hidden[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]


def test_slots_are_freed_at_finish_and_reclaimed_from_departed_requests() -> None:
    step = _engine(slots=3)  # two usable slots
    plans = {f"r{i}": RequestSteering((("a", float(i)),), 0, OPEN, prompt_len=1) for i in range(4)}
    step.prepare(["r0", "r1"], np.array([0, 1, 2]), np.array([0, 0]), plans.get)
    step.finish(["r0"])
    step.prepare(["r1", "r2"], np.array([0, 1, 2]), np.array([1, 0]), plans.get)
    assert {plans["r1"].slot, plans["r2"].slot} == {1, 2}
    # r1 left the batch (preempted): its slot goes to r3, and r1 gets one back on return.
    step.prepare(["r2", "r3"], np.array([0, 1, 2]), np.array([1, 0]), plans.get)
    assert plans["r1"].slot == 0 and plans["r3"].slot and step.reclaimed == 1
    torch.testing.assert_close(effect(step, 1, plans["r3"].slot), torch.full((HIDDEN,), 3.0))
    # r1 returns after its vector left the bank: it is steered by the sum it had.
    step.finish(["r3"])
    step.bank.remove("a")
    step.prepare(["r2", "r1"], np.array([0, 1, 2]), np.array([2, 1]), plans.get)
    torch.testing.assert_close(effect(step, 1, plans["r1"].slot), torch.full((HIDDEN,), 1.0))


def test_a_request_that_cannot_get_a_row_runs_unsteered_and_the_step_goes_on() -> None:
    step = _engine()
    plans = {
        "ok": RequestSteering((("a", 1.0),), 0, OPEN, prompt_len=1),
        "bad": RequestSteering((("gone", 1.0),), 0, OPEN, prompt_len=1),  # skipped the checks
    }
    step.prepare(["bad", "ok"], np.array([0, 1, 2]), np.array([0, 0]), plans.get)
    assert step.failures == 1 and step.states["bad"] is None
    assert len(step._free) == 2  # 3 usable rows: "ok" holds one, the failed one came back
    assert step.index[:2].tolist() == [0, plans["ok"].slot] and plans["ok"].slot


def test_a_gate_steers_from_the_position_after_its_crossing_row() -> None:
    step = _engine()
    plan = RequestSteering((("a", 1.0),), None, OPEN, prompt_len=3, gate=Gate(0, 0.5, "above"))
    plans = {"r": plan}
    # Prefill of 3 tokens: the last row (position 2 = decode row 0) scores 0.2: no crossing.
    step.prepare(["r"], np.array([0, 3]), np.array([0]), plans.get)
    step.check_gates(torch.tensor([[[0.9], [0.1], [0.2]]]), np.array([2]))
    assert plan.lo is None and step.index[:3].tolist() == [0, 0, 0]
    # Position 3 scores 0.7: steering starts at position 4.
    step.prepare(["r"], np.array([0, 1]), np.array([3]), plans.get)
    step.check_gates(torch.tensor([[[0.7]]]), np.array([0]))
    assert plan.lo == 4
    step.prepare(["r"], np.array([0, 1]), np.array([4]), plans.get)
    assert step.index[0].item() == plan.slot != 0


def test_a_prompt_row_never_opens_a_gate() -> None:
    step = _engine()
    plan = RequestSteering((("a", 1.0),), None, OPEN, prompt_len=5, gate=Gate(0, 0.5, "above"))
    step.prepare(["r"], np.array([0, 2]), np.array([0]), {"r": plan}.get)  # chunk 0..1
    step.check_gates(torch.tensor([[[0.0], [0.9]]]), np.array([1]))
    assert plan.lo is None


def test_bank_errors() -> None:
    bank = SteeringBank([1], HIDDEN, capacity=1, device="cpu")
    bank.add("a", {1: np.ones(HIDDEN, np.float32)})
    with pytest.raises(SteeringBankError, match="already"):
        bank.add("a", {1: np.ones(HIDDEN, np.float32)})
    with pytest.raises(SteeringBankError, match="full"):
        bank.add("b", {1: np.ones(HIDDEN, np.float32)})
    with pytest.raises(SteeringBankError, match=r"layers \[3\]"):
        SteeringBank([1], HIDDEN, 2, "cpu").add("c", {3: np.ones(HIDDEN, np.float32)})
    bank.remove("a")
    bank.add("b", {1: 2 * np.ones(HIDDEN, np.float32)})  # the freed row is reused, overwritten
    assert bank.combine(1, [("b", 1.0)]).tolist() == [2.0] * HIDDEN


def test_salts_follow_contents_scales_and_phase() -> None:
    from probehook import SteeringVector
    from probehook.frontend.steering_set import SteeringSet

    def vec(value: float) -> SteeringVector:
        return SteeringVector({1: torch.full((HIDDEN,), value)})

    steering = SteeringSet(
        {"a": vec(1.0), "b": vec(2.0)},
        layers=[1],
        capacity=8,
        num_layers=2,
        hidden_size=HIDDEN,
        model_fingerprint=None,
    )
    base = steering.request_steer([("a", 1.0)], "both", ()).salt
    assert steering.request_steer([("a", 1.0)], "both", ()).salt == base
    others = {
        steering.request_steer([("a", 2.0)], "both", ()).salt,
        steering.request_steer([("a", 1.0)], "decode", ()).salt,
        steering.request_steer([("b", 1.0)], "both", ()).salt,
    }
    assert base not in others and len(others) == 3
    # The same name with another direction is another salt.
    steering.remove("a")
    steering.add("a", vec(-1.0))
    assert steering.request_steer([("a", 1.0)], "both", ()).salt != base
    # Inline vectors: one bank entry per content, counted; gone with its last user.
    name, wire = steering.acquire_inline(vec(5.0))
    again, none = steering.acquire_inline(vec(5.0))
    assert wire is not None and none is None and again == name
    assert steering.describe()["inline_in_use"] == 1 and name not in steering.describe()["vectors"]
    assert not steering.release_inline(name) and steering.release_inline(name)
    assert name not in steering.vectors


def test_vectors_named_by_requests_in_flight_cannot_be_removed() -> None:
    from probehook import CaptureConfigError, ProbeMonitor, SteeringVector
    from probehook.frontend.steering_set import SteeringSet

    vec = SteeringVector({1: torch.ones(HIDDEN)})
    steering = SteeringSet(
        {"a": vec, "b": vec}, layers=[1], capacity=4, num_layers=2, hidden_size=HIDDEN,
        model_fingerprint=None,
    )  # fmt: skip
    gate = ProbeMonitor("p", 0.5, action="steer", steer={"b": 1.0})
    held = steering.hold(steering.request_steer([("a", 1.0)], "both", (gate,)))
    assert held == ["a", "b"]
    with pytest.raises(CaptureConfigError, match=r"'a' is named by 1 request"):
        steering.remove("a")
    steering.release(held)
    steering.remove("a")


def test_a_gate_needs_decode_scores_and_one_gate_per_request() -> None:
    from probehook import CaptureConfigError, ProbeMonitor, SteeringVector
    from probehook.core.request_options import RequestOptions
    from probehook.frontend.steering_set import SteeringSet

    steering = SteeringSet(
        {"a": SteeringVector({1: torch.ones(HIDDEN)})}, layers=[1], capacity=4, num_layers=2,
        hidden_size=HIDDEN, model_fingerprint=None,
    )  # fmt: skip
    gate = ProbeMonitor("p", 0.5, action="steer", steer={"a": 1.0})
    with pytest.raises(CaptureConfigError, match=r"include_decode is False"):
        steering.for_request(RequestOptions(), (gate,), decode_scores=False)
    with pytest.raises(CaptureConfigError, match=r"at most one"):
        steering.for_request(RequestOptions(), (gate, gate), decode_scores=True)
    with pytest.raises(CaptureConfigError, match=r"both steer"):
        steering.for_request(RequestOptions(steer=(("a", 1.0),)), (gate,), decode_scores=True)
    assert steering.for_request(RequestOptions(), (gate,), decode_scores=True).gates == (gate,)
