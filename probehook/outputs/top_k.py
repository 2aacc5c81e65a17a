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

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from probehook.outputs.columns import Column, named_axes, unpack_columns

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

LABELS_KEY = "labels"
"""Where the served forms and a store's top-k segment keep the rows' axis labels
(:attr:`TopKRows.labels`)."""

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


def pad_top_k(out: torch.Tensor, k: int) -> None:
    """Packed rows ``[n, 2k + 1]`` of the three-column layout as no reading (-1, 0, l0 0),
    in place."""
    pad_indices(out[:, :k])
    out[:, k:] = 0


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

    A subclass names the three columns (:attr:`column_names`), may put axes before ``k``
    (:attr:`lead_axes`: ``("heads",)`` gives ``[n, heads, k]`` entries and ``[n, heads]``
    scalars) and may add columns (:attr:`extra_columns`, held in :attr:`extra` and read as
    attributes): its column schema (:meth:`schema`, :mod:`probehook.outputs.columns`), from
    which packing, the served forms and the store's datasets follow.

    ``watched`` is what monitors read: the same tokens at the engine's k (the worker watches
    those; a request that keeps fewer shows fewer). Itself when the request keeps them all.
    """

    indices: torch.Tensor
    values: torch.Tensor
    l0: torch.Tensor
    engine: TopKRows | None = field(default=None, compare=False, repr=False)
    """The same tokens at the engine's k, when this request keeps fewer (see ``watched``)."""
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """The :attr:`extra_columns`, by name (``[n, *shape]`` each)."""
    labels: Mapping[str, tuple[Any, ...]] = field(default_factory=dict, compare=False, repr=False)
    """What the entries of a named axis are, where a request chose them (``{"heads": (0, 3),
    "spans": ("system",)}``): kept by every cut, join, served form and store."""

    scalar_dtype: ClassVar[torch.dtype] = torch.int64
    """The dtype of the per-token scalar (the packed rows' last column): an SAE's ``l0``
    counts; a readout whose scalar is a real number (a lens's target log-prob) subclasses
    with float32."""
    column_names: ClassVar[tuple[str, str, str]] = ("indices", "values", "l0")
    """What the JSON forms call the three columns (a subclass names them for its readout)."""
    lead_axes: ClassVar[tuple[str, ...]] = ()
    """Axes before ``k`` of the entries (and of the scalar): instance settings naming their
    sizes (``("heads",)``: a top-k per head)."""
    extra_columns: ClassVar[tuple[Column, ...]] = ()
    """Columns after the three (a second scalar, ``Column("mean")``; per-head values,
    ``Column("entropy", ("heads",))``)."""

    def __getattr__(self, name: str) -> torch.Tensor:
        """Every column by its schema name (``rows.offsets``, ``rows.mean``)."""
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        if name in self.column_names:
            return self.__dict__[("indices", "values", "l0")[self.column_names.index(name)]]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def schema(cls) -> tuple[Column, ...]:
        """Every column, in packed order: the entries' indices and values, the scalar, then
        :attr:`extra_columns` (built once a class: every unpack, cut and join reads it)."""
        return _schema_of(cls)

    @classmethod
    def of_columns(
        cls,
        columns: Mapping[str, torch.Tensor],
        engine: TopKRows | None = None,
        labels: Mapping[str, Sequence[Any]] | None = None,
    ) -> TopKRows:
        """Rows from every schema column by name (others in ``columns`` are left out)."""
        indices, values, scalar = cls.column_names
        extra = {c.name: columns[c.name] for c in cls.extra_columns}
        named = {axis: tuple(v) for axis, v in (labels or {}).items()}
        return cls(columns[indices], columns[values], columns[scalar], engine, extra, named)

    @property
    def columns(self) -> dict[str, torch.Tensor]:
        """Every column by its name (the schema's order)."""
        indices, values, scalar = self.column_names
        return {indices: self.indices, values: self.values, scalar: self.l0, **self.extra}

    def __len__(self) -> int:
        return int(self.l0.shape[0])

    @property
    def k(self) -> int:
        return int(self.indices.shape[-1])

    @property
    def watched(self) -> TopKRows:
        """These tokens at the engine's k: what feature monitors read, here and in the
        worker."""
        return self.engine if self.engine is not None else self

    def __getitem__(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``token``'s entries, padding left out: ``(indices, values)`` (of every lead
        axis's top-k, flattened in order)."""
        on = self.indices[token] >= 0
        return self.indices[token][on], self.values[token][on]

    def lead_slices(self) -> list[TopKRows]:
        """One plain top-k ``[n, k]`` per lead index (heads, flattened in order): what viewers
        show as blocks of their own; ``[self]`` without lead axes."""
        if self.indices.dim() == 2:
            return [self]
        # the lead axes flattened by shape (a reshape to -1 is ambiguous with zero tokens)
        ids, values = self.indices.flatten(1, -2), self.values.flatten(1, -2)
        scalar = self.l0.flatten(1)
        return [TopKRows(ids[:, h], values[:, h], scalar[:, h]) for h in range(ids.shape[1])]

    def dense(self, width: int) -> torch.Tensor:
        """``[n, *lead, width]`` float32 with the kept values in place (zeros elsewhere: what
        the cut dropped is not recovered)."""
        out = torch.zeros((*self.indices.shape[:-1], width), dtype=torch.float32)
        on = self.indices >= 0
        # a token's indices are distinct: adding into zeros places each value as it is
        return out.scatter_add_(-1, self.indices.clamp(min=0), torch.where(on, self.values, 0.0))

    def activation(self, index: int) -> torch.Tensor:
        """``[n, *lead]`` float32: entry ``index``'s value on each token (0 where it is not
        among the kept ``k``)."""
        return torch.where(self.indices == index, self.values, 0.0).sum(dim=-1)

    def value_of(self, index: int, outside: float = 0.0) -> torch.Tensor:
        """``[n]`` float32: entry ``index``'s value on each token, ``outside`` where it is not
        among the kept ``k`` (what a monitor of the readout watches; with lead axes, the
        largest value of the entry among them, as the worker's monitors read)."""
        hit = (self.indices == index).reshape(len(self), -1)
        values = self.values.reshape(len(self), -1)
        if not self.lead_axes:
            inside = torch.where(hit, values, 0.0).sum(dim=1)
        else:
            inside = torch.where(hit, values, -math.inf).max(dim=1).values
        return torch.where(hit.any(dim=1), inside, torch.tensor(outside, dtype=inside.dtype))

    @classmethod
    def from_columns(cls, columns: Any) -> TopKRows:
        """Rows from a served response's columns (:func:`json_top_k`'s lists, nulls where a
        value was not finite, or :func:`compact_top_k`'s base64 arrays)."""
        schema = cls.schema()
        missing = [c.name for c in schema if c.name not in columns]
        if missing:
            raise ValueError(f"top-k columns {sorted(columns)} lack {missing}")
        decoded = {c.name: _column(columns[c.name]) for c in schema}
        n = decoded[schema[2].name].shape[0]
        got = {}
        for column in schema:
            value = decoded[column.name]
            dims = 1 + len(column.axes)
            if value.dim() != dims or value.shape[0] != n:
                # a completion with no tokens is served as empty columns: zero rows
                width = value.numel() // n if n else 0
                if value.numel() != n * width or (dims != 2 and n):
                    raise ValueError(
                        f"top-k columns of {n} tokens hold {value.numel()} {column.name}: "
                        f"not {n} rows of one width"
                    )
                value = value.reshape(n, *([width] if dims == 2 else [0] * (dims - 1)))
            got[column.name] = value.to(column.dtype)
        indices, values = got[schema[0].name], got[schema[1].name]
        if indices.shape != values.shape:
            raise ValueError(
                f"top-k columns of {n} tokens hold {indices.numel()} indices and "
                f"{values.numel()} values: not {n} rows of one width"
            )
        return cls.of_columns(got, labels=columns.get(LABELS_KEY))

    @classmethod
    def from_parts(
        cls,
        indices: torch.Tensor,
        values: torch.Tensor,
        scalar: torch.Tensor,
        extra: Mapping[str, torch.Tensor],
        labels: Mapping[str, Sequence[Any]] | None = None,
    ) -> TopKRows:
        """Rows from a store's columns (``probehook.store.features.from_storage``): each
        further column of the schema reshaped to its axes and cast to its dtype (a per-token
        scalar is stored ``[rows, 1]``); stored columns the schema lacks are left out;
        ``labels``: the segment's axis labels."""
        named = {axis: tuple(v) for axis, v in (labels or {}).items()}
        shaped = {}
        for column in cls.schema()[3:]:
            if column.name not in extra and any(not named.get(a, True) for a in column.axes):
                # an axis of no entries (labels say so): stored as no dataset
                lead = dict(zip(cls.lead_axes, indices.shape[1:-1], strict=True))
                shape = [0 if a in named and not named[a] else lead.get(a, 0) for a in column.axes]
                shaped[column.name] = torch.empty((len(indices), *shape), dtype=column.dtype)
                continue
            if column.name not in extra:
                raise ValueError(
                    f"stored {cls.__name__} rows lack column {column.name!r} (stored: "
                    f"{sorted(extra)}); the readout that wrote them had another schema"
                )
            t = extra[column.name]
            if t.dim() != 1 + len(column.axes):
                t = t.reshape(t.shape[0], *t.shape[1 : 1 + len(column.axes)])
            shaped[column.name] = t.to(column.dtype)
        return cls(indices, values, scalar, extra=shaped, labels=named)

    def top(self, k: int) -> TopKRows:
        """The first ``k`` entries of each token (rows are sorted, so this is the top ``k``);
        ``l0`` is unchanged; ``watched`` stays the engine's."""
        if k == self.k:
            return self
        have = self.columns
        cut = {
            c.name: have[c.name][..., :k] if c.axes[-1:] == ("k",) else have[c.name]
            for c in self.schema()
        }
        return type(self).of_columns(cut, self.watched, self.labels)

    def rows(self, lo: int, hi: int | None = None) -> TopKRows:
        """Tokens ``lo..hi`` (views)."""
        engine = self.engine.rows(lo, hi) if self.engine is not None else None
        columns = {name: t[lo:hi] for name, t in self.columns.items()}
        return type(self).of_columns(columns, engine, self.labels)

    def select(self, axis: str, at: Sequence[int], labels: Sequence[Any]) -> TopKRows:
        """The entries ``at`` of named axis ``axis`` in every column that has it, labelled
        ``labels`` (a request's heads of every head the worker read, its spans of the packed
        row's slots); ``watched`` stays the engine's."""
        index = torch.as_tensor(list(at), dtype=torch.int64)
        cut = {}
        for column in self.schema():
            t = self.columns[column.name]
            if axis in column.axes:
                t = t.index_select(1 + column.axes.index(axis), index)
            cut[column.name] = t
        return type(self).of_columns(cut, self.watched, {**self.labels, axis: labels})

    @classmethod
    def sizes_of(cls, packed_width: int, sizes: Mapping[str, int] | None = None) -> dict:
        """The axis sizes of packed rows: ``sizes`` (the instance's named axes, and the
        engine's ``"k"``); without ``"k"``, the k that the three-column layout of
        ``packed_width`` columns has (``[K, K, 1]``)."""
        sizes = dict(sizes or {})
        if "k" not in sizes:
            if cls.lead_axes or cls.extra_columns:
                raise ValueError(f"{cls.__name__} rows need their sizes (k, {cls.lead_axes})")
            sizes["k"] = (packed_width - 1) // 2
        return sizes

    @classmethod
    def unpack(
        cls, packed: torch.Tensor, k: int, sizes: Mapping[str, int] | None = None
    ) -> TopKRows:
        """From the worker's packed float32 rows ``[n, width]`` (:func:`~probehook.outputs.
        columns.pack_columns` of the schema, at the engine's K >= ``k``); ``sizes``: see
        :meth:`sizes_of`. Copies, so the packed tensor (an export's shared block) is not kept
        alive."""
        schema = cls.schema()
        views = unpack_columns(schema, packed, cls.sizes_of(packed.shape[-1], sizes))
        got = {c.name: views[c.name].to(c.dtype) if c.integer else views[c.name].clone()
               for c in schema}  # fmt: skip
        return cls.of_columns(got).top(k)

    @classmethod
    def empty(cls, k: int, sizes: Mapping[str, int] | None = None) -> TopKRows:
        """Zero tokens (``sizes``: the instance's named axes)."""
        shapes = {**(sizes or {}), "k": k}
        for axis in named_axes(cls.schema()):
            shapes.setdefault(axis, 0)
        return cls.of_columns(
            {c.name: torch.empty((0, *c.shape(shapes)), dtype=c.dtype) for c in cls.schema()}
        )

    @classmethod
    def cat(cls, pieces: Sequence[TopKRows]) -> TopKRows:
        if len(pieces) == 1:
            return pieces[0]
        engines = [p.engine for p in pieces]
        engine = cls.cat(engines) if all(e is not None for e in engines) else None  # type: ignore[arg-type]
        names = [c.name for c in cls.schema()]
        joined = {name: torch.cat([p.columns[name] for p in pieces]) for name in names}
        return type(pieces[0]).of_columns(joined, engine, pieces[0].labels)

    def to_dict(self) -> dict[str, list]:
        """JSON-ready lists (the server's form): every inf and NaN as None; ``"labels"``
        where a named axis has them."""
        out: dict[str, Any] = {
            name: json_floats(t) if t.is_floating_point() else t.tolist()
            for name, t in self.columns.items()
        }
        if self.labels:
            out[LABELS_KEY] = {axis: list(v) for axis, v in self.labels.items()}
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={len(self)}, k={self.k})"


@functools.cache
def _schema_of(rows: type[TopKRows]) -> tuple[Column, ...]:
    indices, values, scalar = rows.column_names
    lead = rows.lead_axes
    return (
        Column(indices, (*lead, "k"), torch.int64),
        Column(values, (*lead, "k"), torch.float32),
        Column(scalar, lead, rows.scalar_dtype),
        *rows.extra_columns,
    )


class TopKDecoder:
    """Decodes one stream's packed top-k rows once each: a cumulative stream asks for every
    row to date at every token, and gets views of what was decoded before plus the new rows
    decoded now (so a yield's cost does not grow with the tokens before it).

    Rows arrive as views of a growing, append-only buffer (the stream receiver's): positions
    already written never change, so the real columns are handed out as views of it too; only
    the integer columns (indices, l0) are converted, into buffers of their own.
    """

    def __init__(
        self,
        row_type: type[TopKRows] = TopKRows,
        sizes: Sequence[Mapping[str, int]] | None = None,
    ) -> None:
        """``sizes``: each slot's axis sizes (:meth:`TopKRows.sizes_of`; None: the
        three-column layout's, from the packed width)."""
        self.row_type = row_type
        self.schema = row_type.schema()
        self.sizes = sizes
        self.base = self.done = -1
        self._converted: list[dict[str, torch.Tensor]] | None = None  # per slot, by column
        self.converted = 0
        """Rows converted so far (the tests count them)."""

    def decode(self, packed: torch.Tensor, lo: int) -> list[TopKRows]:
        """``packed``: ``[slots, n, width]``, the rows of positions ``lo..lo + n`` (a view of
        the stream's buffer); one :class:`TopKRows` per slot at the engine's K, as views."""
        slots, n, width = packed.shape
        sizes = [
            self.row_type.sizes_of(width, self.sizes[slot] if self.sizes else None)
            for slot in range(slots)
        ]
        hi = lo + n
        if self._converted is None or lo < self.base or lo > self.done:
            self.base = self.done = lo  # a stream's spans start at its first position
            self._converted = None
        views = [unpack_columns(self.schema, packed[slot], sizes[slot]) for slot in range(slots)]
        if hi > self.done:
            self._grow(slots, hi - self.base, sizes)
            assert self._converted is not None
            new = slice(self.done - lo, None)
            at = slice(self.done - self.base, hi - self.base)
            for slot, buffers in enumerate(self._converted):
                for name, buffer in buffers.items():
                    buffer[at] = views[slot][name][new]
            self.converted += hi - self.done
            self.done = hi
        assert self._converted is not None
        at = slice(lo - self.base, hi - self.base)
        out = []
        for slot in range(slots):
            got = {c.name: (self._converted[slot][c.name][at] if c.integer
                            else views[slot][c.name]) for c in self.schema}  # fmt: skip
            out.append(self.row_type.of_columns(got))
        return out

    def _grow(self, slots: int, end: int, sizes: Sequence[Mapping[str, int]]) -> None:
        old = self._converted
        have = next(iter(old[0].values())).shape[0] if old and old[0] else 0
        if old is not None and end <= have:
            return
        capacity = max(end, 2 * have, 16)
        grown = []
        for slot in range(slots):
            buffers = {
                c.name: torch.empty((capacity, *c.shape(sizes[slot])), dtype=c.dtype)
                for c in self.schema
                if c.integer
            }
            if old is not None:
                # Views handed out earlier keep the old buffers alive and unchanged.
                kept = self.done - self.base
                for name, buffer in buffers.items():
                    buffer[:kept] = old[slot][name][:kept]
            grown.append(buffers)
        self._converted = grown


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
    """Top-k rows by name as base64 arrays (``decode_array``), every column of the schema:
    integers as int32, reals as float32 (about a third of the JSON lists' characters);
    ``non_finite`` as in :func:`json_top_k`."""
    from probehook.outputs.array_codec import encode_array

    out = {}
    for name, rows in value.items():
        out[name] = {
            column: encode_array(t.to(torch.float32 if t.is_floating_point() else torch.int32))
            for column, t in rows.columns.items()
        }
        if rows.labels:
            out[name][LABELS_KEY] = {axis: list(v) for axis, v in rows.labels.items()}
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
    """The tokens whose values, scalar (a lens's target log-prob) or further real columns
    hold an inf or a NaN: every non-finite number a served form writes as null is named."""
    bad: set[int] = set()
    for column in rows.columns.values():
        if column.is_floating_point():
            bad.update(non_finite_rows(column))
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
