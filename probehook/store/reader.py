"""``StoreReader``: a store opened for reading, every lane as one store.

It holds what :mod:`probehook.store.contents` read from ``meta.json`` and the manifests, and
reads rows from the shards on demand: one request (:class:`StoredRequest`) or one layer of
every request (:class:`LayerMatrix`), through a bounded cache of open shard files.
:class:`~probehook.store.store.ActivationStore` adds writing on top.
"""

from __future__ import annotations

import logging
import operator
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import h5py
import numpy as np
import torch

from probehook.errors import StoreError
from probehook.store.contents import read_manifests, read_meta
from probehook.store.features import feature_dataset, layout_parts
from probehook.store.format import PHASES, ROOT_LANE, dataset_name, shard_path, split_shard_key
from probehook.store.layer_matrix import LayerMatrix
from probehook.store.manifest import run_layers
from probehook.store.open_files import (
    INHERITED_FILES,
    MAX_OPEN_FILES,
    descriptors_in_use,
    is_emfile,
    open_file_budget,
    soft_nofile,
)
from probehook.store.segments import SegmentIndex
from probehook.store.stored_request import StoredRequest

logger = logging.getLogger(__name__)
TOKENS = ("all", "last")


class StoreReader:
    """A store's requests and rows, read-only. See docs/store.md for the format."""

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
        self._order_dirty = False  # records of an earlier lane were committed at the end
        self._item_ids: set[str] | None = None  # built by item_ids() on first use
        self.runs = runs
        """Runs by run id: what each appended run captured (``capture``) and when."""
        self.dropped = dropped
        self._index: SegmentIndex | None = None
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
        soft = soft_nofile()
        if soft != self._budget_for:
            self._budget_for = soft
            self._budget = open_file_budget(soft, descriptors_in_use(), len(self._files))
        return max(1, min(self._open_files_bound, self._budget))

    @max_open_files.setter
    def max_open_files(self, bound: int) -> None:
        bound = operator.index(bound)
        if bound < 1:
            raise ValueError(f"max_open_files={bound}; it must be at least 1.")
        self._open_files_bound = bound

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path) -> Self:
        """Open an existing store for reading. Interrupted shards are left out with a warning."""
        root = Path(path)
        meta = read_meta(root)
        records, runs, dropped, lanes = read_manifests(root)
        store = cls(root, meta, records, runs, dropped, lanes)
        store._segment_index().arrays()  # with the manifest parse, not in the first layer()
        return store

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
        return self._shard_file(shard)[dataset_name(phase, layer)]

    def _shard_file(self, shard: str) -> h5py.File:
        if self._pid != os.getpid():
            self._after_fork()
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = self._open_shard(shard)
        else:
            self._files.move_to_end(shard)
        return f

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
                if not is_emfile(e):
                    raise
                if not self._files:
                    raise StoreError(
                        f"Cannot open shard {path} of the activation store at {self.root}: "
                        f"this process has no file descriptors left (soft open-file limit "
                        f"{soft_nofile()}, {descriptors_in_use()} open) and the store holds "
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
        INHERITED_FILES.extend(self._files.values())
        self._files = OrderedDict()
        self._pid = os.getpid()
        self._budget_for = -1

    def _to_tensor(self, data: np.ndarray) -> torch.Tensor:
        if self.dtype == torch.bfloat16:
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(data)

    def _read(self, shard: str, phase: str, layer: int, start: int, stop: int) -> torch.Tensor:
        return self._to_tensor(self._dataset(shard, phase, layer)[start:stop])

    def _read_features(
        self, shard: str, phase: str, sae: str, start: int, stop: int, layout: str | None = None
    ) -> dict[str, Any]:
        """The stored arrays of top-k instance ``sae``'s rows of one layout (None: a store
        written before layouts), rows ``start:stop``, by dataset name (store/features)."""
        f = self._shard_file(shard)
        return {
            part: f[feature_dataset(phase, sae, part, layout)][start:stop]
            for part in layout_parts(layout)
        }

    def close(self) -> None:
        """Close the shard files this reader holds open."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
