"""SAE features in a store: sparse, three datasets per (phase, SAE, layout) in each shard.

    {phase}/sae_{name}/{layout}/indices  [rows, k]  uint16 when every index fits (d_sae < 65,535),
                                                    else uint32; padding (no feature) is the
                                                    type's max; k is the run's (a request that
                                                    kept fewer: padded)
    {phase}/sae_{name}/{layout}/values   [rows, k]  float32 (or float16: store_options sae_values)
    {phase}/sae_{name}/{layout}/l0       [rows, 1]  uint32 (a top-k readout whose scalar is
                                                    a real number, a lens's target log-prob:
                                                    float32)

``layout`` names what decides the datasets' shape and types: ``k{k}-{index type}-{value
type}``, e.g. ``k32-uint16-float32``, with ``-{scalar type}`` after it when the scalar is not
uint32 (a lens: ``k5-uint32-float32-float32``; :func:`layout_of`). A readout whose column
schema (``probehook.outputs.columns``) has lead axes stores ``[rows, *lead, k]`` entries and
``[rows, *lead]`` scalars, their sizes before the k (``4xk3-uint16-float32-float32``: a top-k
per head of 4); its further columns are datasets ``col_{name}`` (``[rows, *shape]``, a
per-token scalar ``[rows, 1]``), each named after a ``+`` with its type and shape
(``+mean-float32-1``). Runs that store one SAE name with
another d_sae (index type), k (width) or value type therefore never share a dataset, in a
writer's shard or in a compacted one; runs of the same layout do, whatever their SAE's
fingerprint (a segment's SAE is its record's run's description of that name).

The three are appended together, so a segment's ``start`` is the same row in each (a
compaction that merges shards keeps them in step: it appends whole datasets, and refuses a
group whose three are not). A request's record lists its feature segments under
``"sae_segments"`` (``phase``, ``completion``, the readout's ``source``, its stored name
(:data:`~probehook.outputs.top_k.SEGMENT_NAME_KEY`), ``layout``, ``k`` (the request's),
``first_position``, ``start``, ``count``), beside the row ``"segments"``; the run's record
describes each stored name (an SAE's fingerprint, k, layer and settings) under
:data:`~probehook.outputs.top_k.RUN_TOP_K_KEY`. A segment without a source (written before
stores held other top-k readouts) is :data:`~probehook.outputs.top_k.UNSOURCED`'s.

Stores written before layouts (before issue 43, item 6) have no ``layout`` in their segments and
keep the three datasets directly in ``{phase}/sae_{name}/``; they are read as they are, and a
compaction moves their rows into layout groups like any other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from probehook.errors import CaptureConfigError
from probehook.outputs.top_k import SEGMENT_NAME_KEY, UNSOURCED

PARTS = ("indices", "values", "l0")
"""The datasets every top-k group has; further columns are :data:`EXTRA_PREFIX` datasets."""
EXTRA_PREFIX = "col_"
VALUE_DTYPES = {"float32": np.float32, "float16": np.float16}


def check_values(value: str) -> str:
    """``store_options["sae_values"]``, checked."""
    if value not in VALUE_DTYPES:
        raise CaptureConfigError(
            f"store option sae_values={value!r} is not a stored value type; choose one of "
            f"{sorted(VALUE_DTYPES)} (float16: half the bytes, about 3 significant digits)."
        )
    return value


LAYOUT = re.compile(
    r"([0-9]+x)*k[0-9]+-[a-z]+[0-9]+-[a-z]+[0-9]+(-[a-z]+[0-9]+)?"
    r"(\+[a-z][a-z0-9_]*-[a-z]+[0-9]+-[0-9]+(x[0-9]+)*)*"
)
"""What :func:`layout_of` names look like (``k32-uint16-float32``, ``k5-uint32-float32-float32``
for a real-valued scalar, ``4xk3-uint16-float32-float32+mean-float32-1`` with lead axes and a
further column)."""


def layout_parts(layout: str | None) -> list[str]:
    """The datasets of a group of ``layout`` (None: a store written before layouts): the
    three, then each further column's."""
    extras = [] if layout is None else re.findall(r"\+([a-z][a-z0-9_]*)-", layout)
    return [*PARTS, *(EXTRA_PREFIX + name for name in extras)]


def feature_group(phase: str, sae: str, layout: str | None = None) -> str:
    """The HDF5 group of SAE ``sae``'s datasets of one layout (None: a store written before
    layouts, whose three datasets lie directly in ``{phase}/sae_{name}``)."""
    group = f"{phase}/sae_{sae}"
    return f"{group}/{layout}" if layout else group


def feature_dataset(phase: str, sae: str, part: str, layout: str | None = None) -> str:
    return f"{feature_group(phase, sae, layout)}/{part}"


def segment_group(segment: dict[str, Any]) -> str:
    """The group an SAE segment's rows lie in."""
    return feature_group(segment["phase"], segment[SEGMENT_NAME_KEY], segment.get("layout"))


def layout_of(parts: Mapping[str, Any]) -> str:
    """The layout of a group's stored arrays (or HDF5 datasets) by dataset name: lead axes,
    width, index type, value type, the scalar's type when it is not an SAE's uint32 ``l0`` (a
    lens's float32 target log-prob), and each further column's type and shape: everything
    that decides how their rows are laid out, so that no append ever casts one into another's
    type or shape."""
    indices, values, scalar = (parts[p] for p in PARTS)
    lead = "".join(f"{n}x" for n in indices.shape[1:-1])
    kinds = f"{np.dtype(indices.dtype).name}-{np.dtype(values.dtype).name}"
    layout = f"{lead}k{indices.shape[-1]}-{kinds}"
    kind = np.dtype(scalar.dtype)
    if kind != np.uint32:
        layout = f"{layout}-{kind.name}"
    for name in sorted(p for p in parts if p.startswith(EXTRA_PREFIX)):
        column = parts[name]
        shape = "x".join(str(n) for n in column.shape[1:])
        layout += f"+{name.removeprefix(EXTRA_PREFIX)}-{np.dtype(column.dtype).name}-{shape}"
    return layout


@dataclass
class FeatureBlock:
    """One top-k readout instance's rows of one (phase, completion) of a request."""

    phase: str
    completion: int | None
    stored_name: str
    """The instance's name in the store (``TopKReadout.stored_name``: an SAE's own,
    ``"lens:j@4"``)."""
    first_position: int
    features: object  # TopKRows (not imported: the store reads no readouts)
    source: str = UNSOURCED
    """The readout whose top-k rows these are."""

    @property
    def nbytes(self) -> int:
        """What the block holds in memory while it waits in the writer's queue."""
        parts = self.features.columns.values()  # type: ignore[attr-defined]
        return sum(int(t.numel() * t.element_size()) for t in parts)


def index_dtype(d_sae: int) -> type:
    """The smallest unsigned type that holds every index and the padding mark (its max)."""
    return np.uint16 if d_sae < np.iinfo(np.uint16).max else np.uint32


MAX_D_SAE = int(np.iinfo(np.uint32).max) - 1
"""The widest SAE a store holds: every index and the padding mark must fit in uint32."""


def to_storage(features: object, d_sae: int, k: int, values: str) -> dict[str, np.ndarray]:
    """The arrays of one block by dataset name, ``k`` wide (the run's k: a request that kept
    fewer is padded), ``values`` a key of :data:`VALUE_DTYPES`; further columns as
    :data:`EXTRA_PREFIX` arrays (a column with a k axis padded with 0; one with an axis of
    no entries, as attention's span masses of a request that named no span, is not stored: its
    rows read back from their labels)."""
    indices = features.indices.numpy()  # type: ignore[attr-defined]
    kept = features.values.numpy()  # type: ignore[attr-defined]
    width = indices.shape[-1]
    if width > k:
        raise ValueError(f"features {width} wide, over the run's k={k}")
    kind = index_dtype(d_sae)
    stored = np.full((*indices.shape[:-1], k), np.iinfo(kind).max, dtype=kind)
    stored[..., :width] = np.where(indices < 0, np.iinfo(kind).max, indices)
    stored_values = np.zeros((*indices.shape[:-1], k), dtype=VALUE_DTYPES[values])
    stored_values[..., :width] = kept
    out = {"indices": stored, "values": stored_values}
    out["l0"] = _per_row(_scalar(features.l0.numpy()))  # type: ignore[attr-defined]
    for column in features.schema()[3:]:  # type: ignore[attr-defined]
        array = features.extra[column.name].numpy()  # type: ignore[attr-defined]
        if column.axes[-1:] == ("k",) and array.shape[-1] < k:
            wide = np.zeros((*array.shape[:-1], k), dtype=array.dtype)
            wide[..., : array.shape[-1]] = array
            array = wide
        if all(array.shape[1:]):  # a zero-width column (no spans named): no dataset
            out[EXTRA_PREFIX + column.name] = _per_row(array)
    return out


def _per_row(column: np.ndarray) -> np.ndarray:
    """A per-token scalar ``[rows]`` as stored, ``[rows, 1]``; wider columns as they are."""
    return column.reshape(-1, 1) if column.ndim == 1 else column


def _scalar(column: np.ndarray) -> np.ndarray:
    """The per-token scalar as stored: an SAE's ``l0`` as uint32, a real number (a lens's
    target log-prob) as float32."""
    if np.issubdtype(column.dtype, np.floating):
        return column.astype(np.float32)
    return column.astype(np.uint32)


def from_storage(parts: Mapping[str, np.ndarray]) -> tuple:
    """``(indices int64 with -1 padding, values float32, scalar, further columns by name)``
    tensors from a group's arrays by dataset name; the scalar int64 (a real one, a lens's
    target log-prob, float32), ``[rows]`` without lead axes. Further columns keep their stored
    shape (``[rows, 1]`` for a per-token scalar: the row type reshapes them)."""
    indices, values, l0 = (parts[p] for p in PARTS)
    pad = np.iinfo(indices.dtype).max
    as_int = indices.astype(np.int64)
    as_int[indices == pad] = -1
    floating = np.issubdtype(l0.dtype, np.floating)
    scalar = l0.reshape(-1) if indices.ndim == 2 else l0
    extra = {
        name.removeprefix(EXTRA_PREFIX): torch.from_numpy(np.ascontiguousarray(array))
        for name, array in parts.items()
        if name.startswith(EXTRA_PREFIX)
    }
    return (
        torch.from_numpy(as_int),
        torch.from_numpy(values.astype(np.float32)),
        torch.from_numpy(scalar.astype(np.float32 if floating else np.int64)),
        extra,
    )
