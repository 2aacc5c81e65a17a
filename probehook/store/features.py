"""SAE features in a store: sparse, three datasets per (phase, SAE) in each shard.

    {phase}/sae_{name}/indices  [rows, k]  uint16 when every index fits (d_sae < 65,535),
                                           else uint32; padding (no feature) is the type's max;
                                           k is the run's (a request that kept fewer: padded)
    {phase}/sae_{name}/values   [rows, k]  float32 (or float16: store_options sae_values)
    {phase}/sae_{name}/l0       [rows, 1]  uint32

The three are appended together, so a segment's ``start`` is the same row in each (a
compaction that merges shards keeps them in step: it appends whole datasets). A request's
record lists its feature segments under ``"sae_segments"`` (``phase``, ``completion``,
``sae``, ``k`` (the request's), ``first_position``, ``start``, ``count``), beside the row
``"segments"``; the run's record names each SAE's fingerprint, k, layer and settings under
``"saes"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from probehook.errors import CaptureConfigError

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


def feature_dataset(phase: str, sae: str, part: str) -> str:
    return f"{phase}/sae_{sae}/{part}"


@dataclass
class FeatureBlock:
    """SAE ``sae``'s features of one (phase, completion) of a request."""

    phase: str
    completion: int | None
    sae: str
    first_position: int
    features: object  # probehook.saes.SAEFeatures (not imported: the store reads no SAEs)

    @property
    def nbytes(self) -> int:
        """What the block holds in memory while it waits in the writer's queue."""
        f = self.features
        parts = (f.indices, f.values, f.l0)  # type: ignore[attr-defined]
        return sum(int(t.numel() * t.element_size()) for t in parts)


def index_dtype(d_sae: int) -> type:
    """The smallest unsigned type that holds every index and the padding mark (its max)."""
    return np.uint16 if d_sae < np.iinfo(np.uint16).max else np.uint32


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
        "l0": features.l0.numpy().astype(np.uint32).reshape(-1, 1),  # type: ignore[attr-defined]
    }


def from_storage(indices: np.ndarray, values: np.ndarray, l0: np.ndarray) -> tuple:
    """``(indices int64 with -1 padding, values float32, l0 int64)`` tensors."""
    pad = np.iinfo(indices.dtype).max
    as_int = indices.astype(np.int64)
    as_int[indices == pad] = -1
    return (
        torch.from_numpy(as_int),
        torch.from_numpy(values.astype(np.float32)),
        torch.from_numpy(l0.reshape(-1).astype(np.int64)),
    )
