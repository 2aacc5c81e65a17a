"""Unit tests of the streaming data plane (no vLLM): the recorder hands over streamed rows in
order and frees them, frames round-trip without pickle, the receiver waits for late rows and
reports failures."""

from __future__ import annotations

import asyncio
import tempfile
import time

import numpy as np
import pytest
import torch

from probehook.core import stream_frames
from probehook.core.spans import OPEN, KeepPlan, Span
from probehook.errors import CaptureError
from probehook.frontend import stream_receiver
from probehook.frontend.fill import FailedCapture
from probehook.worker import stream_publisher
from probehook.worker.recorder import RequestPlan, StepRecorder

HIDDEN = 3


def fill(buffer: torch.Tensor, positions: list[int]) -> None:
    for row, pos in enumerate(positions):
        buffer[row] = pos


def test_recorder_hands_over_contiguous_rows_once_and_forgets_departed_streams() -> None:
    buffer = torch.zeros(8, HIDDEN)
    recorder = StepRecorder([buffer], layers=(0,))
    plans = {"r": RequestPlan("T/0", KeepPlan(Span(0, OPEN), None), stream=True)}
    fill(buffer, [0, 1, 2])  # a 3-token prompt
    recorder.record(["r"], np.array([0, 3]), np.array([0]), plans.get)
    (key, lo, rows, error), *rest = recorder.take_streamed({"r"})
    assert (key, lo, error, rest) == ("T/0", 0, None, [])
    assert rows[0, :, 0].tolist() == [0, 1, 2]
    assert recorder.take_streamed({"r"}) == []  # nothing new: nothing sent twice
    fill(buffer, [3])
    recorder.record(["r"], np.array([0, 1]), np.array([3]), plans.get)
    ((_, lo, rows, _),) = recorder.take_streamed({"r"})
    assert lo == 3 and rows[0, :, 0].tolist() == [3]
    assert recorder.retained_bytes() == 0  # handed over means freed
    assert recorder.take_streamed(set()) == []  # the request left the engine
    assert recorder.streams == {} and recorder.rows_by_key == {} and recorder.rows_by_req == {}


def test_a_decode_only_stream_starts_at_its_first_kept_position() -> None:
    buffer = torch.zeros(8, HIDDEN)
    recorder = StepRecorder([buffer], layers=(0,))
    plans = {"r": RequestPlan("T/0", KeepPlan(Span(4, OPEN), None), stream=True)}  # P = 5
    fill(buffer, [0, 1, 2, 3, 4])
    recorder.record(["r"], np.array([0, 5]), np.array([0]), plans.get)
    ((_, lo, rows, _),) = recorder.take_streamed({"r"})
    assert lo == 4 and rows[0, :, 0].tolist() == [4]
    fill(buffer, [5])
    recorder.record(["r"], np.array([0, 1]), np.array([5]), plans.get)
    ((_, lo, rows, _),) = recorder.take_streamed({"r"})
    assert lo == 5 and rows[0, :, 0].tolist() == [5]


def test_a_failed_stream_is_reported_once() -> None:
    buffer = torch.zeros(8, HIDDEN)
    recorder = StepRecorder([buffer], layers=(0,), limit_bytes=4)  # less than one row
    plans = {"r": RequestPlan("T/0", KeepPlan(Span(0, OPEN), None), stream=True)}
    recorder.record(["r"], np.array([0, 2]), np.array([0]), plans.get)
    ((key, _, rows, error),) = recorder.take_streamed({"r"})
    assert key == "T/0" and rows is None and "per-request limit" in error
    recorder.record(["r"], np.array([0, 1]), np.array([2]), plans.get)
    assert recorder.take_streamed({"r"}) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frames_round_trip(dtype: torch.dtype) -> None:
    rows = torch.randn(2, 5, HIDDEN).to(dtype)
    host = (rows.view(torch.int16) if dtype == torch.bfloat16 else rows).numpy()
    other = torch.randn(2, 1, HIDDEN).to(dtype)  # a second stream in the same message
    other_host = (other.view(torch.int16) if dtype == torch.bfloat16 else other).numpy()
    chunks = [
        ("T/0", 7, host, None),
        ("U/0", 0, None, "over the limit"),
        ("V/1", 3, other_host, None),
    ]
    frames = stream_frames.encode("hidden", chunks, dtype)
    source, got = stream_frames.decode([bytes(f) for f in frames])
    assert source == "hidden" and [(k, lo, e) for k, lo, _, e in got] == [
        ("T/0", 7, None),
        ("U/0", 0, "over the limit"),
        ("V/1", 3, None),
    ]
    assert got[0][2].dtype == dtype and torch.equal(got[0][2], rows) and got[1][2] is None
    assert torch.equal(got[2][2], other)
    with pytest.raises(CaptureError, match="dtype"):
        stream_frames.decode([frames[0].replace(b"float", b"pickle"), bytes(frames[1])])
    with pytest.raises(CaptureError, match="too short"):
        stream_frames.decode([frames[0], bytes(frames[1])[:-1]])


def test_receiver_waits_for_rows_and_reports_failures() -> None:
    with tempfile.TemporaryDirectory() as directory:
        receiver = stream_receiver.Receiver(directory)
        publisher = stream_publisher.Publisher(receiver.address)
        receiver.expect("T")
        try:

            async def main() -> tuple[torch.Tensor, float]:
                waiting = asyncio.ensure_future(receiver.take("hidden", "T/0", 0, 4))
                await asyncio.sleep(0.2)
                assert not waiting.done()  # positions 0..3 have not arrived
                chunk = np.arange(2 * HIDDEN, dtype=np.float32).reshape(1, 2, HIDDEN)
                for lo in (0, 2):
                    message = stream_frames.encode(
                        "hidden", [("T/0", lo, chunk, None)], torch.float32
                    )
                    publisher.send(message)
                started = time.monotonic()
                rows = await asyncio.wait_for(waiting, 10)
                return rows, time.monotonic() - started

            rows, waited = asyncio.run(main())
            assert rows.shape == (1, 4, HIDDEN) and waited < 5
            failed = [("T/1", 0, None, "over the limit")]
            publisher.send(stream_frames.encode("scores", failed, torch.float32))
            with pytest.raises(stream_frames.StreamFailed) as failure:
                asyncio.run(asyncio.wait_for(receiver.take("scores", "T/1", 0, 1), 10))
            # A stream and an offline fill tell the user the same thing.
            assert str(failure.value) == FailedCapture.of_stream("T/1", "over the limit").reason
            assert "T/1" in str(failure.value) and "over the limit" in str(failure.value)
            receiver.drop("T")
            assert receiver.pending_streams == 0
            chunk = np.zeros((1, 1, HIDDEN), dtype=np.float32)  # a late row of a dropped tag
            publisher.send(stream_frames.encode("hidden", [("T/0", 9, chunk, None)], torch.float32))
            # Then a row of a live tag down the same socket (one publisher's messages arrive
            # in order): once it is taken, the late row has been received and discarded.
            receiver.expect("U")
            publisher.send(stream_frames.encode("hidden", [("U/0", 0, chunk, None)], torch.float32))
            asyncio.run(asyncio.wait_for(receiver.take("hidden", "U/0", 0, 1), 10))
            assert receiver.pending_streams == 1  # U/0 alone: nothing kept for T
            receiver.drop("U")
            assert receiver.pending_streams == 0
        finally:
            publisher.close()
            receiver.close()


def test_out_of_order_rows_are_refused() -> None:
    stream = stream_receiver.StreamRows()
    stream.add(4, torch.zeros(1, 2, HIDDEN))
    with pytest.raises(CaptureError, match="out of order"):
        stream.add(7, torch.zeros(1, 1, HIDDEN))


def test_a_dead_receiver_thread_fails_its_waiters_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiver's thread ending on an error nobody expected must fail every waiter with
    the cause, at once and later, instead of leaving them to sit out the 120 s deadline
    (issue 37, item 4)."""

    def broken(frames: list) -> None:
        raise MemoryError("staged: the receiver thread dies here")

    monkeypatch.setattr(stream_receiver, "decode", broken)
    with tempfile.TemporaryDirectory() as directory:
        receiver = stream_receiver.Receiver(directory)
        publisher = stream_publisher.Publisher(receiver.address)
        receiver.expect("T")
        try:

            async def main() -> None:
                waiting = asyncio.ensure_future(receiver.take("hidden", "T/0", 0, 1))
                await asyncio.sleep(0.1)
                chunk = np.zeros((1, 1, HIDDEN), dtype=np.float32)
                publisher.send(
                    stream_frames.encode("hidden", [("T/0", 0, chunk, None)], torch.float32)
                )
                with pytest.raises(CaptureError, match="staged: the receiver thread dies"):
                    await asyncio.wait_for(waiting, 10)
                with pytest.raises(CaptureError, match="receiver"):  # and any later wait
                    await asyncio.wait_for(receiver.take("hidden", "T/0", 0, 1), 10)

            asyncio.run(main())
        finally:
            publisher.close()
            receiver.close()


def test_the_publisher_never_blocks_the_step_when_the_front_end_falls_behind() -> None:
    """A front end that stops reading fills the socket's high-water mark; the worker's send
    must still return at once (the engine's step calls it), and every message must arrive,
    in order, once the front end reads again (issue 37, item 4)."""
    import threading

    import zmq

    with tempfile.TemporaryDirectory() as directory:
        address = f"ipc://{directory}/s"
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.bind(address)
        publisher = stream_publisher.Publisher(address, high_water_mark=1)
        try:
            messages = [[f"m{i}".encode(), b"x" * 64] for i in range(200)]
            sending = threading.Thread(target=lambda: [publisher.send(m) for m in messages])
            sending.start()
            sending.join(timeout=10)
            assert not sending.is_alive(), "send blocked on a front end that does not read"
            got = [pull.recv_multipart()[0].decode() for _ in messages]
            assert got == [f"m{i}" for i in range(200)]
        finally:
            publisher.close()
            pull.close(0)
            context.term()


def test_a_recorder_answers_for_its_own_source_only() -> None:
    """The worker finds a source's recorder by the source each recorder keeps: an export of a
    source the engine does not record finds none (it used to reach the probe scorer, whatever
    it named), and stream messages carry the recorder's own source (issue 38, first reshape)."""
    from types import SimpleNamespace

    from probehook.adapter.worker.rpc import _recorder

    rows = StepRecorder([torch.zeros(4, HIDDEN)], layers=(0,))
    scores = StepRecorder([torch.zeros(4, HIDDEN)], layers=(0,), source="scores")
    hook = SimpleNamespace(recorders=lambda: [rows, scores])
    assert _recorder(hook, "hidden") is rows and _recorder(hook, "scores") is scores
    assert _recorder(hook, "sae") is None
    assert _recorder(SimpleNamespace(recorders=lambda: [rows]), "scores") is None
