"""``LayerMatrix``: one layer and phase of the whole store, as rows read on demand.

The rows live in extents: contiguous row ranges of one shard's dataset, in store order (see
:class:`~probehook.store.segments.LayerExtents`). A read of rows ``start:stop`` touches only
the extents it overlaps, one HDF5 read each, straight into the result.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from probehook.store.reader import StoreReader


class LayerMatrix:
    """Rows of one layer and phase across the store, read from disk on demand.

    ``index`` is a structured array (store_id, position, token_id) aligned with the rows;
    a decode row's token_id is the token it produced. Slicing reads only the rows asked for,
    straight into the result; ``numpy()`` loads everything explicitly.
    """

    def __init__(self, store: StoreReader, layer: int, phase: str, token: str) -> None:
        self.store, self.layer, self.phase, self.token = store, layer, phase, token
        self.missing_runs: list[str] = []
        """Runs with requests in the store that did not capture this layer."""
        index = store._segment_index()
        self._extents = index.select(layer, phase, last_only=token == "last")
        self._refs = index.refs

    @functools.cached_property
    def index(self) -> np.ndarray:
        n = len(self)
        index = np.zeros(
            n, dtype=[("store_id", object), ("position", np.int64), ("token_id", np.int64)]
        )
        row = 0
        for i in self._extents.segments:
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
        return (int(self._extents.offsets[-1]), self.store.hidden_size)

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
        block of consecutive rows (and shard), so a sequential batch costs one or two reads."""
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
        """Rows ``start:stop`` (in range) in storage dtype, each extent read straight into
        place."""
        out = np.empty((stop - start, self.store.hidden_size), dtype=self.store.storage_dtype)
        if stop <= start:
            return out
        extents = self._extents
        first = int(np.searchsorted(extents.offsets, start, side="right")) - 1
        for i in range(max(first, 0), len(extents.shards)):
            extent_start = int(extents.offsets[i])
            if extent_start >= stop:
                break
            a, b = (int(x) for x in extents.bounds[i])
            lo = a + max(0, start - extent_start)
            hi = min(b, a + stop - extent_start)
            dest = extent_start + (lo - a) - start
            self.store._dataset(extents.shards[i], self.phase, self.layer).read_direct(
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
