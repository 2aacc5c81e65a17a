"""The worker's end of the streaming data plane (``probehook.core.stream_frames``): one
ZeroMQ PUSH socket on rank 0, sending each step's message without blocking the engine."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

logger = logging.getLogger(__name__)

ZERO_COPY_BYTES = 1 << 16
"""Payloads at least this large are sent without a copy; smaller ones are cheaper copied."""
POLL_MS = 100
"""How often a send waiting at the high-water mark checks whether the publisher closed."""


class Publisher:
    """The worker's end: the step hands each message over and goes on; a thread of the
    publisher's own sends them, in order.

    A socket's send blocks once its high-water mark is reached (a front end that stopped
    reading, or fell behind): that wait happens on the sending thread, never in the engine's
    step. Messages wait in an unbounded queue meanwhile (:attr:`backlog` counts them, and
    ``probehook_stats`` reports it).

    ``address`` None makes a publisher that drops everything (tensor-parallel ranks other
    than 0, which free their streamed scores the same way but do not report them).
    """

    def __init__(self, address: str | None, high_water_mark: int = 1000) -> None:
        self.sent_bytes = 0
        self.queued = 0  # messages handed over
        self.sent = 0  # of those, sent
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if address is not None:
            import zmq

            socket = zmq.Context.instance().socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, high_water_mark)
            socket.connect(address)
            self._thread = threading.Thread(
                target=self._run, args=(socket,), name="probehook-stream-send", daemon=True
            )
            self._thread.start()

    @property
    def backlog(self) -> int:
        """Messages handed over and not sent yet."""
        return self.queued - self.sent

    def send(self, frames: list[Any]) -> None:
        """Hand one message over; returns at once."""
        if self._thread is None:
            return
        self.queued += 1
        self._queue.put(frames)

    def _run(self, socket: Any) -> None:
        import zmq

        try:
            while True:
                frames = self._queue.get()
                if frames is None:
                    return
                # Zero-copy pays off only for large payloads; small ones are cheaper copied.
                copy = len(frames[1]) < ZERO_COPY_BYTES
                while True:
                    try:
                        socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                        break
                    except zmq.Again:  # at the high-water mark: wait, unless closing
                        if self._closing.is_set():
                            return
                        socket.poll(POLL_MS, zmq.POLLOUT)
                self.sent += 1
                self.sent_bytes += sum(len(f) for f in frames)
        except Exception as e:  # noqa: BLE001 - the front end reports streams that stall
            logger.error("probehook: the stream publisher stopped: %s", e)
        finally:
            socket.close(0)

    def close(self) -> None:
        """Stop sending (what is queued is dropped, as the socket's LINGER 0 always did)."""
        if self._thread is None:
            return
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._thread = None
