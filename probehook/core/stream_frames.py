"""The streaming data plane: rows and scores pushed from the worker's step hook to the front
end as they are computed, so a streamed token and its row arrive in the same yield without an
RPC per step (vLLM serves RPCs between engine steps, so one per step would stall generation).

One ZeroMQ PUSH socket in the worker (rank 0), one PULL socket bound by the front end on an
``ipc://`` path in its private (0700) spool directory. One message per step and source: two
frames, a JSON header ``{"source", "dtype", "chunks": [{"key", "lo", "shape", "offset"} or
{"key", "error"}, ...]}`` and the raw bytes of every chunk's ``[slots, rows, width]`` array, C
order, back to back. Nothing is pickled.

Rows of one stream arrive in position order and without gaps: the worker sends a request's
rows only once every position below them is filled (see
:meth:`probehook.worker.recorder.StepRecorder.take_streamed`).

This module holds the message format both ends share; the ends are
``probehook.worker.stream_publisher`` (in the worker) and
``probehook.frontend.stream_receiver`` (in the user's process). No vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from probehook.core.transport import DTYPES
from probehook.errors import CaptureError

SOCKET_NAME = "stream.sock"


class StreamFailed(CaptureError):
    """The worker reported that a stream's capture failed (for instance, over the
    per-request byte limit); the request's other outputs are fine."""


def failure_message(key: str, reason: str) -> str:
    """What the user reads of stream ``key``'s failed capture (``reason``: the worker's),
    streamed or filled."""
    return f"Capture of stream {key} failed: {reason}"


Chunk = tuple[str, int, Any, str | None]
"""``(stream key, first position, rows or None, failure reason or None)``: one stream's part
of a message (what :meth:`~probehook.worker.recorder.StepRecorder.take_streamed` returns)."""


def encode(source: str, chunks: Sequence[Chunk], dtype: torch.dtype) -> list[Any]:
    """The two frames of one step's chunks of ``source`` ("hidden" or "scores"): a JSON header
    listing each stream's key, first position, shape and byte offset (or its failure), and
    the rows of all streams back to back (host numpy, bfloat16 as int16 bits). One message per
    step, not one per stream: each message costs both ends far more than its bytes do."""
    entries: list[dict[str, Any]] = []
    parts: list[np.ndarray] = []
    offset = 0
    for key, lo, rows, error in chunks:
        if error is not None:
            entries.append({"key": key, "error": error})
            continue
        rows = np.ascontiguousarray(rows)
        entries.append({"key": key, "lo": lo, "shape": rows.shape, "offset": offset})
        parts.append(rows.reshape(-1).view(np.uint8))
        offset += rows.nbytes
    payload = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else b""
    header = {"source": source, "dtype": str(dtype), "chunks": entries}
    return [json.dumps(header).encode(), memoryview(payload)]


def decode(frames: list[Any]) -> tuple[str, list[Chunk]]:
    """The source and chunks of one message, each chunk's rows a view of one private buffer;
    refuses anything that is not what :func:`encode` writes (the socket is private, but a bad
    frame must fail loudly, never be guessed at)."""
    if len(frames) != 2:
        raise CaptureError(f"Stream message with {len(frames)} frames; expected 2.")
    header = json.loads(bytes(frames[0]))
    dtype = DTYPES.get(header["dtype"])
    if dtype is None:
        raise CaptureError(f"Stream message with dtype {header['dtype']!r}; known: {list(DTYPES)}")
    payload = bytearray(frames[1])  # a private, writable copy the tensors can share
    whole = torch.frombuffer(payload, dtype=torch.uint8) if payload else None
    chunks: list[Chunk] = []
    for entry in header["chunks"]:
        if "error" in entry:
            chunks.append((entry["key"], 0, None, str(entry["error"])))
            continue
        shape, start = entry["shape"], int(entry["offset"])
        size = int(np.prod(shape)) * dtype.itemsize
        if whole is None or start + size > len(payload):
            raise CaptureError(f"Stream message too short for chunk {entry}.")
        rows = whole[start : start + size].view(dtype).view(shape)
        chunks.append((entry["key"], int(entry["lo"]), rows, None))
    return header["source"], chunks
