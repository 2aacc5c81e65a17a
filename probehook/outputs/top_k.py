"""The generic top-k readout row: each token's ``k`` strongest entries of a wide readout (SAE
features now; a lens's most likely tokens next), the form every top-k readout takes on
outputs, on streams, on the server and in the store.

The worker packs a step's rows of one readout as float32 ``[n, 2K + 1]`` (``K`` indices,
``K`` values, then ``l0``: :func:`pack` is that layout, ``K`` the engine's k); a request may
keep fewer (``k <= K``, the first ``k``: rows are sorted). The indices travel as the bits of
int32 (:func:`carry_indices`), not as float32 values: exact to 2**31 - 1, where float32 rounds
past 2**24. Packed rows are only ever copied (gathered, concatenated, moved), never computed
on, so their bits arrive as they left. No vLLM, no torch.compile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

# How stores name top-k rows. The spellings date from format 1, when SAE features were the
# only top-k readout; they stay so that every store written since reads unchanged.
SEGMENT_NAME_KEY = "sae"
"""A stored request's top-k segment (``record["sae_segments"]``): the key of its stored
instance name (``TopKReadout.stored_name``)."""
SEGMENT_SOURCE_KEY = "source"
"""A top-k segment's key of its readout's source."""
UNSOURCED = "sae"
"""The source of a top-k segment written without :data:`SEGMENT_SOURCE_KEY` (before a store
held any readout but SAE features)."""
RUN_TOP_K_KEY = "saes"
"""A run's key (``store.runs[run]``) of its top-k instances' descriptions, by stored name."""

PACKED_INDEX_LIMIT = 2**31 - 1
"""Indices travel from the worker as int32 bits in the float32 packed rows: a readout whose
indices may reach 2**31 - 1 (the int32 padding -1 aside) is refused at construction. (They
travelled as float32 values until the column schema, exact below 2**24 only.)"""


def carry_indices(indices: torch.Tensor) -> torch.Tensor:
    """Integer indices as the packed rows carry them: their int32 bits, viewed as float32
    (exact; -1 is the padding)."""
    return indices.to(torch.int32).view(torch.float32)


def carried_indices(columns: torch.Tensor) -> torch.Tensor:
    """The int32 indices of packed index columns (:func:`carry_indices`' inverse; a view)."""
    return columns.view(torch.int32)


def pad_indices(columns: torch.Tensor) -> None:
    """Mark packed index columns as padding (int32 -1), in place."""
    columns.view(torch.int32).fill_(-1)


def check_packed_indices(bound: int, what: str) -> None:
    """Refuse ``what`` (an SAE, a readout instance) whose ``bound`` indices the packed rows
    cannot carry exactly."""
    from probehook.errors import CaptureConfigError

    if bound > PACKED_INDEX_LIMIT:
        raise CaptureConfigError(
            f"{what} has {bound:,} entries; the worker's packed rows carry indices as int32, "
            f"up to {PACKED_INDEX_LIMIT:,}. Such readouts are not supported."
        )


@dataclass(frozen=True)
class TopKRows:
    """The ``k`` strongest entries of each of ``n`` tokens, from one readout.

    - ``indices``: int64 ``[n, k]``, descending by value (|value| for abstopk SAEs), ties
      toward the lower index, padded with -1 where fewer than ``k`` are non-zero;
    - ``values``: float32 ``[n, k]``, padded with 0; only non-zero values appear;
    - ``l0``: int64 ``[n]``, the non-zero entries of each token before the top-k cut.

    ``watched`` is what monitors read: the same tokens at the engine's k (the worker watches
    those; a request that keeps fewer shows fewer). Itself when the request keeps them all.
    """

    indices: torch.Tensor
    values: torch.Tensor
    l0: torch.Tensor
    engine: TopKRows | None = field(default=None, compare=False, repr=False)
    """The same tokens at the engine's k, when this request keeps fewer (see ``watched``)."""

    scalar_dtype: ClassVar[torch.dtype] = torch.int64
    """The dtype of the per-token scalar (the packed rows' last column): an SAE's ``l0``
    counts; a readout whose scalar is a real number (a lens's target log-prob) subclasses
    with float32."""
    column_names: ClassVar[tuple[str, str, str]] = ("indices", "values", "l0")
    """What the JSON forms call the three columns (a subclass names them for its readout)."""

    def __len__(self) -> int:
        return int(self.l0.shape[0])

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])

    @property
    def watched(self) -> TopKRows:
        """These tokens at the engine's k: what feature monitors read, here and in the
        worker."""
        return self.engine if self.engine is not None else self

    def __getitem__(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``token``'s entries, padding left out: ``(indices, values)``."""
        on = self.indices[token] >= 0
        return self.indices[token][on], self.values[token][on]

    def dense(self, width: int) -> torch.Tensor:
        """``[n, width]`` float32 with the kept values in place (zeros elsewhere: what the cut
        dropped is not recovered)."""
        out = torch.zeros((len(self), width), dtype=torch.float32)
        on = self.indices >= 0
        rows = torch.arange(len(self)).unsqueeze(1).expand_as(self.indices)
        out[rows[on], self.indices[on]] = self.values[on]
        return out

    def activation(self, index: int) -> torch.Tensor:
        """``[n]`` float32: entry ``index``'s value on each token (0 where it is not among
        the kept ``k``)."""
        return torch.where(self.indices == index, self.values, 0.0).sum(dim=1)

    def value_of(self, index: int, outside: float = 0.0) -> torch.Tensor:
        """``[n]`` float32: entry ``index``'s value on each token, ``outside`` where it is not
        among the kept ``k`` (what a monitor of the readout watches)."""
        hit = self.indices == index
        inside = torch.where(hit, self.values, 0.0).sum(dim=1)
        return torch.where(hit.any(dim=1), inside, torch.tensor(outside, dtype=inside.dtype))

    @classmethod
    def from_columns(cls, columns: Any) -> TopKRows:
        """Rows from a served response's columns (:func:`json_top_k`'s lists, nulls where a
        value was not finite, or :func:`compact_top_k`'s base64 arrays)."""
        names = cls.column_names
        missing = [name for name in names if name not in columns]
        if missing:
            raise ValueError(f"top-k columns {sorted(columns)} lack {missing}")
        indices, values, scalar = (_column(columns[name]) for name in names)
        n = len(scalar)
        # a completion with no tokens is served as empty columns: zero rows of width 0
        width = indices.numel() // n if n else 0
        if indices.numel() != n * width or values.numel() != n * width:
            raise ValueError(
                f"top-k columns of {n} tokens hold {indices.numel()} indices and "
                f"{values.numel()} values: not {n} rows of one width"
            )
        return cls(
            indices.to(torch.int64).reshape(n, width),
            values.to(torch.float32).reshape(n, width),
            scalar.to(cls.scalar_dtype),
        )

    def top(self, k: int) -> TopKRows:
        """The first ``k`` entries of each token (rows are sorted, so this is the top ``k``);
        ``l0`` is unchanged; ``watched`` stays the engine's."""
        if k == self.k:
            return self
        return type(self)(self.indices[:, :k], self.values[:, :k], self.l0, self.watched)

    def rows(self, lo: int, hi: int | None = None) -> TopKRows:
        """Tokens ``lo..hi`` (views)."""
        engine = self.engine.rows(lo, hi) if self.engine is not None else None
        return type(self)(self.indices[lo:hi], self.values[lo:hi], self.l0[lo:hi], engine)

    @classmethod
    def unpack(cls, packed: torch.Tensor, k: int) -> TopKRows:
        """From the worker's packed float32 rows ``[n, 2K + 1]`` (K the engine's k >= ``k``);
        copies, so the packed tensor (an export's shared block) is not kept alive."""
        engine_k = (packed.shape[1] - 1) // 2
        full = cls(
            carried_indices(packed[:, :engine_k]).to(torch.int64),
            packed[:, engine_k : 2 * engine_k].clone(),
            packed[:, 2 * engine_k].to(cls.scalar_dtype),
        )
        return full.top(k)

    @classmethod
    def empty(cls, k: int) -> TopKRows:
        return cls(
            torch.empty((0, k), dtype=torch.int64),
            torch.empty((0, k), dtype=torch.float32),
            torch.empty(0, dtype=cls.scalar_dtype),
        )

    @classmethod
    def cat(cls, pieces: Sequence[TopKRows]) -> TopKRows:
        if len(pieces) == 1:
            return pieces[0]
        engines = [p.engine for p in pieces]
        engine = cls.cat(engines) if all(e is not None for e in engines) else None  # type: ignore[arg-type]
        return cls(
            torch.cat([p.indices for p in pieces]),
            torch.cat([p.values for p in pieces]),
            torch.cat([p.l0 for p in pieces]),
            engine,
        )

    def to_dict(self) -> dict[str, list]:
        """JSON-ready lists (the server's form): every inf and NaN as None."""
        indices, values, scalar = self.column_names
        return {
            indices: self.indices.tolist(),
            values: json_floats(self.values),
            scalar: self.l0.tolist() if not self.l0.is_floating_point() else json_floats(self.l0),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={len(self)}, k={self.k})"


class TopKDecoder:
    """Decodes one stream's packed top-k rows once each: a cumulative stream asks for every
    row to date at every token, and gets views of what was decoded before plus the new rows
    decoded now (so a yield's cost does not grow with the tokens before it).

    Rows arrive as views of a growing, append-only buffer (the stream receiver's): positions
    already written never change, so the values are handed out as views of it too; only the
    int64 indices and l0 are converted, into buffers of their own.
    """

    def __init__(self, row_type: type[TopKRows] = TopKRows) -> None:
        self.row_type = row_type
        self.base = self.done = -1
        self._indices: torch.Tensor | None = None  # [slots, capacity, K]
        self._l0: torch.Tensor | None = None  # [slots, capacity]
        self.converted = 0
        """Rows converted so far (the tests count them)."""

    def decode(self, packed: torch.Tensor, lo: int) -> list[TopKRows]:
        """``packed``: ``[slots, n, 2K + 1]``, the rows of positions ``lo..lo + n`` (a view of
        the stream's buffer); one :class:`TopKRows` per slot at the engine's K, as views."""
        slots, n, width = packed.shape
        engine_k = (width - 1) // 2
        hi = lo + n
        if self._indices is None or lo < self.base or lo > self.done:
            self.base = self.done = lo  # a stream's spans start at its first position
            self._indices = self._l0 = None
        if hi > self.done:
            self._grow(slots, hi - self.base, engine_k)
            assert self._indices is not None and self._l0 is not None
            new = packed[:, self.done - lo :]
            at = slice(self.done - self.base, hi - self.base)
            self._indices[:, at] = carried_indices(new[:, :, :engine_k])
            self._l0[:, at] = new[:, :, 2 * engine_k]
            self.converted += hi - self.done
            self.done = hi
        assert self._indices is not None and self._l0 is not None
        at = slice(lo - self.base, hi - self.base)
        return [
            self.row_type(
                self._indices[slot, at],
                packed[slot, :, engine_k : 2 * engine_k],
                self._l0[slot, at],
            )
            for slot in range(slots)
        ]

    def _grow(self, slots: int, end: int, engine_k: int) -> None:
        if self._indices is not None and end <= self._indices.shape[1]:
            return
        capacity = max(end, 2 * (self._indices.shape[1] if self._indices is not None else 0), 16)
        indices = torch.empty((slots, capacity, engine_k), dtype=torch.int64)
        l0 = torch.empty((slots, capacity), dtype=self.row_type.scalar_dtype)
        if self._indices is not None and self._l0 is not None:
            # Views handed out earlier keep the old buffers alive and unchanged.
            kept = self.done - self.base
            indices[:, :kept] = self._indices[:, :kept]
            l0[:, :kept] = self._l0[:, :kept]
        self._indices, self._l0 = indices, l0


# -- JSON forms (the server's) --------------------------------------------------------------


def non_finite_rows(values: torch.Tensor) -> list[int]:
    """The tokens (rows) whose values hold an inf or a NaN (a float16 encoder can overflow)."""
    bad = ~torch.isfinite(values)
    return (
        bad.reshape(len(values), -1).any(dim=1).nonzero().squeeze(1).tolist() if bad.any() else []
    )


def json_floats(values: torch.Tensor) -> Any:
    """``values.tolist()`` with every inf and NaN as None: JSON has no such numbers (Python's
    ``json`` would write ``Infinity``, which no client parses). The rows that held one are
    named by the caller where the form allows (``non_finite``)."""
    values = values.float()
    return values.tolist() if bool(torch.isfinite(values).all()) else _nulls(values.tolist())


def compact_top_k(value: dict[str, Any]) -> dict[str, Any]:
    """Top-k rows by name as base64 arrays (``decode_array``): int32 indices, float32 values,
    int32 l0 (about a third of the JSON lists' characters); ``non_finite`` as in
    :func:`json_top_k`."""
    from probehook.outputs.array_codec import encode_array

    out = {}
    for name, rows in value.items():
        indices, values, scalar = rows.column_names
        out[name] = {
            indices: encode_array(rows.indices.to(torch.int32)),
            values: encode_array(rows.values),
            scalar: encode_array(
                rows.l0.to(torch.float32 if rows.l0.is_floating_point() else torch.int32)
            ),
        }
        bad = non_finite_tokens(rows)
        if bad:
            out[name]["non_finite"] = bad
    return out


def json_top_k(features: Any) -> dict[str, Any]:
    """A top-k readout's JSON lists; ``non_finite``: the tokens whose values held an inf or
    NaN (written as null), present only when there are any."""
    out = features.to_dict()  # inf and NaN written as null
    rows = non_finite_tokens(features)
    if rows:
        out["non_finite"] = rows
    return out


def non_finite_tokens(rows: Any) -> list[int]:
    """The tokens whose values or scalar (a lens's target log-prob) hold an inf or a NaN:
    every non-finite number a served form writes as null is named."""
    bad = set(non_finite_rows(rows.values))
    if rows.l0.is_floating_point():
        bad.update(non_finite_rows(rows.l0))
    return sorted(bad)


def _nulls(values: Any) -> Any:
    if isinstance(values, list):
        return [_nulls(v) for v in values]
    return values if math.isfinite(values) else None


def _column(value: Any) -> torch.Tensor:
    """One served column: a base64 array or lists (null: NaN)."""
    from probehook.outputs.array_codec import decode_array

    if isinstance(value, dict):
        return torch.from_numpy(decode_array(value).copy())
    return torch.tensor(json_nans(value), dtype=torch.float64)


def json_nans(values: Any) -> Any:
    """Lists read back from JSON with every null as NaN (the inverse of :func:`_nulls`)."""
    if isinstance(values, list):
        return [json_nans(v) for v in values]
    return math.nan if values is None else values
