"""A probe as the worker sees it, and the layout of its scores: the form in which the front end
hands probes to the worker (plain arrays, in the bank file the loader reads at load:
``probehook.core.bank_file``), and the column order both sides compute the same way. No
vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ACTIVATIONS = ("sigmoid", "softmax", "identity")

SCORES_SLOT = "scores"
"""The one output slot of the worker's score recorder (a hidden-row recorder's slots are
layers): what the front end's exports of scores name."""


@dataclass(frozen=True)
class ProbeSpec:
    """One probe as the worker sees it: ``activation(rows @ weight.T + bias)``."""

    name: str
    layer: int
    weight: np.ndarray  # float32 [outputs, hidden], normalisation folded in
    bias: np.ndarray  # float32 [outputs]
    activation: str  # "sigmoid" (binary), "softmax" (multiclass), "identity" (regression)


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
