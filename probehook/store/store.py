"""``ActivationStore``: a directory of checksummed manifest + immutable HDF5 shards."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import operator
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch

from probehook.errors import (
    DuplicateStoreIdError,
    MissingExtraError,
    StoreCorruptError,
    StoreError,
    StoreFormatError,
)
from probehook.store.format import (
    CREATE_LOCK,
    DEFAULT_SHARD_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    LANES_DIR,
    MANIFEST_FILE,
    META_FILE,
    PHASES,
    ROOT_LANE,
    SHARD_DIR,
    WRITER_LOCK,
    check_lane_name,
    dataset_name,
    fsync_dir,
    lane_dir,
    list_lanes,
    shard_key,
    shard_path,
    split_shard_key,
    write_json_atomic,
)
from probehook.store.lock import WriterLock, create_lock
from probehook.store.manifest import (
    cut_torn_tail,
    remove_replaced_shards,
    run_layers,
    scan_manifest,
)
from probehook.store.segments import SegmentIndex
from probehook.store.writer import PendingRequest, ShardWriter

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)
TOKENS = ("all", "last")
MAX_OPEN_FILES = 128
"""The most shard files one reader keeps open; fewer when the process has fewer descriptors
left (see :func:`open_file_budget`)."""

_INHERITED_FILES: list[Any] = []
"""In a forked child: shard files opened by the parent, kept referenced and never closed here
(see ``ActivationStore._after_fork``)."""


def _soft_nofile() -> int | None:
    """This process's soft RLIMIT_NOFILE (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _descriptors_in_use() -> int | None:
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(fd_dir)) - 1  # less the listing's own descriptor
    return None


def open_file_budget(soft_limit: int | None, in_use: int | None, held: int = 0) -> int:
    """How many shard files a reader may keep open: half of what the process has left under
    its soft open-file limit, counting the ``held`` files the reader already has as its own
    (the other half stays for everything else: engine sockets, the user's files). At most
    :data:`MAX_OPEN_FILES`, at least 1."""
    if soft_limit is None or in_use is None:
        return MAX_OPEN_FILES
    free = soft_limit - (in_use - held)
    return max(1, min(MAX_OPEN_FILES, free // 2))


def _is_emfile(error: OSError) -> bool:
    # h5py sets errno from HDF5's message ("errno = 24"); the text is a fallback.
    return error.errno == errno.EMFILE or "Too many open files" in str(error)


@dataclass
class StoredRequest:
    """One request as stored; tensors load lazily from its shard."""

    store: ActivationStore = field(repr=False)
    record: dict[str, Any] = field(repr=False)

    @property
    def store_id(self) -> str:
        """This request's key in the store, unique across runs (``store[store_id]``)."""
        return self.record["id"]

    @property
    def request_id(self) -> str:
        """vLLM's ``request_id`` of the output it was stored from."""
        return self.record.get("request_id", self.record["id"])

    @property
    def run(self) -> str | None:
        """The run it was captured in (see ``ActivationStore.runs``)."""
        return self.record.get("run")

    @property
    def item_id(self) -> str | None:
        """The caller's id of the work item this request came from (the record's
        ``"item_id"``, set by a collector through ``extra``); None when absent."""
        return self.record.get("item_id")

    @property
    def lane(self) -> str:
        """The lane it is stored in (``""``: the root lane; see ``ActivationStore.lanes``)."""
        return split_shard_key(self.record["shard"])[0]

    @property
    def prompt(self) -> str | None:
        return self.record.get("prompt")

    @property
    def text(self) -> str:
        return self.record["completions"][0]["text"] if self.record["completions"] else ""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.record["prompt_token_ids"]

    @property
    def output_token_ids(self) -> list[int]:
        return self.record["completions"][0]["token_ids"] if self.record["completions"] else []

    @property
    def finish_reason(self) -> str | None:
        done = self.record["completions"]
        return done[0]["finish_reason"] if done else None

    @property
    def steering(self) -> dict[str, Any] | None:
        """The first completion's steering (vectors and scales, phase, gate, ``start``: the
        first steered position), None if it was not steered."""
        done = self.record["completions"]
        return done[0].get("steering") if done else None

    @property
    def prefill_hidden_states(self) -> dict[int, torch.Tensor]:
        return self._rows("prefill", None)

    @property
    def hidden_states(self) -> dict[int, torch.Tensor]:
        return self._rows("decode", 0)

    @property
    def probe_scores(self) -> dict[str, torch.Tensor]:
        """Runtime probe scores of the first completion (one per generated token)."""
        return self.completion_probe_scores(0)

    @property
    def prefill_probe_scores(self) -> dict[str, torch.Tensor]:
        """Runtime probe scores of the prompt tokens (with ``include_prefill``)."""
        return _score_tensors(self.record.get("prefill_probe_scores"))

    def completion_probe_scores(self, index: int) -> dict[str, torch.Tensor]:
        done = self.record["completions"]
        return _score_tensors(done[index].get("probe_scores") if index < len(done) else None)

    def completion_hidden_states(self, index: int) -> dict[int, torch.Tensor]:
        return self._rows("decode", index)

    def _rows(self, phase: str, completion: int | None) -> dict[int, torch.Tensor]:
        out = {}
        for seg in self.record["segments"]:
            if seg["phase"] == phase and seg["completion"] == completion:
                out[seg["layer"]] = self.store._read(
                    self.record["shard"],
                    phase,
                    seg["layer"],
                    seg["start"],
                    seg["start"] + seg["count"],
                )
        return out


def _score_tensors(scores: dict[str, list] | None) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(v, dtype=torch.float32) for name, v in (scores or {}).items()}


class LayerMatrix:
    """Rows of one layer and phase across the store, read from disk on demand.

    ``index`` is a structured array (store_id, position, token_id) aligned with the rows;
    a decode row's token_id is the token it produced. Slicing reads only the rows asked for,
    straight into the result; ``numpy()`` loads everything explicitly.
    """

    def __init__(self, store: ActivationStore, layer: int, phase: str, token: str) -> None:
        self.store, self.layer, self.phase, self.token = store, layer, phase, token
        self.missing_runs: list[str] = []
        """Runs with requests in the store that did not capture this layer."""
        index = store._segment_index()
        self._runs = index.select(layer, phase, last_only=token == "last")
        self._refs = index.refs

    @functools.cached_property
    def index(self) -> np.ndarray:
        n = len(self)
        index = np.zeros(
            n, dtype=[("store_id", object), ("position", np.int64), ("token_id", np.int64)]
        )
        row = 0
        for i in self._runs.segments:
            rec, seg = self._refs[i]
            count = 1 if self.token == "last" else seg["count"]
            first = seg["first_position"] + seg["count"] - count
            positions = np.arange(first, first + count)
            seq = list(rec["prompt_token_ids"])
            if seg["completion"] is not None:
                seq += rec["completions"][seg["completion"]]["token_ids"]
            seq_arr = np.asarray(seq, dtype=np.int64)
            produced = positions + (1 if self.phase == "decode" else 0)
            tokens = np.where(
                produced < len(seq_arr), seq_arr[np.minimum(produced, len(seq_arr) - 1)], -1
            )
            index["store_id"][row : row + count] = rec["id"]
            index["position"][row : row + count] = positions
            index["token_id"][row : row + count] = tokens
            row += count
        return index

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self._runs.offsets[-1]), self.store.hidden_size)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, item: slice | int) -> torch.Tensor:
        if isinstance(item, slice):
            start, stop, step = item.indices(len(self))
            if step != 1:
                raise ValueError(
                    "LayerMatrix supports contiguous slices only; use take(indices) or numpy()."
                )
            return self.store._to_tensor(self._read(start, max(start, stop)))
        row = self._row_number(item)
        return self.store._to_tensor(self._read(row, row + 1))[0]

    def take(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Rows ``indices`` (any order, repeats allowed) as one ``[len(indices), hidden]``
        tensor. Rows that are contiguous in the matrix are read together, one HDF5 read per
        run of consecutive rows (and shard), so a sequential batch costs one or two reads."""
        rows = np.fromiter((self._row_number(i) for i in indices), dtype=np.int64)
        out = np.empty((len(rows), self.store.hidden_size), dtype=self.store.storage_dtype)
        if len(rows):
            order = np.argsort(rows, kind="stable")
            ordered = rows[order]
            # A new block wherever the next wanted row is neither this one nor the next.
            breaks = np.flatnonzero(np.diff(ordered) > 1) + 1
            for block in np.split(np.arange(len(ordered)), breaks):
                first, last = int(ordered[block[0]]), int(ordered[block[-1]])
                out[order[block]] = self._read(first, last + 1)[ordered[block] - first]
        return self.store._to_tensor(out)

    def _row_number(self, item: Any) -> int:
        """``item`` as a row number in range; any integer type (numpy, torch) is accepted."""
        try:
            row = operator.index(item)
        except TypeError:
            raise TypeError(
                f"LayerMatrix rows are indexed by an integer or a contiguous slice, not "
                f"{item!r} ({type(item).__name__}); for a list of rows use take(indices)."
            ) from None
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} rows")
        return row % len(self)

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (in range) in storage dtype, each run read straight into place."""
        out = np.empty((stop - start, self.store.hidden_size), dtype=self.store.storage_dtype)
        if stop <= start:
            return out
        runs = self._runs
        first = int(np.searchsorted(runs.offsets, start, side="right")) - 1
        for i in range(max(first, 0), len(runs.shards)):
            run_start = int(runs.offsets[i])
            if run_start >= stop:
                break
            a, b = (int(x) for x in runs.bounds[i])
            lo = a + max(0, start - run_start)
            hi = min(b, a + stop - run_start)
            dest = run_start + (lo - a) - start
            self.store._dataset(runs.shards[i], self.phase, self.layer).read_direct(
                out, np.s_[lo:hi], np.s_[dest : dest + hi - lo]
            )
        return out

    def iter_blocks(self, rows: int = 65536) -> Iterator[torch.Tensor]:
        """Stream the matrix in blocks of at most ``rows`` rows."""
        for begin in range(0, len(self), rows):
            yield self[begin : min(begin + rows, len(self))]

    def numpy(self) -> np.ndarray:
        rows = self[:]
        return rows.float().numpy() if rows.dtype == torch.bfloat16 else rows.numpy()


class ActivationStore:
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
        self.root = root
        self.meta = meta
        self.lanes = list(lanes) if lanes is not None else [ROOT_LANE]
        """The store's lanes in store order: ``""`` (the root lane: the store directory's own
        manifest and shards) first, then the lanes under ``lanes/`` by name."""
        self._records = records
        self._lane: str | None = None  # the lane this store writes (None: read-only)
        self._appends_at_end = True  # the written lane's records belong at the end of order
        self._order_dirty = False
        self._item_ids: set[str] | None = None  # built by item_ids() on first use
        self.runs = runs
        """Runs by run id: what each appended run captured (``capture``) and when."""
        self.dropped = dropped
        self._index: SegmentIndex | None = None
        self._writer: ShardWriter | None = None
        self.unflushed = 0
        """Requests added since the last :meth:`flush` began (not yet durable)."""
        self._run_id: str | None = None
        self._lock: WriterLock | None = None
        self._adding: set[str] = set()  # store ids added since the last flush
        self._finalizer: weakref.finalize | None = None
        # Shard files open for reading, least recently used first; a store of thousands of
        # shards must not hold thousands of file handles, and may hold only as many as the
        # process can spare (see max_open_files).
        self._files: OrderedDict[str, h5py.File] = OrderedDict()
        self._pid = os.getpid()  # a forked child must not use the parent's HDF5 handles
        self._open_files_bound = MAX_OPEN_FILES
        self._budget_for: int | None = -1  # the soft limit the budget was computed for
        self._budget = MAX_OPEN_FILES

    @property
    def max_open_files(self) -> int:
        """The most shard files this reader keeps open: the bound you set (128 by default),
        lowered to half of the descriptors the process has left under its soft
        ``RLIMIT_NOFILE`` (recomputed when the limit changes). If opening a shard still runs
        out of descriptors (``EMFILE``), cached files are closed and the open retried."""
        soft = _soft_nofile()
        if soft != self._budget_for:
            self._budget_for = soft
            self._budget = open_file_budget(soft, _descriptors_in_use(), len(self._files))
        return max(1, min(self._open_files_bound, self._budget))

    @max_open_files.setter
    def max_open_files(self, bound: int) -> None:
        bound = operator.index(bound)
        if bound < 1:
            raise ValueError(f"max_open_files={bound}; it must be at least 1.")
        self._open_files_bound = bound

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path) -> ActivationStore:
        """Open an existing store for reading. Interrupted shards are left out with a warning."""
        root = Path(path)
        meta = cls._read_meta(root)
        records, runs, dropped, lanes = cls._read_manifest(root)
        store = cls(root, meta, records, runs, dropped, lanes)
        store._segment_index().arrays()  # with the manifest parse, not in the first layer()
        return store

    @staticmethod
    def _read_meta(root: Path) -> dict[str, Any]:
        """The store's ``meta.json``, checked to be this format and version."""
        meta_path = root / META_FILE
        if not meta_path.is_file():
            raise StoreFormatError(
                f"{root} is not a probehook activation store (no {META_FILE}). Create one by "
                "passing store=PATH to probehook.LLM or `probehook capture --store PATH`."
            )
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError as e:
            raise StoreFormatError(f"{meta_path} is not valid JSON: {e}") from e
        if meta.get("format") != FORMAT_NAME:
            raise StoreFormatError(f"{root} is not a probehook activation store ({meta_path}).")
        if meta.get("format_version") != FORMAT_VERSION:
            raise StoreFormatError(
                f"{root} was written in store format version {meta.get('format_version')}, but "
                f"this probehook reads version {FORMAT_VERSION}. Use a probehook release that "
                "writes that version, or re-capture."
            )
        return meta

    @staticmethod
    def _read_manifest(
        root: Path,
    ) -> tuple[dict[str, dict], dict[str, dict], list[str], list[str]]:
        """Requests (by store id) and runs (by run id) of every lane's manifest, what was left
        out, and the lanes, in store order (the root lane, then the other lanes by name).

        A damaged line is skipped with a warning and the records after it are kept; a torn
        tail (an interrupted append, never acknowledged) is left out quietly, since a reader
        may see one while a writer is appending. Each lane is read on its own: a record
        never refers to a shard of another lane. A record's ``shard`` is its shard key
        (``lanes/LANE/NAME`` outside the root lane). Two records with one store id: the later
        one in store order is kept, the other is named in ``dropped``.
        """
        dropped: list[str] = []
        records: dict[str, dict] = {}
        runs: dict[str, dict] = {}
        lanes, odd = list_lanes(root)
        for entry in odd:
            dropped.append(
                f"{LANES_DIR}/{entry} (not a lane: a lane is a directory named by "
                "the lane name rule)"
            )
        for lane in lanes:
            directory = lane_dir(root, lane)
            prefix = "" if lane == ROOT_LANE else f"{LANES_DIR}/{lane}/"
            scan = scan_manifest(directory)
            shards: set[str] = set()
            for record in scan.records:
                kind = record.get("kind")
                if kind == "shard":
                    if (directory / SHARD_DIR / record["name"]).is_file():
                        shards.add(record["name"])
                    else:
                        dropped.append(f"{prefix}{record['name']} (listed but missing)")
                elif kind == "request":
                    if record["shard"] in shards:
                        if prefix:
                            record = {**record, "shard": prefix + record["shard"]}
                        if record["id"] in records:  # written before ids were checked at add()
                            earlier = records.pop(record["id"])
                            dropped.append(
                                f"request {record['id']} in {earlier['shard']} (shadowed by a "
                                f"later record with the same id in {record['shard']})"
                            )
                            logger.warning("probehook store %s: %s", root, dropped[-1])
                        records[record["id"]] = record
                elif kind == "run":
                    runs[record["run_id"]] = record
            if scan.bad_lines:
                dropped.append(
                    f"{prefix}{MANIFEST_FILE} line(s) {scan.bad_lines} (corrupt; run `probehook "
                    f"store fsck {root} --repair`)"
                )
                logger.warning("probehook store %s: skipped %s", root, dropped[-1])
            if scan.torn_tail:
                dropped.append(
                    f"{prefix}{MANIFEST_FILE} tail ({scan.torn_tail} bytes, torn or being written)"
                )
            shard_dir = directory / SHARD_DIR
            for tmp in sorted(shard_dir.glob("*.tmp")) if shard_dir.exists() else []:
                with contextlib.suppress(FileNotFoundError):  # committed or removed meanwhile
                    size = tmp.stat().st_size
                    dropped.append(f"{prefix}{tmp.name} ({size} bytes, not committed)")
        if dropped:
            logger.info("probehook store %s: left out %s", root, "; ".join(dropped))
        return records, runs, dropped, lanes

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
        """
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
            cls._repair_for_append(directory, store_root=root)
            store = cls.open(root)
            store._lane = lane
            later = set(store.lanes[store.lanes.index(lane) + 1 :])
            store._appends_at_end = not later or not any(
                split_shard_key(r["shard"])[0] in later for r in store._records.values()
            )
            store._writer = ShardWriter(
                directory,
                shard_bytes=shard_bytes,
                compression=compression,
                max_queue_bytes=max_queue_bytes,
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
        return store

    @classmethod
    def check_appendable(
        cls, path: str | Path, meta: dict[str, Any], *, legacy_fingerprint: str | None = None
    ) -> None:
        """Raise unless ``path`` is new, empty, or a store of the same model (the keys of
        ``meta`` that it has: model_fingerprint, hidden_size, dtype).

        Fingerprints are compared only within one ``fingerprint_version`` (a missing one is
        version 1, the legacy whole-config hash). A legacy store accepts a run whose
        ``legacy_fingerprint`` matches it; anything else is refused with what to do.
        """
        root = Path(path)
        if (root / META_FILE).exists():
            existing = cls._read_meta(root)
            if "model_fingerprint" in meta:
                cls._check_fingerprint(root, existing, meta, legacy_fingerprint)
            for key in ("hidden_size", "dtype"):
                if key in meta and existing.get(key) != meta[key]:
                    raise StoreFormatError(
                        f"Cannot append to {root}: its {key} is {existing.get(key)!r} but this "
                        f"run's is {meta[key]!r}. Use a new store path for another model."
                    )
        elif root.exists() and (
            not root.is_dir()
            # Lock files, and meta.json being written by a writer creating the store now.
            or any(
                p.name not in (WRITER_LOCK, CREATE_LOCK, META_FILE + ".tmp") for p in root.iterdir()
            )
        ):
            raise StoreFormatError(
                f"{root} exists, is not empty and is not an activation store; pick a new path."
            )

    @staticmethod
    def _check_fingerprint(
        root: Path, existing: dict[str, Any], meta: dict[str, Any], legacy: str | None
    ) -> None:
        stored, ours = existing.get("model_fingerprint"), meta["model_fingerprint"]
        stored_version = existing.get("fingerprint_version", 1)
        our_version = meta.get("fingerprint_version", 1)
        stored_covers = existing.get("fingerprint_covers", "the whole HF config (v1)")
        our_covers = meta.get("fingerprint_covers", "the whole HF config (v1)")
        if stored_version == our_version:
            if stored == ours:
                return
            raise StoreFormatError(
                f"Cannot append to {root}: its model_fingerprint is {stored!r} (covers: "
                f"{stored_covers}) but this run's is {ours!r} (covers: {our_covers}), so this "
                "is another model (or other weights). Use a new store path for another model."
            )
        if stored_version == 1 and legacy is not None and stored == legacy:
            logger.info(
                "probehook store %s predates fingerprint v2; appending because this run's "
                "legacy fingerprint %s matches it",
                root,
                legacy,
            )
            return
        if stored_version == 1:
            legacy_note = (
                f"this run's config hashes to {legacy!r} that way"
                if legacy is not None
                else "this run gave no legacy fingerprint to compare"
            )
            raise StoreFormatError(
                f"Cannot append to {root}: it predates fingerprint v2. Its model_fingerprint "
                f"{stored!r} is a hash of the whole HF config, transformers version included, "
                f"and {legacy_note}, so probehook cannot tell whether this is the same model. "
                f"This run's v2 model_fingerprint is {ours!r} (covers: "
                f"{our_covers}). Use a new store path; or, if you know it is the same model "
                "(e.g. only transformers was upgraded), adopt the new fingerprint by setting "
                f'"model_fingerprint": "{ours}", "fingerprint_version": {our_version} and '
                f'"fingerprint_covers" in {root / META_FILE}.'
            )
        raise StoreFormatError(
            f"Cannot append to {root}: its model_fingerprint {stored!r} is fingerprint version "
            f"{stored_version} (covers: {stored_covers}) but this run's {ours!r} is version "
            f"{our_version} (covers: {our_covers}); this probehook cannot compare them. Use a "
            "new store path, or a probehook release that writes version "
            f"{stored_version}."
        )

    @classmethod
    def _repair_for_append(cls, root: Path, store_root: Path | None = None) -> None:
        """Before appending after a crash (holding the lane's writer lock): cut a torn
        manifest tail (never acknowledged) and delete interrupted ``.tmp`` shards and the old
        shards of a finished compaction, in the lane directory ``root`` only (of the store
        ``store_root``, default ``root``). A damaged line before good ones is refused, never
        cut."""
        store_root = root if store_root is None else store_root
        scan = scan_manifest(root)
        if scan.bad_lines:
            raise StoreCorruptError(
                f"{root / MANIFEST_FILE} has damaged line(s) {scan.bad_lines} before good ones; "
                "appending is refused so that no acknowledged record is lost. Run `probehook "
                f"store fsck {store_root}` to see the damage and `probehook store fsck "
                f"{store_root} --repair` to keep every verifiable record, then append again."
            )
        if scan.torn_tail:
            logger.warning(
                "probehook store %s: cutting %d bytes of torn manifest tail",
                root,
                scan.torn_tail,
            )
            cut_torn_tail(root, scan)
        for tmp in (root / SHARD_DIR).glob("*.tmp") if (root / SHARD_DIR).is_dir() else []:
            logger.warning("probehook store %s: removing interrupted shard %s", root, tmp.name)
            tmp.unlink()
        remove_replaced_shards(root, scan.records)

    # -- writing ------------------------------------------------------------------------------

    def begin_run(self, info: dict[str, Any]) -> str:
        """Record a new run (``info``: what it captures, under ``"capture"``); return its id."""
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

    def add(self, request: PendingRequest) -> str:
        """Queue a request for writing; return its store id (``<run id>-<request id>``),
        unique across every run appended to this store. A run is begun if none was."""
        writer = self._require_writer()
        if self._run_id is None:
            self.begin_run({})
        record = request.record
        request_id = record.get("request_id", record["id"])
        store_id = f"{self._run_id}-{request_id}"
        if store_id in self._records or store_id in self._adding:
            raise DuplicateStoreIdError(
                f"Store id {store_id!r} (request_id {request_id!r} of run {self._run_id}) is "
                f"already in the activation store at {self.root}; a second record with it "
                "would shadow the first. Give every request of a run its own request_id."
            )
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
        # A server flushes from a thread while its event loop goes on adding: only what was
        # added before this flush began is known to be in it. Later adds stay counted, so the
        # next flush commits them (they used to be wiped here and waited for close()).
        began, adding = self.unflushed, set(self._adding)
        failed = True
        try:
            writer.flush()
            failed = False
        finally:
            # Shards committed before an error are durable: take them either way.
            for record in writer.take_committed():
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

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        finally:
            for f in self._files.values():
                f.close()
            self._files.clear()
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

    # -- reading ------------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.meta["dtype"].removeprefix("torch."))

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, store_id: object) -> bool:
        return store_id in self._records

    def __getitem__(self, store_id: str) -> StoredRequest:
        try:
            return StoredRequest(self, self._records[store_id])
        except KeyError:
            raise KeyError(
                f"No request with store id {store_id!r} in store {self.root} ({len(self)} "
                "requests); outputs carry it as output.store_id."
            ) from None

    @property
    def requests(self) -> Iterator[StoredRequest]:
        """Every request, in store order: the root lane's first, then each lane's by name,
        each lane in the order its manifest committed them."""
        self._ensure_order()
        return (StoredRequest(self, r) for r in self._records.values())

    def item_ids(self) -> set[str]:
        """Every item id (a record's ``"item_id"``, see :attr:`StoredRequest.item_id`) of the
        requests in the store, across all lanes. From the manifests only: no shard is read.
        A collector skips the items it finds here when it resumes. The set is built once
        (about 0.5 s for a million records) and kept up to date by :meth:`flush`; each call
        returns a copy."""
        if self._item_ids is None:
            self._item_ids = {r["item_id"] for r in self._records.values() if "item_id" in r}
            self._item_ids.discard(None)
        return set(self._item_ids)

    def _ensure_order(self) -> None:
        """Put the records back in store order after this writer committed records of a lane
        that comes before another lane with records (its own land at the end of the dict)."""
        if not self._order_dirty:
            return
        rank = {lane: i for i, lane in enumerate(self.lanes)}
        self._records = dict(
            sorted(self._records.items(), key=lambda kv: rank[split_shard_key(kv[1]["shard"])[0]])
        )
        self._order_dirty = False
        self._index = None

    @property
    def layers(self) -> list[int]:
        """Every layer some run of this store captured."""
        runs = self._segment_index().runs_with_requests | set(self.runs)
        found = set(self.meta.get("layers") or []) if not runs else set()
        for run in runs:
            found.update(self.run_layers(run))
        return sorted(found)

    def run_layers(self, run_id: str | None) -> list[int]:
        """The layers one run captured (records written before runs had layers: the
        store's first layers)."""
        layers = run_layers(self.runs.get(run_id or "", {}))
        return layers if layers is not None else list(self.meta.get("layers") or [])

    def layer(self, layer: int, phase: str = "decode", token: str = "all") -> LayerMatrix:
        """All rows of one layer and phase (``token="last"``: one row per request/completion),
        from every run that captured that layer; ``.missing_runs`` names the runs that did
        not (they are logged too)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}; valid phases are {PHASES}.")
        if token not in TOKENS:
            raise ValueError(f"token={token!r}; valid values are {TOKENS}.")
        if layer not in self.layers:
            raise ValueError(
                f"layer {layer} is not in this store; its runs captured layers {self.layers}."
            )
        matrix = LayerMatrix(self, layer, phase, token)
        matrix.missing_runs = sorted(
            str(run)
            for run in self._segment_index().runs_with_requests
            if layer not in self.run_layers(run)  # type: ignore[arg-type]
        )
        if matrix.missing_runs:
            logger.warning(
                "probehook store %s: layer %d is not in run(s) %s; their requests are not in "
                "this matrix.",
                self.root,
                layer,
                matrix.missing_runs,
            )
        return matrix

    def batches(
        self, layer: int, batch_size: int, phase: str = "decode", token: str = "all"
    ) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        """Yield ``(rows, index)`` batches for training, streaming from disk."""
        matrix = self.layer(layer, phase, token)
        for begin in range(0, len(matrix), batch_size):
            end = min(begin + batch_size, len(matrix))
            yield matrix[begin:end], matrix.index[begin:end]

    def to_torch_dataset(
        self,
        layer: int,
        phase: str = "decode",
        token: str = "all",
        labels: Sequence[Any] | None = None,
    ) -> torch.utils.data.Dataset:
        """A map-style Dataset of rows (and labels aligned with ``layer(...).index``)."""
        return _LayerDataset(self.layer(layer, phase, token), labels)

    def export(self, path: str | Path, format: str, **options: Any) -> Any:
        """Write this store in a format that activation-training tools read directly:
        ``"saelens"`` (SAELens's cached-activations folder: ``layer=``, ``context_size=``;
        returns the folder) or ``"safetensors"`` (shards of ``token_ids`` and
        ``hidden_states [tokens, layers, hidden]`` in the layout of vLLM's hidden-state
        extraction: ``layers=``; returns the shard paths). See docs/exports.md."""
        from probehook.store import export

        writers = {"saelens": export.export_saelens, "safetensors": export.export_safetensors}
        if format not in writers:
            raise ValueError(
                f"format={format!r} is not an export format; choose one of {sorted(writers)}."
            )
        return writers[format](self, path, **options)

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
        try:
            import datasets
        except ImportError as e:
            raise MissingExtraError(
                "ActivationStore.to_hf_dataset needs the Hugging Face `datasets` package: "
                "pip install 'probehook[hf]'"
            ) from e
        matrix = self.layer(layer, phase, token)
        if labels is not None:
            # A list of plain Python values (from numpy arrays, tensors and lists alike).
            labels = labels.tolist() if hasattr(labels, "tolist") else list(labels)
            if len(labels) != len(matrix):
                raise ValueError(
                    f"labels has {len(labels)} entries but the layer has {len(matrix)} rows."
                )
        columns = {
            "store_id": datasets.Value("string"),
            "position": datasets.Value("int64"),
            "token_id": datasets.Value("int64"),
            "activations": datasets.List(datasets.Value("float32"), length=self.hidden_size),
        }
        if labels is not None:
            columns["label"] = _label_feature(datasets, labels)
        self._ensure_order()
        key = {
            "records": [(r["id"], r["shard"]) for r in self._records.values()],
            "selection": [layer, phase, token, self.meta.get("dtype"), self.hidden_size],
            "labels": labels,
        }
        digest = hashlib.sha256(json.dumps(key, default=repr).encode()).hexdigest()[:32]
        base = Path(cache_dir) if cache_dir is not None else Path(datasets.config.HF_DATASETS_CACHE)
        path = base / "probehook" / f"layer{layer}-{phase}-{token}-{digest}.arrow"
        if not path.is_file():
            # Whole blocks become Arrow arrays in one call each. Per-row examples through
            # Dataset.from_generator were over 10x slower (2000 bf16 rows of 4096: 1.4 s vs
            # 0.12 s).
            _write_arrow(matrix, labels, datasets.Features(columns).arrow_schema, path, block_rows)
        return datasets.Dataset.from_file(os.fspath(path))

    def info(self) -> dict[str, Any]:
        shards = {r["shard"] for r in self._records.values()}
        rows = sum(s["count"] for r in self._records.values() for s in r["segments"])
        per_lane = dict.fromkeys(self.lanes, 0)
        for r in self._records.values():
            lane = split_shard_key(r["shard"])[0]
            per_lane[lane] = per_lane.get(lane, 0) + 1
        return {
            "path": str(self.root),
            "requests": len(self),
            "shards": len(shards),
            "rows": rows,
            "tokens": sum(
                len(r["prompt_token_ids"]) + sum(len(c["token_ids"]) for c in r["completions"])
                for r in self._records.values()
            ),
            "bytes": sum(shard_path(self.root, s).stat().st_size for s in shards),
            "layers": self.layers,
            "runs": len(self.runs),
            "hidden_size": self.meta.get("hidden_size"),
            "dtype": self.meta.get("dtype"),
            "model": self.meta.get("model"),
            "lanes": per_lane,  # requests per lane; "" is the root lane
            "dropped": list(self.dropped),
        }

    @property
    def storage_dtype(self) -> np.dtype:
        return (
            np.dtype(np.uint16)
            if self.dtype == torch.bfloat16
            else np.dtype(str(self.dtype).removeprefix("torch."))
        )

    def _segment_index(self) -> SegmentIndex:
        self._ensure_order()
        if self._index is None:
            self._index = SegmentIndex(self._records.values())
        return self._index

    def _dataset(self, shard: str, phase: str, layer: int) -> h5py.Dataset:
        if self._pid != os.getpid():
            self._after_fork()
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = self._open_shard(shard)
        else:
            self._files.move_to_end(shard)
        return f[dataset_name(phase, layer)]

    def _open_shard(self, shard: str) -> h5py.File:
        limit = self.max_open_files
        while len(self._files) >= limit:
            self._files.popitem(last=False)[1].close()
        path = shard_path(self.root, shard)
        while True:
            try:
                # No chunk cache: whole-chunk reads then go straight into the caller's array.
                return h5py.File(path, "r", rdcc_nbytes=0)
            except OSError as e:
                if not _is_emfile(e):
                    raise
                if not self._files:
                    raise StoreError(
                        f"Cannot open shard {path} of the activation store at {self.root}: "
                        f"this process has no file descriptors left (soft open-file limit "
                        f"{_soft_nofile()}, {_descriptors_in_use()} open) and the store holds "
                        "none it could give back. Raise the limit (`ulimit -n`, "
                        "resource.setrlimit) or close other files."
                    ) from e
                # Something else in the process took descriptors: give back the older half of
                # ours, and keep the cache that small from now on.
                for _ in range(max(1, len(self._files) // 2)):
                    self._files.popitem(last=False)[1].close()
                self._budget = max(1, len(self._files))
                logger.info(
                    "probehook store %s: out of file descriptors; keeping at most %d shard "
                    "files open",
                    self.root,
                    self._budget,
                )

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker): open shards afresh. The inherited handles
        are HDF5 state copied from the parent; closing them here would also drop the parent's
        lock on those files (a ``flock`` belongs to the open file, which parent and child
        share), so they are kept referenced and never touched."""
        _INHERITED_FILES.extend(self._files.values())
        self._files = OrderedDict()
        self._pid = os.getpid()
        self._budget_for = -1

    def _to_tensor(self, data: np.ndarray) -> torch.Tensor:
        if self.dtype == torch.bfloat16:
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(data)

    def _read(self, shard: str, phase: str, layer: int, start: int, stop: int) -> torch.Tensor:
        return self._to_tensor(self._dataset(shard, phase, layer)[start:stop])

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_arrow(
    matrix: LayerMatrix, labels: list[Any] | None, schema: Any, path: Path, block_rows: int
) -> None:
    """Write ``matrix`` (+ labels) as an Arrow stream file, one record batch per block."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # concurrent callers
    index = matrix.index
    try:
        with pa.OSFile(os.fspath(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as out:
            begin = 0
            for block in matrix.iter_blocks(block_rows):
                rows = block.float().numpy()  # bfloat16 and float16 become float32
                end = begin + len(rows)
                arrays = [
                    pa.array(index["store_id"][begin:end].tolist(), pa.string()),
                    pa.array(index["position"][begin:end], pa.int64()),
                    pa.array(index["token_id"][begin:end], pa.int64()),
                    pa.FixedSizeListArray.from_arrays(
                        pa.array(rows.reshape(-1)), type=schema.field("activations").type
                    ),
                ]
                if labels is not None:
                    arrays.append(pa.array(labels[begin:end], schema.field("label").type))
                out.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
                begin = end
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _label_feature(datasets: Any, labels: list[Any]) -> Any:
    """The datasets feature of a label column, inferred by Arrow from the labels."""
    import pyarrow as pa

    schema = pa.schema([pa.field("label", pa.array(labels).type)])
    return datasets.Features.from_arrow_schema(schema)["label"]


class _LayerDataset(torch.utils.data.Dataset):
    def __init__(self, matrix: LayerMatrix, labels: Sequence[Any] | None) -> None:
        if labels is not None and len(labels) != len(matrix):
            raise ValueError(
                f"labels has {len(labels)} entries but the layer has {len(matrix)} rows."
            )
        self.matrix, self.labels = matrix, labels

    def __len__(self) -> int:
        return len(self.matrix)

    def __getitem__(self, i: int) -> Any:
        row = self.matrix[i]
        return row if self.labels is None else (row, self.labels[i])

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch (torch's DataLoader calls this with each batch's indices): consecutive
        rows are read in one block instead of one HDF5 read per row."""
        rows = list(self.matrix.take(indices))
        if self.labels is None:
            return rows
        return [(row, self.labels[i]) for row, i in zip(rows, indices, strict=True)]


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
