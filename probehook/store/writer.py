"""Background shard writer: generation hands rows over and moves on; the disk catches up.

The queue is bounded in bytes. When it is full, ``submit`` blocks (backpressure) instead of
growing memory. Any write error is kept and re-raised from the next ``submit`` or ``flush``, so
``generate()`` fails loudly rather than leaving a silently short store.

An error is reported once. Reporting it first drains the queue (requests queued before it are
dropped, never half-written), so the writer is clean again afterwards: when the disk has space
again, the next request starts a new shard and the store is appendable without reopening.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from probehook.errors import StoreError
from probehook.outputs.top_k import LABELS_KEY, SEGMENT_NAME_KEY, SEGMENT_SOURCE_KEY
from probehook.store.appender import DatasetAppender
from probehook.store.features import FeatureBlock, feature_dataset, layout_of
from probehook.store.features import to_storage as features_to_storage
from probehook.store.format import (
    MANIFEST_FILE,
    SHARD_DIR,
    dataset_name,
    encode_line,
    fsync_dir,
)

_STOP = object()


@dataclass
class _Barrier:
    """Queued after the requests it waits for; ``commit``: also commit the open shard."""

    commit: bool
    done: threading.Event = field(default_factory=threading.Event)


fault_hook: Callable[[str], None] | None = None
"""Test-only: called with the name of each shard commit stage as it is reached ("shard_written",
"shard_fsynced", "shard_renamed", "dir_fsynced", "manifest_torn", "committed"), so that a test
can kill the process there (tests/test_store_durability.py). None in normal use."""


def _stage(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


@dataclass
class RowBlock:
    """Rows of one (phase, completion, layer) of a request: ``[count, hidden]``."""

    phase: str
    completion: int | None
    layer: int
    first_position: int
    rows: torch.Tensor


@dataclass
class PendingRequest:
    record: dict[str, Any]
    blocks: list[RowBlock] = field(default_factory=list)
    features: list[FeatureBlock] = field(default_factory=list)
    """SAE features (store/features.py), beside the rows."""
    sae_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each SAE's ``(d_sae, k)`` in the run: the stored index type and width."""

    @property
    def nbytes(self) -> int:
        rows = sum(b.rows.numel() * b.rows.element_size() for b in self.blocks)
        return rows + sum(f.nbytes for f in self.features)


def to_storage(rows: torch.Tensor) -> np.ndarray:
    """HDF5 has no bfloat16: such rows are stored as their raw uint16 bits."""
    rows = rows.detach().to("cpu").contiguous()
    if rows.dtype == torch.bfloat16:
        return rows.view(torch.int16).numpy().view(np.uint16)
    return rows.numpy()


class ShardWriter:
    """Writes submitted requests into HDF5 shards on a background thread."""

    def __init__(
        self,
        root: Path,
        *,
        shard_bytes: int,
        compression: str | None,
        max_queue_bytes: int,
        sae_values: str = "float32",
    ) -> None:
        self.root = root
        self.sae_values = sae_values
        self.shard_bytes = shard_bytes
        self.compression = compression
        self.max_queue_bytes = max_queue_bytes
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._lost: list[str] = []  # ids of requests dropped since the last reported error
        self._manifest_lock = threading.Lock()
        # The manifest's directory entry is fsynced when the first append creates the file.
        self._manifest_exists = (root / MANIFEST_FILE).exists()
        self._torn_tail_left = False
        self._file: h5py.File | None = None
        self._tmp_path: Path | None = None
        self._shard_requests: list[dict[str, Any]] = []
        self._shard_rows: dict[str, int] = {}
        self._shard_bytes_written = 0
        self._datasets: dict[str, DatasetAppender] = {}
        self._renamed: Path | None = None  # a renamed shard whose manifest lines are not in
        self._committed: list[dict[str, Any]] = []
        self._committed_lock = threading.Lock()
        self._report_lock = threading.Lock()  # an error is reported by one caller, once
        self._thread = threading.Thread(target=self._run, name="probehook-store", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------

    def submit(self, request: PendingRequest) -> None:
        self.raise_if_failed()
        size = request.nbytes
        with self._cond:
            while (
                self._error is None
                and self._queued_bytes > 0
                and self._queued_bytes + size > self.max_queue_bytes
            ):
                self._cond.wait(timeout=1.0)
            if self._error is None:
                self._queued_bytes += size
        self.raise_if_failed()  # outside the condition: reporting drains the queue
        self._queue.put(request)

    def flush(self) -> None:
        """Block until everything submitted is in a committed shard and the manifest."""
        self.wait(self.start_flush())
        self.raise_if_failed()

    def start_flush(self) -> _Barrier:
        """Queue a commit of everything submitted so far; :meth:`wait` for it (submits may go
        on meanwhile: they are not in it)."""
        barrier = _Barrier(commit=True)
        self._queue.put(barrier)
        return barrier

    def wait(self, barrier: _Barrier) -> None:
        """Wait until the writer thread has handled everything queued before ``barrier``."""
        while not barrier.done.wait(timeout=1.0):
            if not self._thread.is_alive():
                break

    def _barrier(self, *, commit: bool) -> None:
        barrier = _Barrier(commit)
        self._queue.put(barrier)
        self.wait(barrier)

    def append_manifest(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` and fsync. On failure (disk full) the manifest is cut back to
        its old length, so no partial line is left for the next append to glue onto (which
        would turn that next, acknowledged record into a damaged line)."""
        data = "".join(encode_line(r) for r in records).encode()
        with self._manifest_lock:
            # Unbuffered: after a failed write no buffered bytes may land later.
            fd = os.open(self.root / MANIFEST_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if self._torn_tail_left:  # an earlier cut back failed: cut now, or append nothing
                    size = _end_of_last_line(self.root / MANIFEST_FILE)
                    os.ftruncate(fd, size)
                    self._torn_tail_left = False
                try:
                    if fault_hook is not None:  # tests: a crash with half the lines on disk
                        _write_all(fd, data[: len(data) // 2])
                        _stage("manifest_torn")
                        data = data[len(data) // 2 :]
                    _write_all(fd, data)
                    os.fsync(fd)
                    self._renamed = None  # its lines are in: the shard is no longer garbage
                except BaseException:
                    try:
                        os.ftruncate(fd, size)
                        os.fsync(fd)
                    except OSError:
                        self._torn_tail_left = True
                        self._renamed = None  # its lines may be in: keep the shard
                    raise
                if not self._manifest_exists:
                    # A new file's name lives in the directory: without this fsync a power
                    # cut could lose the whole manifest, with every record in it.
                    fsync_dir(self.root)
                    self._manifest_exists = True
            finally:
                os.close(fd)

    def take_committed(self) -> list[dict[str, Any]]:
        """Request records committed since the last call (call after ``flush``)."""
        with self._committed_lock:  # the writer thread commits full shards at any time
            committed, self._committed = self._committed, []
        return committed

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self.flush()
            finally:
                # Stopped even after a write error: the store's writer lock is released next.
                self._queue.put(_STOP)
                self._thread.join()

    def raise_if_failed(self) -> None:
        """Report a write error, once: of callers in several threads, one raises it."""
        if self._error is None:
            return
        with self._report_lock:
            if self._error is None:
                return  # another thread reported it while this one waited
            # Drop whatever was queued before this report, so the writer is clean afterwards.
            self._barrier(commit=False)
            error, lost = self._error, self._lost
            self._error, self._lost = None, []
        self._report(error, lost)

    def _report(self, error: BaseException, lost: list[str]) -> None:
        shown = ", ".join(lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        report = StoreError(
            f"Writing the activation store at {self.root} failed: {error}. "
            + ("The disk is full. " if full else "")
            + "Requests acknowledged before this error (returned by generate(), or added "
            "before a flush() that returned) are durable; "
            + (
                f"{len(lost)} request(s) added since are not in the store: {shown}. "
                if lost
                else "nothing else was lost. "
            )
            + "The store stays appendable: free space (or fix the cause) and add them again."
        )
        report.lost = tuple(lost)
        raise report from error

    # -- writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                if isinstance(item, _Barrier):
                    if item.commit and self._error is None:
                        self._commit_shard()
                else:
                    self._write(item)
            except BaseException as e:  # kept and re-raised to the caller
                self._error = e
                if not isinstance(item, _Barrier):
                    self._lost.append(item.record["id"])
                self._abandon_shard()
            finally:
                if isinstance(item, _Barrier):
                    item.done.set()
                else:
                    with self._cond:
                        self._queued_bytes -= item.nbytes
                        self._cond.notify_all()

    def _write(self, request: PendingRequest) -> None:
        if self._error is not None:  # queued before an error was reported: dropped
            self._lost.append(request.record["id"])
            return
        if self._file is None:
            name = f"shard-{uuid.uuid4().hex[:12]}.h5"
            self._tmp_path = self.root / SHARD_DIR / (name + ".tmp")
            self._file = h5py.File(self._tmp_path, "w")
        segments = []
        for block in request.blocks:
            data = to_storage(block.rows)
            name = dataset_name(block.phase, block.layer)
            start = self._append(name, data)
            segments.append(
                {
                    "phase": block.phase,
                    "completion": block.completion,
                    "layer": block.layer,
                    "first_position": block.first_position,
                    "start": start,
                    "count": len(data),
                }
            )
            self._shard_bytes_written += data.nbytes
        record = {**request.record, "segments": segments}
        if request.features:
            record["sae_segments"] = self._write_features(request)
        self._shard_requests.append(record)
        if self._shard_bytes_written >= self.shard_bytes:
            self._commit_shard()

    def _write_features(self, request: PendingRequest) -> list[dict[str, Any]]:
        segments = []
        for block in request.features:
            name = block.stored_name
            d_sae, k = request.sae_sizes[name]
            arrays = features_to_storage(block.features, d_sae, k, self.sae_values)
            # Runs of another d_sae, k or value type under this name get datasets of their own.
            layout = layout_of(arrays)
            starts = {
                self._append(feature_dataset(block.phase, name, part, layout), data)
                for part, data in arrays.items()
            }
            assert len(starts) == 1, f"SAE datasets of {name} out of step: {starts}"
            segments.append(
                {
                    "phase": block.phase,
                    "completion": block.completion,
                    SEGMENT_SOURCE_KEY: block.source,
                    SEGMENT_NAME_KEY: name,
                    "layout": layout,
                    "k": block.features.k,  # type: ignore[attr-defined]
                    "first_position": block.first_position,
                    "start": starts.pop(),
                    "count": len(arrays["l0"]),
                }
            )
            labels = getattr(block.features, "labels", None)
            if labels:  # what a request's chosen axis entries are (attention heads, spans)
                segments[-1][LABELS_KEY] = {axis: list(v) for axis, v in labels.items()}
            self._shard_bytes_written += sum(a.nbytes for a in arrays.values())
        return segments

    def _append(self, name: str, data: np.ndarray) -> int:
        """Append rows to dataset ``name`` of the open shard; return their start row."""
        assert self._file is not None
        if name not in self._datasets:
            self._datasets[name] = DatasetAppender(self._file, name, self.compression)
        return self._datasets[name].append(data)

    def _abandon_shard(self) -> None:
        """After a write error: close the open shard once and delete it. It was never
        committed (no manifest line names it), so it is provably garbage; and HDF5 must not
        try to write to a file that failed again later (at exit it may crash or hang). A shard
        already renamed whose manifest append failed (and was cut back) is deleted too: no
        manifest line names it either, and on a full disk its space is what is needed."""
        file, tmp, final = self._file, self._tmp_path, self._renamed
        self._file, self._tmp_path, self._renamed = None, None, None
        self._lost.extend(r["id"] for r in self._shard_requests)
        self._datasets, self._shard_requests, self._shard_bytes_written = {}, [], 0
        if file is not None:
            with contextlib.suppress(Exception):
                file.close()
        for path in (tmp, final):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()

    def _commit_shard(self) -> None:
        if self._file is None:
            return
        assert self._tmp_path is not None
        for dataset in self._datasets.values():
            dataset.close()
        self._datasets = {}
        self._file.close()
        self._file = None
        _stage("shard_written")
        with open(self._tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        _stage("shard_fsynced")
        final = self._tmp_path.with_suffix("")  # drop ".tmp"
        os.replace(self._tmp_path, final)
        self._tmp_path, self._renamed = None, final
        _stage("shard_renamed")
        fsync_dir(final.parent)
        _stage("dir_fsynced")
        shard = {
            "kind": "shard",
            "name": final.name,
            "bytes": final.stat().st_size,
            "requests": len(self._shard_requests),
        }
        requests = [{"kind": "request", "shard": final.name, **r} for r in self._shard_requests]
        self.append_manifest([shard, *requests])
        _stage("committed")
        with self._committed_lock:
            self._committed.extend(requests)
        self._shard_requests = []
        self._shard_bytes_written = 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _end_of_last_line(path: Path) -> int:
    """The length of ``path`` up to and including its last newline."""
    data = path.read_bytes()
    return data.rfind(b"\n") + 1
