"""A probe as the worker sees it, and the layout of its scores: the form in which the front end
sends probes to the worker (plain arrays, raw float32 bytes over vLLM's RPC, no pickle), and
the column order both sides compute the same way. No vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ACTIVATIONS = ("sigmoid", "softmax", "identity")


@dataclass(frozen=True)
class ProbeSpec:
    """One probe as the worker sees it: ``activation(rows @ weight.T + bias)``."""

    name: str
    layer: int
    weight: np.ndarray  # float32 [outputs, hidden], normalisation folded in
    bias: np.ndarray  # float32 [outputs]
    activation: str  # "sigmoid" (binary), "softmax" (multiclass), "identity" (regression)

    def to_wire(self) -> dict[str, Any]:
        """Plain values for vLLM's RPC (raw float32 bytes, no pickle)."""
        return {
            "name": self.name,
            "layer": self.layer,
            "shape": list(self.weight.shape),
            "weight": np.ascontiguousarray(self.weight, dtype=np.float32).tobytes(),
            "bias": np.ascontiguousarray(self.bias, dtype=np.float32).tobytes(),
            "activation": self.activation,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ProbeSpec:
        outputs, hidden = (int(x) for x in d["shape"])
        weight = np.frombuffer(d["weight"], dtype=np.float32).reshape(outputs, hidden)
        bias = np.frombuffer(d["bias"], dtype=np.float32).reshape(outputs)
        if d["activation"] not in ACTIVATIONS:
            raise ValueError(f"activation {d['activation']!r}; valid: {ACTIVATIONS}")
        return cls(str(d["name"]), int(d["layer"]), weight, bias, str(d["activation"]))


@dataclass(frozen=True)
class ColumnRange:
    """Where one probe's scores sit in a score row: columns ``lo:hi``."""

    lo: int
    hi: int


def columns_of(specs: Sequence[ProbeSpec]) -> dict[str, ColumnRange]:
    """The score columns of each probe, in the order the bank lays them out (by layer, then
    by the order given). Front end and worker both call this, so they agree."""
    out: dict[str, ColumnRange] = {}
    col = 0
    for spec in sorted(specs, key=lambda s: s.layer):
        width = spec.weight.shape[0]
        out[spec.name] = ColumnRange(col, col + width)
        col += width
    return out
