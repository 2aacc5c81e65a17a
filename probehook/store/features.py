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
uint32 (a lens: ``k5-uint32-float32-float32``; :func:`layout_of`). Runs that store one SAE name with
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from probehook.errors import CaptureConfigError
from probehook.outputs.top_k import SEGMENT_NAME_KEY, UNSOURCED

PARTS = ("indices", "values", "l0")
VALUE_DTYPES = {"float32": np.float32, "float16": np.float16}


def check_values(value: str) -> str:
    """``store_options["sae_values"]``, checked."""
    if value not in VALUE_DTYPES:
        raise CaptureConfigError(
            f"store option sae_values={value!r} is not a stored value type; choose one of "
            f"{sorted(VALUE_DTYPES)} (float16: half the bytes, about 3 significant digits)."
        )
    return value


LAYOUT = re.compile(r"k[0-9]+-[a-z]+[0-9]+-[a-z]+[0-9]+(-[a-z]+[0-9]+)?")
"""What :func:`layout_of` names look like (``k32-uint16-float32``, ``k5-uint32-float32-float32``
for a real-valued scalar)."""


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


def layout_of(indices: Any, values: Any, scalar: Any) -> str:
    """The layout of stored ``indices``, ``values`` and per-token ``scalar`` (arrays or HDF5
    datasets): width, index type, value type and, when it is not an SAE's uint32 ``l0`` (a
    lens's float32 target log-prob), the scalar's type: everything that decides how their
    rows are laid out, so that no append ever casts one into another's type."""
    layout = f"k{indices.shape[1]}-{np.dtype(indices.dtype).name}-{np.dtype(values.dtype).name}"
    kind = np.dtype(scalar.dtype)
    return layout if kind == np.uint32 else f"{layout}-{kind.name}"


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
        f = self.features
        parts = (f.indices, f.values, f.l0)  # type: ignore[attr-defined]
        return sum(int(t.numel() * t.element_size()) for t in parts)


def index_dtype(d_sae: int) -> type:
    """The smallest unsigned type that holds every index and the padding mark (its max)."""
    return np.uint16 if d_sae < np.iinfo(np.uint16).max else np.uint32


MAX_D_SAE = int(np.iinfo(np.uint32).max) - 1
"""The widest SAE a store holds: every index and the padding mark must fit in uint32."""


def to_storage(features: object, d_sae: int, k: int, values: str) -> dict[str, np.ndarray]:
    """The three arrays of one block, ``k`` wide (the run's k: a request that kept fewer is
    padded), ``values`` a key of :data:`VALUE_DTYPES`."""
    indices = features.indices.numpy()  # type: ignore[attr-defined]
    kept = features.values.numpy()  # type: ignore[attr-defined]
    if indices.shape[1] > k:
        raise ValueError(f"features {indices.shape[1]} wide, over the run's k={k}")
    kind = index_dtype(d_sae)
    stored = np.full((len(indices), k), np.iinfo(kind).max, dtype=kind)
    stored[:, : indices.shape[1]] = np.where(indices < 0, np.iinfo(kind).max, indices)
    stored_values = np.zeros((len(indices), k), dtype=VALUE_DTYPES[values])
    stored_values[:, : indices.shape[1]] = kept
    return {
        "indices": stored,
        "values": stored_values,
        "l0": _scalar(features.l0.numpy()).reshape(-1, 1),  # type: ignore[attr-defined]
    }


def _scalar(column: np.ndarray) -> np.ndarray:
    """The per-token scalar as stored: an SAE's ``l0`` as uint32, a real number (a lens's
    target log-prob) as float32."""
    if np.issubdtype(column.dtype, np.floating):
        return column.astype(np.float32)
    return column.astype(np.uint32)


def from_storage(indices: np.ndarray, values: np.ndarray, l0: np.ndarray) -> tuple:
    """``(indices int64 with -1 padding, values float32, l0 int64)`` tensors (a float scalar,
    a lens's target log-prob, comes back float32)."""
    pad = np.iinfo(indices.dtype).max
    as_int = indices.astype(np.int64)
    as_int[indices == pad] = -1
    floating = np.issubdtype(l0.dtype, np.floating)
    return (
        torch.from_numpy(as_int),
        torch.from_numpy(values.astype(np.float32)),
        torch.from_numpy(l0.reshape(-1).astype(np.float32 if floating else np.int64)),
    )
