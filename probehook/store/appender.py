"""Appending rows to one HDF5 dataset at close to raw-write speed.

HDF5 normally copies every write through its chunk cache, and small writes are slow. Rows are
therefore collected until a whole chunk is known and written with ``write_direct_chunk``,
straight from the caller's array when one array covers the chunk (no copy at all) and through
one chunk-sized buffer otherwise. Compressed datasets need HDF5's filter pipeline, so they are
staged in larger blocks and written the ordinary way.
"""

from __future__ import annotations

import h5py
import numpy as np

CHUNK_BYTES = 4 << 20
"""Target chunk size: large enough for fast sequential reads, small enough for partial reads.
4 MiB: a layer read from the page cache ran at 0.93-0.95 of ``np.fromfile`` against 0.86-0.87
with 1 MiB chunks (docs/benchmarks.md); writes were unchanged within the noise."""
STAGE_BYTES = 16 << 20
"""Compressed datasets only: rows are written through HDF5's filters in blocks of this size."""


def chunk_rows_for(width: int, itemsize: int, available_rows: int) -> int:
    """Rows per chunk: about CHUNK_BYTES, fewer when the whole dataset is smaller (chunks are
    allocated whole, so a small run gets small chunks)."""
    return max(1, min(CHUNK_BYTES // max(1, width * itemsize), available_rows))


class DatasetAppender:
    """Rows appended in order to dataset ``name`` of ``file``; call ``close`` to write the rest.

    The dataset is created when the first chunk's worth of rows (or ``close``) arrives, so its
    chunk shape fits the data actually written.
    """

    def __init__(self, file: h5py.File, name: str, compression: str | None) -> None:
        self.file = file
        self.name = name
        self.compression = compression
        self.rows = 0  # rows accepted so far
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self._dataset: h5py.Dataset | None = None
        self._chunk_rows = 0
        self._kind: tuple[np.dtype, tuple[int, ...]] | None = None  # dtype, row shape

    def append(self, data: np.ndarray) -> int:
        """Queue ``data`` (``[rows, width]``, or ``[rows, *shape]``: a top-k per head;
        C-contiguous); return its first row's index.

        Every append must have the first one's dtype and width: rows of another are refused
        with ``ValueError`` (a chunk buffer of the first dtype would cast them silently, e.g.
        cut uint32 indices to uint16)."""
        start = self.rows
        if len(data) == 0:
            return start
        kind = (np.dtype(data.dtype), tuple(data.shape[1:]))
        if self._kind is None:
            self._kind = kind
        elif kind != self._kind:
            raise ValueError(
                f"dataset {self.name!r} holds {self._kind[0]} rows of shape {self._kind[1]}; "
                f"refusing {kind[0]} rows of shape {kind[1]} (they would not be stored as given)"
            )
        self.rows += len(data)
        self._pending.append(np.ascontiguousarray(data))
        self._pending_rows += len(data)
        self._pending_bytes += data.nbytes
        threshold = STAGE_BYTES if self.compression else CHUNK_BYTES
        if self._pending_bytes >= threshold:
            self._write(final=False)
        return start

    def close(self) -> None:
        """Write every queued row (the last chunk may be partial)."""
        if self._pending_rows:
            self._write(final=True)

    def _create(self, sample: np.ndarray) -> h5py.Dataset:
        row = tuple(sample.shape[1:])
        width = int(np.prod(row))
        self._chunk_rows = chunk_rows_for(width, sample.itemsize, self._pending_rows)
        return self.file.create_dataset(
            self.name,
            shape=(0, *row),
            maxshape=(None, *row),
            dtype=sample.dtype,
            chunks=(self._chunk_rows, *row),
            compression=self.compression,
        )

    def _write(self, *, final: bool) -> None:
        if self._dataset is None:
            self._dataset = self._create(self._pending[0])
        if self.compression:
            self._write_filtered()
        else:
            self._write_chunks(final=final)

    def _write_filtered(self) -> None:
        assert self._dataset is not None
        data = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        start = self._dataset.shape[0]
        self._dataset.resize(start + len(data), axis=0)
        self._dataset.write_direct(data, dest_sel=np.s_[start:])
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0

    def _write_chunks(self, *, final: bool) -> None:
        """Write every whole chunk queued (and, when ``final``, the partial last one)."""
        assert self._dataset is not None
        rows = self._chunk_rows
        n_chunks = self._pending_rows // rows
        if final and self._pending_rows % rows:
            n_chunks += 1
        if n_chunks == 0:
            return
        start = self._dataset.shape[0]
        end = min(start + n_chunks * rows, start + self._pending_rows)
        self._dataset.resize(end, axis=0)
        for offset in range(start, end, rows):
            origin = (offset,) + (0,) * (self._dataset.ndim - 1)
            self._dataset.id.write_direct_chunk(origin, self._take(rows))
        self._pending_bytes = sum(a.nbytes for a in self._pending)

    def _take(self, rows: int) -> np.ndarray:
        """The next ``rows`` queued rows as one chunk buffer (zero-padded at the very end)."""
        first = self._pending[0]
        if len(first) >= rows:  # one array covers the chunk: hand over a view, no copy
            self._pending[0] = first[rows:]
            if len(self._pending[0]) == 0:
                self._pending.pop(0)
            self._pending_rows -= rows
            return first[:rows]
        chunk = np.zeros((rows, *first.shape[1:]), dtype=first.dtype)
        filled = 0
        while filled < rows and self._pending:
            part = self._pending[0]
            n = min(rows - filled, len(part))
            chunk[filled : filled + n] = part[:n]
            filled += n
            self._pending[0] = part[n:]
            if len(self._pending[0]) == 0:
                self._pending.pop(0)
        self._pending_rows -= filled
        return chunk
