"""Unit tests of the step recorder with fake tap buffers (no vLLM)."""

from __future__ import annotations

import numpy as np
import torch

from probehook.core.spans import OPEN, KeepPlan, Span
from probehook.worker.recorder import RequestPlan, StepRecorder

HIDDEN = 3


def fill(buffers: list[torch.Tensor], positions: list[tuple[str, int]]) -> None:
    """Row value encodes (layer, request, position) so misattribution is visible."""
    for slot, buf in enumerate(buffers):
        for row, (req, pos) in enumerate(positions):
            buf[row] = torch.tensor([slot, ord(req), pos], dtype=buf.dtype)


def expected(slot: int, req: str, positions: range) -> torch.Tensor:
    return torch.tensor([[slot, ord(req), p] for p in positions], dtype=torch.float32)


def plan(
    key: str, lo: int, hi: int = OPEN, latest_from: int | None = None, one_pass: bool = False
) -> RequestPlan:
    keep = KeepPlan(Span(lo, hi) if hi > lo else None, latest_from)
    return RequestPlan(key, keep, one_pass=one_pass)


def test_rows_follow_batch_metadata_across_steps() -> None:
    buffers = [torch.zeros(16, HIDDEN) for _ in range(2)]
    recorder = StepRecorder(buffers, layers=(1, 3))
    plans = {"a": plan("A/0", 0), "b": plan("B/0", 4), "c": None}  # b: decode only, P=5
    # Step 1: a's 3-token prompt, b's first chunk of 3 prompt tokens.
    fill(buffers, [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)])
    recorder.record(["a", "b"], np.array([0, 3, 6]), np.array([0, 0]), plans.get)
    # Step 2: the batch is reordered; c is not captured; b finishes its prompt.
    fill(buffers, [("c", 0), ("c", 1), ("b", 3), ("b", 4), ("a", 3)])
    recorder.record(["c", "b", "a"], np.array([0, 2, 4, 5]), np.array([0, 3, 3]), plans.get)
    # Step 3: decode for a; b's next decode position.
    fill(buffers, [("a", 4), ("b", 5)])
    recorder.record(["a", "b"], np.array([0, 1, 2]), np.array([4, 5]), plans.get)

    (a_rows,), (a_span,), error = recorder.export("A/0", [Span(0, 5)], [1, 3], final=True)
    assert error is None and a_span.missing == []
    for slot in (0, 1):
        torch.testing.assert_close(a_rows[slot], expected(slot, "a", range(5)))
    (b_rows,), (b_span,), _ = recorder.export("B/0", [Span(4, 6)], [3], final=True)
    assert b_span.missing == []
    torch.testing.assert_close(b_rows[0], expected(1, "b", range(4, 6)))
    assert recorder.rows_by_key == {} and recorder.retained_bytes() == 0


def test_missing_rows_are_reported() -> None:
    buffers = [torch.zeros(8, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    fill(buffers, [("k", 2), ("k", 3)])
    recorder.record(["k"], np.array([0, 2]), np.array([2]), {"k": plan("K/0", 0)}.get)
    _, (result,), _ = recorder.export("K/0", [Span(0, 4)], [0], final=True)
    assert result.missing == [0, 1]


def test_unknown_key_is_all_missing() -> None:
    recorder = StepRecorder([torch.zeros(4, HIDDEN)], layers=(0,))
    _, (result,), _ = recorder.export("nobody/0", [Span(0, 2)], [0], final=True)
    assert result.missing == [0, 1]


def test_retained_memory_is_each_requests_own_rows() -> None:
    """A long request beside many short ones keeps only its own rows, not whole steps."""
    buffers = [torch.zeros(64, HIDDEN) for _ in range(2)]
    recorder = StepRecorder(buffers, layers=(0, 1))
    plans = {"long": plan("L/0", 0)} | {f"s{i}": plan(f"S{i}/0", 0) for i in range(8)}
    row_bytes = 2 * HIDDEN * 4
    # One step: the long request's 1 row beside 8 short requests' 7-row prompts.
    ids = ["long"] + [f"s{i}" for i in range(8)]
    starts = np.array([0, 1] + [1 + 7 * (i + 1) for i in range(8)])
    recorder.record(ids, starts, np.zeros(9, dtype=np.int64), plans.get)
    for i in range(8):
        recorder.export(f"S{i}/0", [Span(0, 7)], [0, 1], final=True)
    # Only the long request's row buffer is left (grown to the minimum capacity).
    assert set(recorder.rows_by_key) == {"L/0"}
    assert recorder.retained_bytes() == 16 * row_bytes
    assert recorder._in_flight == []


def test_last_decode_token_keeps_one_row() -> None:
    buffers = [torch.zeros(8, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    plans = {"r": plan("R/0", 0, 0, latest_from=2)}  # P = 3, only the last decode row
    fill(buffers, [("r", 0), ("r", 1), ("r", 2)])
    recorder.record(["r"], np.array([0, 3]), np.array([0]), plans.get)
    for pos in range(3, 40):
        fill(buffers, [("r", pos)])
        recorder.record(["r"], np.array([0, 1]), np.array([pos]), plans.get)
        assert recorder.retained_bytes() == HIDDEN * 4
    # Preemption recomputes earlier positions: the latest row never moves back.
    fill(buffers, [("r", 0), ("r", 1), ("r", 2)])
    recorder.record(["r"], np.array([0, 3]), np.array([0]), plans.get)
    (rows,), (span,), _ = recorder.export("R/0", [Span(39, 40)], [0], final=True)
    assert span.missing == []
    torch.testing.assert_close(rows[0], expected(0, "r", range(39, 40)))


def test_cursor_export_hands_rows_over_once_and_frees_them() -> None:
    buffers = [torch.zeros(8, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    plans = {"r": plan("R/0", 2)}
    fill(buffers, [("r", 0), ("r", 1), ("r", 2)])
    recorder.record(["r"], np.array([0, 3]), np.array([0]), plans.get)
    (first,), _, _ = recorder.export("R/0", [Span(2, 3)], [0], final=False)
    torch.testing.assert_close(first[0], expected(0, "r", range(2, 3)))
    for pos in (3, 4):
        fill(buffers, [("r", pos)])
        recorder.record(["r"], np.array([0, 1]), np.array([pos]), plans.get)
    (more,), (span,), _ = recorder.export("R/0", [Span(3, 5)], [0], final=False)
    assert span.missing == []
    torch.testing.assert_close(more[0], expected(0, "r", range(3, 5)))
    # Handed-over positions are gone; asking again reports them missing.
    _, (again,), _ = recorder.export("R/0", [Span(2, 5)], [0], final=False)
    assert again.missing == [2, 3, 4]
    assert recorder.retained_bytes() == 0
    recorder.export("R/0", [], [0], final=True)
    assert recorder.rows_by_key == {}


def test_request_over_the_limit_fails_alone() -> None:
    buffers = [torch.zeros(64, HIDDEN)]
    row_bytes = HIDDEN * 4
    recorder = StepRecorder(buffers, layers=(0,), limit_bytes=20 * row_bytes)
    plans = {"big": plan("B/0", 0), "small": plan("S/0", 0)}
    recorder.record(
        ["big", "small"], np.array([0, 30, 34]), np.array([0, 0]), plans.get
    )  # big: 30 rows (over 20), small: 4 rows
    _, _, error = recorder.export("B/0", [Span(0, 30)], [0], final=True)
    assert error is not None and "per-request limit" in error
    _, (span,), ok = recorder.export("S/0", [Span(0, 4)], [0], final=True)
    assert ok is None and span.missing == []


def test_forget_frees_rows() -> None:
    buffers = [torch.zeros(8, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    recorder.record(["x"], np.array([0, 4]), np.array([0]), {"x": plan("T-1/0", 0)}.get)
    assert recorder.retained_bytes() > 0
    assert recorder.forget(["T-1/"]) == 1
    assert recorder.retained_bytes() == 0 and recorder.rows_by_key == {}
    # Late steps of the forgotten request are ignored, not re-created.
    recorder.record(["x"], np.array([0, 1]), np.array([4]), {"x": plan("T-1/0", 0)}.get)
    assert recorder.rows_by_key == {}


def test_one_step_requests_export_in_one_block() -> None:
    """One-pass requests whose every kept row comes in one step are held as views of it and
    exported together with requests read row by row (a chunked one, a generating one) and a
    failed one, in order, for all layers and for a subset."""
    buffers = [torch.zeros(32, HIDDEN) for _ in range(2)]
    row_bytes = 2 * HIDDEN * 4
    recorder = StepRecorder(buffers, layers=(1, 3), limit_bytes=6 * row_bytes)
    plans = {
        "a": plan("A/0", 0, 3, one_pass=True),
        "b": plan("B/0", 1, 4, one_pass=True),  # keeps positions 1..3 of a 4-token prompt
        "c": plan("C/0", 0, 6, one_pass=True),  # its prompt comes in two chunks
        "d": plan("D/0", 0, 8, one_pass=True),  # over the per-request limit: fails alone
        "e": plan("E/0", 0, 2),  # a generating request: copied, not a view
    }
    step1 = [("a", p) for p in range(3)] + [("b", p) for p in range(4)] + [("c", 0), ("c", 1)]
    step1 += [("d", p) for p in range(8)] + [("e", p) for p in range(2)]
    fill(buffers, step1)
    recorder.record(
        ["a", "b", "c", "d", "e"],
        np.array([0, 3, 7, 9, 17, 19]),
        np.array([0, 0, 0, 0, 0]),
        plans.get,
    )
    # One-pass rows that came in one step are held as views of it, with no buffer of their
    # own; the others (a chunked prompt, a generating request, one over the limit) have one.
    assert set(recorder.held) == {"A/0", "B/0"}
    assert set(recorder.rows_by_key) == {"C/0", "D/0", "E/0"}
    (block_a, offset_a, count_a, from_a) = recorder.held["A/0"]
    (block_b, offset_b, count_b, from_b) = recorder.held["B/0"]
    # Where they lie in the step's one block, side by side: no copy, no view of their own.
    assert block_a is block_b and (offset_a, count_a, from_a) == (0, 3, 0)
    assert (offset_b, count_b, from_b) == (3, 3, 1)
    fill(buffers, [("c", p) for p in range(2, 6)])
    recorder.record(["c"], np.array([0, 4]), np.array([2]), plans.get)
    # A preempted request's recompute writes the same positions again.
    fill(buffers, [("e", 0), ("e", 1)])
    recorder.record(["e"], np.array([0, 2]), np.array([0]), plans.get)

    keys = ["A/0", "B/0", "C/0", "D/0", "E/0", "nobody/0"]
    for layers in ([1, 3], [3]):
        spans = [Span(0, 3), Span(1, 4), Span(0, 6), Span(0, 8), Span(0, 2), Span(0, 1)]
        if layers == [3]:  # the same requests again, asked for one layer and fewer rows
            spans[0], spans[4] = Span(0, 2), Span(1, 2)
            fill(buffers, step1)
            recorder.record(
                ["a2", "b2", "c2", "d2", "e2"],
                np.array([0, 3, 7, 9, 17, 19]),
                np.zeros(5, dtype=np.int64),
                {f"{k}2": v for k, v in plans.items()}.get,
            )
            fill(buffers, [("c", p) for p in range(2, 6)])
            recorder.record(["c2"], np.array([0, 4]), np.array([2]), {"c2": plans["c"]}.get)
        out, incomplete, failures = recorder.export_final(keys, spans, layers)
        assert [i for i, _ in incomplete] == [3, 5] and list(failures) == ["D/0"]
        offset = 0
        for key, span in zip(keys, spans, strict=True):
            n = len(span)
            if key not in ("D/0", "nobody/0"):
                for out_slot, layer in enumerate(layers):
                    want = expected((1, 3).index(layer), key[0].lower(), range(span.lo, span.hi))
                    torch.testing.assert_close(out[out_slot, offset : offset + n], want)
            offset += n
        assert recorder.rows_by_key == {} and recorder.held == {}
        assert recorder.retained_bytes() == 0


def test_held_rows_join_only_their_neighbours() -> None:
    """An export takes held rows that lie side by side in their step's block as one piece,
    and cuts apart rows asked in another order, from another step, or with a gap."""
    buffers = [torch.zeros(32, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    plans = {r: plan(f"{r.upper()}/0", 0, 3, one_pass=True) for r in "abcdef"}
    fill(buffers, [(r, p) for r in "abc" for p in range(3)])
    recorder.record(["a", "b", "c"], np.array([0, 3, 6, 9]), np.zeros(3, np.int64), plans.get)
    fill(buffers, [(r, p) for r in "def" for p in range(3)])
    recorder.record(["d", "e", "f"], np.array([0, 3, 6, 9]), np.zeros(3, np.int64), plans.get)
    # Neighbours (A B, D E), out of order (C before them), across steps (F lies where C's
    # rows lie in the other block, right after B's), a gap (D after F).
    keys = ["C/0", "A/0", "B/0", "F/0", "D/0", "E/0"]
    out, incomplete, failures = recorder.export_final(keys, [Span(0, 3)] * len(keys), [0])
    assert incomplete == [] and failures == {} and recorder.held == {}
    for i, key in enumerate(keys):
        want = expected(0, key[0].lower(), range(3))
        torch.testing.assert_close(out[0, 3 * i : 3 * i + 3], want)


def test_held_rows_export_per_stream_count_and_forget() -> None:
    """Held one-pass rows are found by a per-stream export too (part by part), count as
    pending and retained, and ``forget`` drops them."""
    buffers = [torch.zeros(16, HIDDEN)]
    recorder = StepRecorder(buffers, layers=(0,))
    plans = {r: plan(f"T-{r}/0", 0, 4, one_pass=True) for r in "ab"}
    fill(buffers, [(r, p) for r in "ab" for p in range(4)])
    recorder.record(["a", "b"], np.array([0, 4, 8]), np.zeros(2, np.int64), plans.get)
    assert set(recorder.held) == {"T-a/0", "T-b/0"} and recorder.pending() == 2
    assert recorder.retained_bytes() == 2 * 4 * HIDDEN * 4
    (first,), (span,), error = recorder.export("T-a/0", [Span(0, 2)], [0], final=False)
    assert error is None and span.missing == []
    torch.testing.assert_close(first[0], expected(0, "a", range(2)))
    (rest,), (span,), _ = recorder.export("T-a/0", [Span(2, 4)], [0], final=True)
    assert span.missing == []
    torch.testing.assert_close(rest[0], expected(0, "a", range(2, 4)))
    assert recorder.forget(["T-b"]) == 1
    assert recorder.pending() == 0 and recorder.retained_bytes() == 0


def test_one_run_of_kept_rows_is_copied_out_of_the_tap_buffers() -> None:
    """When a step keeps every row it computed (one run, as a pooling batch does), the rows
    are copied once out of the tap buffers, not read in place: the next forward pass
    overwrites the buffers while the one-pass requests' rows wait for their export."""
    for layers in ((2,), (0, 2)):
        buffers = [torch.zeros(8, HIDDEN) for _ in layers]
        recorder = StepRecorder(buffers, layers=layers)
        plans = {r: plan(f"{r.upper()}/0", 0, 3, one_pass=True) for r in "abcd"}
        fill(buffers, [(r, p) for r in "ab" for p in range(3)])
        recorder.record(["a", "b"], np.array([0, 3, 6]), np.zeros(2, np.int64), plans.get)
        fill(buffers, [(r, p) for r in "cd" for p in range(3)])  # the next step's forward
        recorder.record(["c", "d"], np.array([0, 3, 6]), np.zeros(2, np.int64), plans.get)
        keys = ["A/0", "B/0", "C/0", "D/0"]
        rows, incomplete, failures = recorder.export_final(keys, [Span(0, 3)] * 4, list(layers))
        assert incomplete == [] and failures == {}
        for slot in range(len(layers)):
            for index, request in enumerate("abcd"):
                got = rows[slot, 3 * index : 3 * index + 3]
                torch.testing.assert_close(got, expected(slot, request, range(3)))
