"""A columnar index of every stored segment, built once per store.

A layer's rows are spread over the segments of many requests. Walking every record's segments
in Python on each ``layer()`` call costs about a millisecond per thousand segments, which is a
tenth of reading a layer from the page cache; the index turns the lookup into a few array ops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from probehook.store.format import PHASES

COLUMNS = ("layer", "phase", "start", "count", "shard")
"""The index's columns; phase is its position in ``PHASES``, shard a code into the names."""


@dataclass(frozen=True)
class LayerExtents:
    """Where one layer and phase lives: its extents (contiguous row ranges of one shard's
    dataset), in store order."""

    shards: list[str]
    """Shard of each extent."""
    bounds: np.ndarray
    """``[extents, 2]`` first and past-the-end row of each extent in its shard's dataset."""
    offsets: np.ndarray
    """``[extents + 1]`` row of the result where each extent begins (cumulative lengths)."""
    segments: np.ndarray
    """Positions in :attr:`SegmentIndex.refs` of the segments that make up the extents."""


class SegmentIndex:
    """Segments of the store's records as parallel columns, in record order."""

    def __init__(self, records: Iterable[dict[str, Any]] = ()) -> None:
        self.refs: list[tuple[dict, dict]] = []
        """(record, segment) of each indexed segment."""
        self._shard_names: list[str] = []
        self._shard_codes: dict[str, int] = {}
        self._columns: tuple[list[int], ...] = ([], [], [], [], [])  # COLUMNS
        self._arrays: np.ndarray | None = None
        self.runs_with_requests: set[str | None] = set()
        for record in records:
            self.add(record)

    def add(self, record: dict[str, Any]) -> None:
        shard = self._shard_codes.setdefault(record["shard"], len(self._shard_names))
        if shard == len(self._shard_names):
            self._shard_names.append(record["shard"])
        self.runs_with_requests.add(record.get("run"))
        for seg in record["segments"]:
            phase = PHASES.index(seg["phase"])
            for column, value in zip(
                self._columns, (seg["layer"], phase, seg["start"], seg["count"], shard), strict=True
            ):
                column.append(value)
            self.refs.append((record, seg))
        self._arrays = None

    def arrays(self) -> np.ndarray:
        """``[segments, 5]`` int64 columns (see :data:`COLUMNS`), built once after adds."""
        if self._arrays is None:
            self._arrays = np.stack([np.array(c, dtype=np.int64) for c in self._columns], axis=1)
        return self._arrays

    def select(self, layer: int, phase: str, last_only: bool) -> LayerExtents:
        """The extents holding ``layer``/``phase`` rows (``last_only``: each segment's last row);
        adjacent rows of one shard are merged into one extent, so one read covers them."""
        cols = self.arrays()
        picked = np.flatnonzero(
            (cols[:, 0] == layer) & (cols[:, 1] == PHASES.index(phase)) & (cols[:, 3] > 0)
        )
        stop = cols[picked, 2] + cols[picked, 3]
        start = stop - 1 if last_only else cols[picked, 2]
        shard = cols[picked, 4]
        # A new extent wherever the shard changes or the rows are not adjacent.
        new_extent = np.ones(len(picked), dtype=bool)
        new_extent[1:] = (shard[1:] != shard[:-1]) | (start[1:] != stop[:-1])
        firsts = np.flatnonzero(new_extent)
        lasts = np.append(firsts[1:] - 1, len(picked) - 1).astype(np.int64)
        bounds = (
            np.stack([start[firsts], stop[lasts]], axis=1)
            if len(firsts)
            else np.zeros((0, 2), dtype=np.int64)
        )
        offsets = np.zeros(len(firsts) + 1, dtype=np.int64)
        np.cumsum(bounds[:, 1] - bounds[:, 0], out=offsets[1:])
        return LayerExtents([self._shard_names[s] for s in shard[firsts]], bounds, offsets, picked)
