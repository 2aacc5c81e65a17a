"""The streaming data plane: rows and scores pushed from the worker's step hook to the front
end as they are computed, so a streamed token and its row arrive in the same yield without an
RPC per step (vLLM serves RPCs between engine steps, so one per step would stall generation).

One ZeroMQ PUSH socket in the worker (rank 0), one PULL socket bound by the front end on an
``ipc://`` path in its private (0700) spool directory. A message is two frames: a JSON header
``{"key", "source", "lo", "dtype", "shape"}`` (or ``{"key", "source", "error"}``) and the raw
bytes of a ``[slots, rows, width]`` array, C order. Nothing is pickled.

Rows of one stream arrive in position order and without gaps: the worker sends a request's
rows only once every position below them is filled (see
:meth:`probehook.core.recorder.StepRecorder.take_streamed`).

This module knows nothing about vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from probehook.core.transport import DTYPES
from probehook.errors import CaptureError

logger = logging.getLogger(__name__)

SOCKET_NAME = "stream.sock"
WAIT_TIMEOUT_S = 120.0
"""How long the front end waits for a row the engine has already passed. The worker sends
each row before the token it produced leaves the engine, so a wait this long means a bug."""


class StreamFailed(CaptureError):
    """The worker reported that a stream's capture failed (for instance, over the
    per-request byte limit); the request's other outputs are fine."""


def encode(key: str, source: str, lo: int, rows: np.ndarray, dtype: torch.dtype) -> list[Any]:
    """The two frames of one chunk of rows (``rows``: host numpy, bfloat16 as int16 bits)."""
    header = {"key": key, "source": source, "lo": lo, "dtype": str(dtype), "shape": rows.shape}
    return [json.dumps(header).encode(), memoryview(np.ascontiguousarray(rows))]


def encode_error(key: str, source: str, reason: str) -> list[Any]:
    return [json.dumps({"key": key, "source": source, "error": reason}).encode(), b""]


def decode(frames: list[Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Header and tensor of one message; refuses anything that is not what :func:`encode`
    writes (the socket is private, but a bad frame must fail loudly, never be guessed at)."""
    if len(frames) != 2:
        raise CaptureError(f"Stream message with {len(frames)} frames; expected 2.")
    header = json.loads(bytes(frames[0]))
    if "error" in header:
        return header, None
    dtype = DTYPES.get(header["dtype"])
    if dtype is None:
        raise CaptureError(f"Stream message with dtype {header['dtype']!r}; known: {list(DTYPES)}")
    payload = bytearray(frames[1])  # a private, writable copy the tensor can own
    tensor = torch.frombuffer(payload, dtype=dtype) if payload else torch.empty(0, dtype=dtype)
    return header, tensor.view(header["shape"])


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
        self._socket.send_multipart(frames, copy=False)
        self.sent_bytes += sum(len(f) for f in frames)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None


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
        self.received_bytes = 0
        self._thread = threading.Thread(target=self._run, name="probehook-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
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
                header, tensor = decode([f.buffer for f in frames])
            except (CaptureError, ValueError, KeyError) as e:  # never let the thread die
                logger.error("probehook: dropped a bad stream message: %s", e)
                continue
            key = (header["source"], header["key"])
            with self._lock:
                if header["key"].rsplit("/", 1)[0] not in self._expected:
                    continue  # a step that ran after its request was dropped (an abort)
                stream = self._streams.setdefault(key, StreamRows())
                if tensor is None:
                    stream.error = header["error"]
                else:
                    try:
                        stream.add(int(header["lo"]), tensor)
                    except CaptureError as e:  # the stream's reader gets the error
                        stream.error = str(e)
                waiters = self._waiters.pop(key, [])
            for loop, future in waiters:
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
                stream = self._streams.get(name)
                if stream is not None and stream.error is not None:
                    raise StreamFailed(f"Capture of stream {key} failed: {stream.error}")
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
