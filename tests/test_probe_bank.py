"""Unit tests of the worker-side probe bank and score recording (no vLLM): fused scores equal
each probe applied alone, rows follow batch metadata, and this step's last-token scores are
where the monitor processor reads them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from probehook.core.bank_file import WorkerBanks
from probehook.core.monitors import ProbeMonitor, crossings
from probehook.core.probe_spec import ProbeSpec, columns_of
from probehook.core.spans import OPEN, KeepPlan, Span
from probehook.errors import CaptureConfigError
from probehook.worker.probe_bank import ProbeBank
from probehook.worker.recorder import RequestPlan, StepRecorder

HIDDEN = 8


def spec(name: str, layer: int, outputs: int, activation: str, seed: int) -> ProbeSpec:
    g = np.random.default_rng(seed)
    weight = g.standard_normal((outputs, HIDDEN)).astype(np.float32)
    bias = g.standard_normal(outputs).astype(np.float32)
    return ProbeSpec(name, layer, weight, bias, activation)


def reference(s: ProbeSpec, rows: torch.Tensor) -> torch.Tensor:
    raw = rows.float() @ torch.from_numpy(s.weight).T + torch.from_numpy(s.bias)
    if s.activation == "sigmoid":
        return torch.sigmoid(raw)
    if s.activation == "softmax":
        return torch.softmax(raw, dim=1)
    return raw


SPECS = [
    spec("truth", 2, 1, "sigmoid", 0),
    spec("topic", 0, 3, "softmax", 1),
    spec("length", 2, 1, "identity", 2),
    spec("other", 0, 1, "sigmoid", 3),
]


def test_fused_scores_equal_each_probe_alone() -> None:
    bank = ProbeBank(SPECS, "cpu")
    assert bank.layers == (0, 2)
    rows = {layer: torch.randn(5, HIDDEN, dtype=torch.bfloat16) for layer in bank.layers}
    out = bank(torch.stack([rows[layer] for layer in bank.layers]))
    assert out.shape == (1, 5, bank.width) and out.dtype == torch.float32
    assert bank.width == 6
    for s in SPECS:
        cols = bank.columns[s.name]
        torch.testing.assert_close(out[0, :, cols.lo : cols.hi], reference(s, rows[s.layer]))


def test_columns_are_the_same_on_both_sides() -> None:
    assert columns_of(SPECS) == ProbeBank(SPECS, "cpu").columns


def test_banks_round_trip(tmp_path: Any) -> None:
    """The banks the loader decodes at load give back the probes (same columns, same
    arrays), the steering capacity and the vectors the front end encoded; a text that is not
    probehook's banks is refused."""
    import base64

    from probehook.core.steering_wire import VectorRows

    ones = np.ones(HIDDEN, np.float32)
    vectors = {"up": {1: np.arange(HIDDEN, dtype=np.float32)}, "two": {0: ones, 2: -ones}}
    capped = VectorRows({1: ones / 3}, {1: -ones}, "cap", {"min": None, "max": 4.0})
    text = WorkerBanks(SPECS, 9, {**vectors, "capped": capped}).encode()
    assert isinstance(text, str)  # travels in the engine's config, to any node
    read = WorkerBanks.decode(text)
    assert columns_of(read.probes) == columns_of(SPECS) and read.steering_capacity == 9
    for a, b in zip(read.probes, SPECS, strict=True):
        assert (a.name, a.layer, a.activation) == (b.name, b.layer, b.activation)
        assert np.array_equal(a.weight, b.weight) and np.array_equal(a.bias, b.bias)
    assert read.vectors.keys() == {*vectors, "capped"}
    for name, by_layer in vectors.items():
        rows = read.vectors[name]
        assert rows.op == "add" and rows.units is None and rows.writes.keys() == by_layer.keys()
        assert all(np.array_equal(rows.writes[k], v) for k, v in by_layer.items())
    back = read.vectors["capped"]
    assert (back.op, back.params) == ("cap", {"min": None, "max": 4.0})
    assert np.array_equal(back.writes[1], ones / 3) and np.array_equal(back.units[1], -ones)
    empty = WorkerBanks.decode(WorkerBanks().encode())
    assert empty.probes == [] and empty.vectors == {}
    from safetensors.numpy import save

    other = base64.b64encode(save({"x": ones})).decode()
    with pytest.raises(ValueError, match="not probehook's banks"):
        WorkerBanks.decode(other)


def test_score_recorder_keeps_scores_by_position_and_last_rows() -> None:
    bank = ProbeBank(SPECS, "cpu")
    buffers = {layer: torch.zeros(16, HIDDEN) for layer in bank.layers}
    recorder = StepRecorder([buffers[layer] for layer in bank.layers], bank.layers, transform=bank)
    recorder.keep_step_rows = True
    plans = {
        "a": RequestPlan("A/0", KeepPlan(Span(2, OPEN), None)),  # decode rows from P-1 = 2
        "b": None,  # no probes for this request
    }
    step1 = {layer: torch.randn(5, HIDDEN) for layer in bank.layers}
    for layer in bank.layers:
        buffers[layer][:5] = step1[layer]
    # a's 3-token prompt (rows 0..2), then b's 2 tokens.
    recorder.record(["a", "b"], np.array([0, 3, 5]), np.array([0, 0]), plans.get)
    assert recorder.step_rows is not None
    assert recorder.step_rows.last_row.tolist() == [0, -1]  # a's position 2 is kept row 0
    step2 = {layer: torch.randn(2, HIDDEN) for layer in bank.layers}
    for layer in bank.layers:
        buffers[layer][:2] = step2[layer]
    recorder.record(["b", "a"], np.array([0, 1, 2]), np.array([2, 3]), plans.get)
    assert recorder.step_rows.last_row.tolist() == [-1, 0]
    (scores,), (span,), error = recorder.export("A/0", [Span(2, 4)], ["scores"], final=True)
    assert error is None and span.missing == []
    for s in SPECS:
        cols = bank.columns[s.name]
        want = torch.cat([reference(s, step1[s.layer][2:3]), reference(s, step2[s.layer][1:2])])
        torch.testing.assert_close(scores[0, :, cols.lo : cols.hi], want)
    assert recorder.retained_bytes() == 0


def test_monitor_validation_and_crossings() -> None:
    with pytest.raises(CaptureConfigError, match="action"):
        ProbeMonitor("truth", 0.5, action="halt")
    with pytest.raises(CaptureConfigError, match="direction"):
        ProbeMonitor("truth", 0.5, direction="up")
    with pytest.raises(CaptureConfigError, match="Unknown ProbeMonitor field"):
        ProbeMonitor.coerce({"probe": "truth", "threshold": 0.5, "when": 1})
    assert ProbeMonitor.coerce({"probe": "t", "threshold": 0.5}).action == "flag"
    values = np.array([0.1, 0.6, 0.5, 0.9], dtype=np.float32)
    assert crossings(values, 0.5, "above") == [1, 3]
    assert crossings(values, 0.5, "below") == [0]


def _probe(name: str | None, layer: int = 1, kind: str = "binary"):
    from probehook import LinearProbe

    outputs = 3 if kind == "multiclass" else 1
    labels = ["a", "b", "c"] if kind == "multiclass" else None
    return LinearProbe(
        torch.randn(outputs, HIDDEN), torch.zeros(outputs), layer=layer, kind=kind,
        label_names=labels, name=name,
    )  # fmt: skip


def test_probes_given_as_a_list_are_named_by_their_names(tmp_path) -> None:
    from probehook.frontend.probe_set import load_probes

    truth, topic = _probe("truth"), _probe("topic", kind="multiclass")
    assert list(load_probes([truth, topic])) == ["truth", "topic"]
    truth.save(tmp_path / "t.safetensors")
    loaded = load_probes({"t": tmp_path / "t.safetensors"})  # a path loads the saved probe
    assert torch.equal(loaded["t"].weight, truth.weight)
    with pytest.raises(CaptureConfigError, match=r"probes\[0\] has no name"):
        load_probes([_probe(None)])
    with pytest.raises(CaptureConfigError, match="Two probes are named 'truth'"):
        load_probes([truth, _probe("truth")])


def test_probe_set_requests_split_and_monitor_columns() -> None:
    from probehook.frontend.probe_set import ProbeSet

    probes = {"truth": _probe("truth", 2), "topic": _probe("topic", 0, "multiclass")}
    monitors = [ProbeMonitor("topic", 0.5, label="c"), ProbeMonitor("truth", 0.9, "stop")]
    ps = ProbeSet(probes, monitors, num_layers=4, hidden_size=HIDDEN, model_fingerprint=None)
    # Columns are laid out by layer: topic (layer 0) first.
    assert ps.column(monitors[0]) == 2 and ps.column(monitors[1]) == 3
    everything = ps.for_request({})
    assert everything.names == ("truth", "topic") and everything.stops
    only_topic = ps.for_request({"probes": ["topic"]})
    assert only_topic.monitors == (monitors[0],)  # the engine's monitors for its probes
    assert ps.for_request({"probes": False}).names == ()
    scores = torch.arange(8.0).reshape(2, 4)
    split = ps.split(scores, ["truth", "topic"])
    assert split["truth"].tolist() == [3.0, 7.0] and split["topic"].shape == (2, 3)
    decode = {"truth": torch.tensor([0.2, 0.95]), "topic": torch.tensor([[0, 0, 0.6]] * 2)}
    flags, stop = ps.flags_and_stop(everything, decode, stopped_by_token=True)
    assert flags == {"topic": [0, 1]} and stop == "probe:truth"
    _, stop = ps.flags_and_stop(everything, decode, stopped_by_token=False)
    assert stop is None  # ended some other way: the monitor did not stop it
