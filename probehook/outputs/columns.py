"""The column schema of a readout's rows: named columns, each with its axes and dtype, from
which the worker's packed rows, their decoding, the served JSON and base64 forms and the
store's datasets all follow.

A column's axes come after the token axis. Each is ``"k"`` (the top-k width: the engine's in
the packed rows, a request's on its outputs), the name of an instance setting holding its size
(``"heads"``: ``settings["heads"]``), or a fixed int. A top-k readout's first three columns
are its entries' indices and values (last axis ``"k"``) and a scalar per token; lead axes
(``("heads",)``) put one top-k per head; further columns carry whatever else a token has (a
second scalar, span masses per head).

Packed rows are float32 ``[n, width]``: the columns one after the other, each flattened, the
integer ones as the bits of int32 (:func:`~probehook.outputs.top_k.carry_indices`). No vLLM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

COLUMN_NAME = re.compile(r"[a-z][a-z0-9_]*")
"""What a column's name looks like: a JSON key, a store dataset's name and a Python
attribute alike."""
COLUMN_DTYPES = (torch.int32, torch.int64, torch.float32)
"""The dtypes a column may have: the packed rows carry integers as int32 bits, reals as
float32 (an int64 column holds values within int32)."""


@dataclass(frozen=True)
class Column:
    """One named column of a readout's rows: ``[n, *shape]`` of ``dtype``."""

    name: str
    axes: tuple[str | int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not COLUMN_NAME.fullmatch(self.name):
            raise ValueError(
                f"column name {self.name!r} is not valid: use lower-case letters, digits and "
                "underscores, starting with a letter."
            )
        if self.dtype not in COLUMN_DTYPES:
            raise ValueError(
                f"column {self.name!r} has dtype {self.dtype}; choose one of {COLUMN_DTYPES}."
            )
        for axis in self.axes:
            fixed = isinstance(axis, int) and not isinstance(axis, bool) and axis >= 1
            if not fixed and not (isinstance(axis, str) and COLUMN_NAME.fullmatch(axis)):
                raise ValueError(
                    f"column {self.name!r}'s axis {axis!r} is not valid: pass 'k', the name of "
                    "an instance setting that holds the axis's size, or an int >= 1."
                )

    @property
    def integer(self) -> bool:
        return not self.dtype.is_floating_point

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Its shape after the token axis, its named axes' sizes from ``sizes``."""
        try:
            return tuple(axis if isinstance(axis, int) else int(sizes[axis]) for axis in self.axes)
        except KeyError as e:
            raise ValueError(
                f"column {self.name!r} has axis {e.args[0]!r}, which no size names "
                f"(sizes: {dict(sizes)})"
            ) from None

    def width(self, sizes: Mapping[str, int]) -> int:
        """How many packed float32 columns it takes."""
        return math.prod(self.shape(sizes))


def packed_width(columns: Sequence[Column], sizes: Mapping[str, int]) -> int:
    """The packed rows' width: every column's, in order."""
    return sum(column.width(sizes) for column in columns)


def named_axes(columns: Sequence[Column]) -> tuple[str, ...]:
    """The names of the columns' axes other than ``"k"`` (instance settings), in order."""
    out: dict[str, None] = {}
    for column in columns:
        for axis in column.axes:
            if isinstance(axis, str) and axis != "k":
                out[axis] = None
    return tuple(out)


def pack_columns(columns: Sequence[Column], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values`` (one ``[n, *shape]`` tensor per column, in order) as packed float32 rows
    ``[n, width]``: integers as int32 bits, reals as float32."""
    if len(values) != len(columns):
        raise ValueError(f"{len(values)} values for columns {[c.name for c in columns]}")
    n = values[0].shape[0]
    parts = []
    for column, value in zip(columns, values, strict=True):
        flat = value.reshape(n, -1)
        parts.append(flat.to(torch.int32).view(torch.float32) if column.integer else flat.float())
    return torch.cat(parts, dim=1)


def column_spans(columns: Sequence[Column], sizes: Mapping[str, int]) -> dict[str, slice]:
    """Where each column lies in a packed row."""
    spans, at = {}, 0
    for column in columns:
        width = column.width(sizes)
        spans[column.name] = slice(at, at + width)
        at += width
    return spans


def unpack_columns(
    columns: Sequence[Column], packed: torch.Tensor, sizes: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Packed rows ``[..., width]`` (wider is allowed: padding past the columns) -> each
    column ``[..., *shape]``, as views of ``packed``: the integer ones as int32 (views of the
    bits; convert before keeping them past ``packed``), the real ones as float32."""
    lead = packed.shape[:-1]
    spans = column_spans(columns, sizes)
    out = {}
    for column in columns:
        part = packed[..., spans[column.name]]
        if column.integer:
            part = part.view(torch.int32)
        out[column.name] = part.reshape(*lead, *column.shape(sizes))
    return out


def pad_packed(
    columns: Sequence[Column], out: torch.Tensor, sizes: Mapping[str, int], index: str
) -> None:
    """Fill packed rows ``out`` as no reading: every column 0, column ``index`` (a top-k's
    indices) -1. In place."""
    out.zero_()
    out[..., column_spans(columns, sizes)[index]].view(torch.int32).fill_(-1)


def join_packed(
    columns: Sequence[Column], pieces: Sequence[torch.Tensor], sizes: Mapping[str, int], axis: str
) -> torch.Tensor:
    """Packed rows of the same tokens, each holding a slice of named axis ``axis`` (a
    tensor-parallel rank's heads; ``sizes``: a slice's axis sizes), as one packed row of the
    whole axis, the slices in order. Columns without the axis are the first piece's."""
    views = [unpack_columns(columns, piece, sizes) for piece in pieces]
    joined = [
        torch.cat([v[c.name] for v in views], dim=1 + c.axes.index(axis))
        if axis in c.axes
        else views[0][c.name]
        for c in columns
    ]
    return pack_columns(columns, joined)
