"""Unit tests of the step recorder with fake tap buffers (no vLLM)."""

from __future__ import annotations

import numpy as np
import torch

from probehook.recorder import NO_END, RequestPlan, StepRecorder

HIDDEN = 3


def fill(buffers: list[torch.Tensor], positions: list[tuple[str, int]]) -> None:
    """Row value encodes (layer, request, position) so misattribution is visible."""
    for slot, buf in enumerate(buffers):
        for row, (req, pos) in enumerate(positions):
            buf[row] = torch.tensor([slot, ord(req), pos], dtype=buf.dtype)


def test_rows_follow_batch_metadata_across_steps() -> None:
    buffers = [torch.zeros(16, HIDDEN) for _ in range(2)]
    recorder = StepRecorder(buffers, layers=(1, 3))
    plans = {
        "a": RequestPlan("A/0", "a", lo=0, hi=NO_END),  # prefill + decode
        "b": RequestPlan("B/0", "b", lo=4, hi=NO_END),  # decode only, 5-token prompt
        "c": None,  # not captured
    }
    # Step 1: a's 3-token prompt, b's first chunk of 3 prompt tokens.
    fill(buffers, [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)])
    recorder.record(["a", "b"], np.array([0, 3, 6]), np.array([0, 0]), plans.get)
    # Step 2 (reordered batch): c's prompt, b's last 2 prompt tokens, a's first decode token.
    fill(buffers, [("c", 0), ("c", 1), ("b", 3), ("b", 4), ("a", 3)])
    recorder.record(["c", "b", "a"], np.array([0, 2, 4, 5]), np.array([0, 3, 3]), plans.get)
    # Step 3: b recomputed from scratch after preemption (positions 0..5), a decodes.
    fill(buffers, [("a", 4)] + [("b", p) for p in range(6)])
    recorder.record(["a", "b"], np.array([0, 1, 7]), np.array([4, 0]), plans.get)

    (a_rows,), (a_range,) = recorder.export("A/0", [(0, 5)], [1, 3])
    assert a_range.missing == []
    assert a_rows.shape == (2, 5, HIDDEN)
    assert a_rows[:, :, 1].eq(ord("a")).all()
    assert a_rows[0, :, 2].tolist() == [0, 1, 2, 3, 4]
    assert a_rows[1, :, 0].eq(1).all()  # second engine layer slot

    (b_rows,), (b_range,) = recorder.export("B/0", [(4, 6)], [3])
    assert b_range.missing == []
    assert b_rows[0, :, 1].eq(ord("b")).all()
    assert b_rows[0, :, 2].tolist() == [4, 5]
    assert recorder.plans_by_key == {}


def test_missing_positions_are_reported_not_invented() -> None:
    buffers = [torch.zeros(8, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    plan = RequestPlan("K/0", "k", lo=0, hi=NO_END)
    # The first 2 prompt tokens came from a prefix cache and were never computed.
    fill(buffers, [("k", 2), ("k", 3)])
    recorder.record(["k"], np.array([0, 2]), np.array([2]), {"k": plan}.get)
    _, (result,) = recorder.export("K/0", [(0, 4)], [0])
    assert result.missing == [0, 1]


def test_unseen_request_export_reports_everything_missing() -> None:
    recorder = StepRecorder([torch.zeros(4, HIDDEN)], layers=(0,))
    _, (result,) = recorder.export("nobody/0", [(0, 2)], [0])
    assert result.missing == [0, 1]
