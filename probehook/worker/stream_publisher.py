"""The worker's end of the streaming data plane (``probehook.core.stream_frames``): one
ZeroMQ PUSH socket on rank 0, sending each step's message without blocking the engine."""

from __future__ import annotations

from typing import Any

ZERO_COPY_BYTES = 1 << 16
"""Payloads at least this large are sent without a copy; smaller ones are cheaper copied."""


class Publisher:
    """The worker's end: sends chunks, never blocks the engine for long.

    ``address`` None makes a publisher that drops everything (tensor-parallel ranks other
    than 0, which free their streamed scores the same way but do not report them).
    """

    def __init__(self, address: str | None) -> None:
        self.sent_bytes = 0
        self._socket = None
        if address is not None:
            import zmq

            self._context = zmq.Context.instance()
            self._socket = self._context.socket(zmq.PUSH)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(address)

    def send(self, frames: list[Any]) -> None:
        if self._socket is None:
            return
        # Zero-copy pays off only for large payloads; small ones are cheaper copied.
        self._socket.send_multipart(frames, copy=len(frames[1]) < ZERO_COPY_BYTES)
        self.sent_bytes += sum(len(f) for f in frames)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
