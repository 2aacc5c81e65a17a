"""``ActivationStore``: a directory of checksummed manifest + immutable HDF5 shards.

The facade users hold: a :class:`~probehook.store.reader.StoreReader` (every lane, read on
demand) that can also write one lane (``for_writing``: begin a run, add, flush, close) and
hand its rows to training code (torch and Hugging Face datasets, exports).
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from probehook.errors import DuplicateStoreIdError, StoreError, StoreFormatError
from probehook.outputs.top_k import RUN_TOP_K_KEY
from probehook.store.appendable import check_appendable, check_saes, compare_saes
from probehook.store.export import check_export_options, export_writer
from probehook.store.features import check_values
from probehook.store.format import (
    DEFAULT_SHARD_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    ROOT_LANE,
    SHARD_DIR,
    check_lane_name,
    fsync_dir,
    lane_dir,
    shard_key,
    split_shard_key,
    write_json_atomic,
)
from probehook.store.layer_matrix import LayerMatrix
from probehook.store.lock import WriterLock, create_lock
from probehook.store.reader import StoreReader
from probehook.store.repair import repair_for_append
from probehook.store.stored_request import StoredRequest
from probehook.store.training_datasets import LayerDataset, hf_dataset
from probehook.store.writer import PendingRequest, ShardWriter

if TYPE_CHECKING:
    import datasets

# LayerMatrix and StoredRequest were defined here before the split: still importable from here.
__all__ = ["ActivationStore", "DuplicateStoreIdError", "LayerMatrix", "StoredRequest"]

logger = logging.getLogger(__name__)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a writing method holding the store's write lock (re-entrant: ``add`` may begin a
    run)."""

    @functools.wraps(method)
    def locked(self: ActivationStore, *args: Any, **kwargs: Any) -> Any:
        with self._write_lock:
            return method(self, *args, **kwargs)

    return locked


class ActivationStore(StoreReader):
    """A sharded, crash-safe store of captured rows. See docs/store.md for the format."""

    def __init__(
        self,
        root: Path,
        meta: dict[str, Any],
        records: dict[str, dict],
        runs: dict[str, dict],
        dropped: list[str],
        lanes: list[str] | None = None,
    ) -> None:
        super().__init__(root, meta, records, runs, dropped, lanes)
        self._lane: str | None = None  # the lane this store writes (None: read-only)
        self._appends_at_end = True  # the written lane's records belong at the end of order
        self._writer: ShardWriter | None = None
        self.unflushed = 0
        """Requests added since the last :meth:`flush` began (not yet durable)."""
        self._run_id: str | None = None
        self._lock: WriterLock | None = None
        self._adding: set[str] = set()  # store ids added since the last flush
        self._keep_index = True  # committed records join what this object reads
        self._written: set[str] = set()  # without the index: the ids committed (duplicates)
        self._finalizer: weakref.finalize | None = None
        # One adder and one flusher may run in two threads (a server adds on its store thread
        # while its periodic flush runs in another): the bookkeeping below is theirs in turn.
        # A flush holds it only to start and to take what it committed, not while it waits.
        self._write_lock = threading.RLock()

    # -- opening for writing ------------------------------------------------------------------

    @classmethod
    def for_writing(
        cls,
        path: str | Path,
        meta: dict[str, Any],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        compression: str | None = None,
        max_queue_bytes: int = 256 << 20,
        legacy_fingerprint: str | None = None,
        lane: str | None = None,
        keep_index: bool = True,
        sae_values: str = "float32",
    ) -> ActivationStore:
        """Create a store, or open one to append a run of the same model and hidden size.

        ``lane``: None writes the root lane (the store directory's own manifest and shards,
        as a store with one writer always did); a name (1-64 characters of ``A-Za-z0-9_.-``,
        not starting with ".") writes ``STORE/lanes/NAME/``, so several processes can write
        one store at once, one per lane. The store this returns reads every lane.

        Takes the lane's writer lock (released by :meth:`close`) before touching the lane, so
        the crash repair never runs under another live writer of it; raises
        :class:`~probehook.errors.StoreLockedError` if another writer holds it. Writers of
        other lanes are not affected. Creating ``meta.json`` (or checking this run against
        it) happens under a short lock on ``STORE/create.lock``, so writers that start at the
        same moment create the store once.

        ``legacy_fingerprint``: this run's fingerprint v1, checked only against a store written
        before fingerprint v2 (see :meth:`check_appendable`).

        ``keep_index=False``: a writer that runs for long and is not read through (``probehook
        serve``'s): what it commits does not join the records this object reads (it reads the
        store as it was when opened; open the store again to read the rest), only the ids, for
        the duplicate check: about 100 bytes a request instead of the whole record.

        ``sae_values``: ``"float32"`` (as the engine returned them) or ``"float16"`` (half the
        bytes) for stored SAE feature values.
        """
        check_values(sae_values)
        root = Path(path)
        lane = ROOT_LANE if lane is None else check_lane_name(lane)
        full_meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **meta}
        if not (root / META_FILE).exists():
            # No lock file dropped into a foreign directory.
            cls.check_appendable(root, meta, legacy_fingerprint=legacy_fingerprint)
        _make_dirs_durably(root)
        # The root lane's lock is taken first, as always: its holder owns the root's files.
        lock = WriterLock.acquire(root) if lane == ROOT_LANE else None
        try:
            with create_lock(root):
                # Again, under the lock: another writer may have created it since.
                cls.check_appendable(root, meta, legacy_fingerprint=legacy_fingerprint)
                if not (root / META_FILE).exists():
                    write_json_atomic(root / META_FILE, full_meta)
                    (root / SHARD_DIR).mkdir(exist_ok=True)
                    fsync_dir(root)
            directory = lane_dir(root, lane)
            if lane != ROOT_LANE:
                _make_dirs_durably(directory / SHARD_DIR)
                lock = WriterLock.acquire(root, lane)
            else:
                (root / SHARD_DIR).mkdir(exist_ok=True)
            repair_for_append(directory, store_root=root)
            store = cls.open(root)
            store._lane = lane
            store._keep_index = keep_index
            later = set(store.lanes[store.lanes.index(lane) + 1 :])
            store._appends_at_end = not later or not any(
                split_shard_key(r["shard"])[0] in later for r in store._records.values()
            )
            store._writer = ShardWriter(
                directory,
                shard_bytes=shard_bytes,
                compression=compression,
                max_queue_bytes=max_queue_bytes,
                sae_values=sae_values,
            )
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        store._lock = lock
        # Added but never closed: flushed when the store is collected or the interpreter
        # exits normally. The finalizer holds the writer and lock, never the store itself.
        store._finalizer = weakref.finalize(
            store, _close_abandoned_writer, root, store._writer, lock, os.getpid()
        )
        _ABANDONED_AT_EXIT.difference_update([f for f in _ABANDONED_AT_EXIT if not f.alive])
        _ABANDONED_AT_EXIT.add(store._finalizer)
        return store

    @classmethod
    def check_appendable(
        cls,
        path: str | Path,
        meta: dict[str, Any],
        *,
        legacy_fingerprint: str | None = None,
        top_k: dict[str, Any] | None = None,
    ) -> None:
        """Raise unless ``path`` is new, empty, or a store of the same model; ``top_k`` (a
        run's top-k instances, SAEs, as :meth:`begin_run` takes them) are checked and compared
        with the earlier runs' (see :func:`probehook.store.appendable.check_appendable`)."""
        check_appendable(path, meta, legacy_fingerprint=legacy_fingerprint, top_k=top_k)

    # -- writing ------------------------------------------------------------------------------

    @_locked
    def begin_run(self, info: dict[str, Any]) -> str:
        """Record a new run (``info``: what it captures, under ``"capture"``; its top-k
        instances (SAEs, lens instances) under :data:`~probehook.outputs.top_k.RUN_TOP_K_KEY`:
        ``{stored name: {"d_sae", "k", "layer", "fingerprint", ...}}``); return its id.

        Its SAEs are checked (a :class:`~probehook.errors.StoreError` names one the store
        cannot lay out) and compared with the earlier runs': another SAE, d_sae or k under a
        stored name is logged and kept apart (see :mod:`probehook.store.appendable`)."""
        if RUN_TOP_K_KEY in info:
            check_saes(self.root, info[RUN_TOP_K_KEY])
            for note in compare_saes(self.runs, info[RUN_TOP_K_KEY]):
                logger.info("probehook store %s: %s", self.root, note)
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        record = {"kind": "run", "run_id": run_id, "started": time.time(), **info}
        try:
            self._require_writer().append_manifest([record])
        except OSError as e:  # the manifest was cut back: nothing of the run is in it
            full = " The disk is full." if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise StoreError(
                f"Writing the activation store at {self.root} failed while starting a run: "
                f"{e}.{full} Nothing already in the store was lost; free space (or fix the "
                "cause) and try again."
            ) from e
        self.runs[run_id] = record
        self._run_id = run_id
        return run_id

    def _run_saes(self) -> dict[str, tuple[int, int]]:
        """The current run's SAEs and their ``(d_sae, k)`` (what stored features need)."""
        run = self.runs.get(self._run_id or "", {})
        return {
            name: (int(sae["d_sae"]), int(sae["k"]))
            for name, sae in (run.get(RUN_TOP_K_KEY) or {}).items()
        }

    @_locked
    def add(self, request: PendingRequest) -> str:
        """Queue a request for writing; return its store id (``<run id>-<request id>``),
        unique across every run appended to this store. A run is begun if none was."""
        writer = self._require_writer()
        if self._run_id is None:
            self.begin_run({})
        record = request.record
        request_id = record.get("request_id", record["id"])
        store_id = f"{self._run_id}-{request_id}"
        if store_id in self._records or store_id in self._adding or store_id in self._written:
            raise DuplicateStoreIdError(
                f"Store id {store_id!r} (request_id {request_id!r} of run {self._run_id}) is "
                f"already in the activation store at {self.root}; a second record with it "
                "would shadow the first. Give every request of a run its own request_id."
            )
        if request.features:
            sizes = self._run_saes()
            unknown = sorted({f.stored_name for f in request.features} - set(sizes))
            if unknown:
                raise StoreError(
                    f"Request {request_id!r} carries features of SAE(s) {unknown}, which run "
                    f"{self._run_id} did not declare (begin_run(info) names a run's SAEs "
                    f"under {RUN_TOP_K_KEY!r})."
                )
            request.sae_sizes = sizes
        record["request_id"] = request_id
        record["id"] = store_id
        record["run"] = self._run_id
        try:
            writer.submit(request)
        except StoreError:
            self._forget_unflushed()
            raise
        self._adding.add(store_id)
        self.unflushed += 1
        return store_id

    def flush(self) -> None:
        """Make every added request durable; afterwards they are visible to readers.

        On a write error (``StoreError``, e.g. disk full) the requests added since the last
        flush that were not committed are not in the store (the error names them); every
        earlier one is, and later adds work again once the cause is fixed."""
        writer = self._require_writer()
        # A server flushes from a thread while another goes on adding: only what was added
        # before this flush began is known to be in it. Later adds stay counted, so the next
        # flush commits them (they used to be wiped here and waited for close()).
        with self._write_lock:
            began, adding = self.unflushed, set(self._adding)
            barrier = writer.start_flush()
        writer.wait(barrier)
        with self._write_lock:
            self._finish_flush(writer, began, adding)

    def _finish_flush(self, writer: ShardWriter, began: int, adding: set[str]) -> None:
        failed = True
        try:
            writer.raise_if_failed()
            failed = False
        finally:
            # Shards committed before an error are durable: take them either way.
            for record in writer.take_committed():
                if not self._keep_index:
                    self._written.add(record["id"])
                    continue
                if self._lane:  # the manifest names the shard within its lane
                    record = {**record, "shard": shard_key(self._lane, record["shard"])}
                if self._item_ids is not None:
                    if record["id"] in self._records:  # a replaced record: rebuild
                        self._item_ids = None
                    elif record.get("item_id") is not None:
                        self._item_ids.add(record["item_id"])
                if not self._appends_at_end:
                    # Records of a later lane come after this lane's: reorder on next read.
                    self._order_dirty = True
                    self._index = None
                elif self._index is not None and record["id"] not in self._records:
                    self._index.add(record)
                else:
                    self._index = None  # a replaced record: rebuild on next use
                self._records[record["id"]] = record
            if failed:  # what was not committed is gone (the error names it)
                self._forget_unflushed()
            else:
                self.unflushed = max(self.unflushed - began, 0)
                self._adding -= adding

    def _forget_unflushed(self) -> None:
        self.unflushed = 0
        self._adding.clear()

    @_locked
    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            _ABANDONED_AT_EXIT.discard(self._finalizer)
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        finally:
            super().close()  # the shard files open for reading
            # Last: the writer thread has stopped, so nobody can touch this store's .tmp now.
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _require_writer(self) -> ShardWriter:
        if self._writer is None:
            raise StoreFormatError(
                "This store was opened read-only; use ActivationStore."
                "for_writing or LLM(store=...) to write."
            )
        return self._writer

    # -- training data ------------------------------------------------------------------------

    def to_torch_dataset(
        self,
        layer: int,
        phase: str = "decode",
        token: str = "all",
        labels: Sequence[Any] | None = None,
    ) -> torch.utils.data.Dataset:
        """A map-style Dataset of rows (and labels aligned with ``layer(...).index``)."""
        return LayerDataset(self.layer(layer, phase, token), labels)

    def export(self, path: str | Path, format: str, **options: Any) -> Any:
        """Write this store in a format that activation-training tools read directly:
        ``"saelens"`` (SAELens's cached-activations folder: ``layer=``, ``context_size=``;
        returns the folder) or ``"safetensors"`` (shards of ``token_ids`` and
        ``hidden_states [tokens, layers, hidden]`` in the layout of vLLM's hidden-state
        extraction: ``layers=``; returns the shard paths). See docs/exports.md."""
        check_export_options(format, options, self.layers)
        return export_writer(format)(self, path, **options)

    def to_hf_dataset(
        self,
        layer: int,
        phase: str = "decode",
        token: str = "all",
        labels: Sequence[Any] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        block_rows: int = 4096,
    ) -> datasets.Dataset:
        """A Hugging Face ``datasets.Dataset`` of one layer's rows, aligned with
        ``layer(...).index``: columns store_id, position, token_id, activations (float32,
        ``hidden_size`` long; bfloat16/float16 rows are converted) and label if ``labels``.

        Rows stream from the shards ``block_rows`` at a time into an Arrow file under
        ``cache_dir/probehook/`` (default: datasets' cache, ``HF_DATASETS_CACHE``), which the
        Dataset memory-maps, so memory stays bounded. The file is named by a hash of the
        store's requests, the selection and the labels: a later call on the same contents
        reuses it. Needs the ``hf`` extra (``pip install 'probehook[hf]'``).
        """
        return hf_dataset(
            self, layer, phase, token, labels, cache_dir=cache_dir, block_rows=block_rows
        )


def _make_dirs_durably(root: Path) -> None:
    """``mkdir -p root``, fsyncing the parent of each directory it creates: a new directory's
    name lives in its parent, and a power cut could otherwise lose the whole store."""
    missing = []
    path = root
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    root.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)


_ABANDONED_AT_EXIT: set[weakref.finalize] = set()
"""The finalizers of writing stores not closed yet, run by :func:`_close_writers_at_exit`."""


@atexit.register
def _close_writers_at_exit() -> None:
    """Flush and close every writing store still open, before h5py's own exit handler.

    weakref.finalize runs its pending finalizers from an exit handler registered when the
    process made its first finalizer, and torch makes one at import, before h5py is imported.
    Exit handlers run last-registered first, so left to weakref a store never closed would
    write its shards after h5py's handler had unregistered its type converters, while the
    writer thread could still be inside HDF5 (a daemon thread racing the interpreter's exit:
    the SIGSEGV seen once at exit). This handler is registered after h5py's import (the
    writer imports it), so it runs first: the writer thread has written, committed and
    stopped before h5py or the interpreter start to tear down."""
    while _ABANDONED_AT_EXIT:
        _ABANDONED_AT_EXIT.pop()()  # a finalizer runs at most once; detached ones do nothing


def _close_abandoned_writer(root: Path, writer: ShardWriter, lock: WriterLock, pid: int) -> None:
    """The finalizer of a writing store never closed: flush what was added, release the lock.
    Runs at normal interpreter exit or when the store is collected."""
    if os.getpid() != pid:
        return  # a forked child: the writer thread and the lock are the parent's
    if threading.current_thread() is writer._thread:
        # Collected on the writer thread itself, which cannot wait for its own queue: close
        # from another thread (not a daemon, so the interpreter waits for it at exit).
        threading.Thread(
            target=_close_abandoned_writer, args=(root, writer, lock, pid), daemon=False
        ).start()
        return
    try:
        writer.close()
    except Exception as e:
        logger.error("probehook store %s: flushing a store never closed failed: %s", root, e)
    finally:
        lock.release()
