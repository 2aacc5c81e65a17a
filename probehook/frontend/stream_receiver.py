"""The front end's end of the streaming data plane (``probehook.core.stream_frames``): a PULL
socket bound in the private spool directory, drained by a thread into per-stream buffers that
any event loop can await."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import torch

from probehook.core.stream_frames import SOCKET_NAME, StreamFailed, decode, failure_message
from probehook.errors import CaptureError

logger = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 120.0
"""How long the front end waits for a row the engine has already passed. The worker sends
each row before the token it produced leaves the engine, so a wait this long means a bug."""


class StreamRows:
    """What the front end received for one (source, stream key): contiguous positions from
    ``lo`` to ``hi`` in one growing buffer, so that handing out rows is a view, not a copy
    (a cumulative stream asks for every row to date at every token)."""

    def __init__(self) -> None:
        self.lo = self.hi = -1
        self.error: str | None = None
        self._buf: torch.Tensor | None = None  # [slots, capacity, width]

    def add(self, lo: int, rows: torch.Tensor) -> None:
        if self.lo < 0:
            self.lo = self.hi = lo
        if lo != self.hi:
            raise CaptureError(
                f"Streamed rows out of order: got position {lo}, expected {self.hi}. This is "
                "a probehook bug: please report it."
            )
        count, end = rows.shape[1], self.hi - self.lo + rows.shape[1]
        if self._buf is None or end > self._buf.shape[1]:
            # Views handed out earlier keep the old buffer alive and unchanged.
            grown = torch.empty(
                (rows.shape[0], max(end, 2 * self.capacity, 16), rows.shape[2]), dtype=rows.dtype
            )
            if self._buf is not None:
                grown[:, : self.hi - self.lo] = self._buf[:, : self.hi - self.lo]
            self._buf = grown
        self._buf[:, end - count : end] = rows
        self.hi = lo + count

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.shape[1]

    def take(self, lo: int, hi: int) -> torch.Tensor:
        """Rows of positions ``[lo, hi)``, ``[slots, hi - lo, width]`` (a view)."""
        assert self._buf is not None
        return self._buf[:, lo - self.lo : hi - self.lo]


class Receiver:
    """The front end's end: a thread drains the socket into :class:`StreamRows` and wakes
    coroutines waiting for a position; any event loop may wait (Jupyter's, ``asyncio.run``'s).
    """

    def __init__(self, directory: str) -> None:
        import zmq

        self.address = f"ipc://{directory}/{SOCKET_NAME}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._streams: dict[tuple[str, str], StreamRows] = {}
        self._expected: set[str] = set()  # request tags whose rows are wanted
        self._waiters: dict[tuple[str, str], list[tuple[asyncio.AbstractEventLoop, Any]]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._died: str | None = None  # why the thread stopped, if it stopped on an error
        self.received_bytes = 0
        self._thread = threading.Thread(target=self._run, name="probehook-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._drain()
        except Exception as e:
            # Nothing will arrive any more: every waiter, now and later, fails with the cause.
            logger.error("probehook: the stream receiver stopped: %r", e)
            with self._lock:
                self._died = f"{type(e).__name__}: {e}"
                woken = [w for waiters in self._waiters.values() for w in waiters]
                self._waiters.clear()
            for loop, future in woken:
                loop.call_soon_threadsafe(_wake, future)

    def _drain(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                raise
            self.received_bytes += sum(len(f.buffer) for f in frames)
            try:
                source, chunks = decode([f.buffer for f in frames])
            except (CaptureError, ValueError, KeyError, TypeError) as e:  # the thread must live
                logger.error("probehook: dropped a bad stream message: %s", e)
                continue
            woken = []
            with self._lock:
                for key, lo, rows, error in chunks:
                    if key.rsplit("/", 1)[0] not in self._expected:
                        continue  # a step that ran after its request was dropped (an abort)
                    stream = self._streams.setdefault((source, key), StreamRows())
                    if error is not None:
                        stream.error = error
                    else:
                        try:
                            stream.add(lo, rows)
                        except CaptureError as e:  # the stream's reader gets the error
                            stream.error = str(e)
                    woken += self._waiters.pop((source, key), [])
            for loop, future in woken:
                loop.call_soon_threadsafe(_wake, future)

    async def take(self, source: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a stream, waiting for them if the worker has not sent them yet.
        Raises :class:`CaptureError` if the worker reported the stream failed."""
        if hi <= lo:
            raise ValueError(f"empty span {lo}..{hi}: ask only for positions that exist")
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        name = (source, key)
        while True:
            with self._lock:
                if self._died is not None:
                    raise CaptureError(
                        f"Stream {key} ({source}): the front end's stream receiver stopped "
                        f"({self._died}), so no rows can arrive. This is a probehook bug: "
                        "please report it; restart the engine to capture again."
                    )
                stream = self._streams.get(name)
                if stream is not None and stream.error is not None:
                    raise StreamFailed(failure_message(key, stream.error))
                if stream is not None and stream.lo <= lo and stream.hi >= hi:
                    return stream.take(lo, hi)
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._waiters.setdefault(name, []).append((loop, future))
            left = deadline - time.monotonic()
            if left <= 0:
                got = "nothing" if stream is None else f"positions {stream.lo}..{stream.hi - 1}"
                raise CaptureError(
                    f"Stream {key} ({source}): positions {lo}..{hi - 1} did not arrive within "
                    f"{WAIT_TIMEOUT_S:.0f} s (have {got}). This is a probehook bug: please "
                    "report it with the engine arguments."
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout=min(left, 5.0))

    def expect(self, tag: str) -> None:
        """Accept the rows of request ``tag`` (streams ``tag/0``, ``tag/1``, ...) from now on;
        rows of any other request are discarded."""
        with self._lock:
            self._expected.add(tag)

    def drop(self, tag: str) -> None:
        """Forget request ``tag``'s streams (finished, aborted), and ignore late rows."""
        prefix = f"{tag}/"
        with self._lock:
            self._expected.discard(tag)
            for name in [n for n in self._streams if n[1].startswith(prefix)]:
                del self._streams[name]

    @property
    def pending_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._socket.close(0)
        self._context.term()


def _wake(future: Any) -> None:
    if not future.done():
        future.set_result(None)
