"""Steering vectors in the form the front end sends them to the workers: each layer's rows as
raw float32 bytes (no pickle), the op and its parameters, and the bank's default capacity both
sides assume. No vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_CAPACITY = 64
"""The most named vectors an engine's steering bank holds at once, unless told otherwise."""


@dataclass
class VectorRows:
    """What the worker's bank holds of one vector (``probehook.core.steering_ops``): per layer
    the write vector ``w`` and, for every op but ``add``, the unit direction ``u`` it projects
    on; the op and its parameters (the cap's ``min``/``max``)."""

    writes: dict[int, np.ndarray]
    units: dict[int, np.ndarray] | None = None
    op: str = "add"
    params: dict[str, Any] = field(default_factory=dict)


def vector_rows(vector: Any) -> VectorRows:
    """A :class:`~probehook.steering.SteeringVector`'s rows: ``w = v`` for ``add``; ``u = w =
    v / |v|`` for ablate, cap, orthogonal, norm_scaled; ``u = from / |from|``, ``w = to / |to|
    - u`` for swap (norms in float64)."""
    op = vector.op
    if op == "add":
        return VectorRows({layer: _f32(vector.vector(layer)) for layer in vector.layers})
    units = {layer: _unit(vector.vector(layer)) for layer in vector.layers}
    if op == "swap":
        to = vector.swap_to
        writes = {layer: _unit(to[layer]) - units[layer] for layer in vector.layers}
    else:
        writes = {layer: units[layer].copy() for layer in vector.layers}
    return VectorRows(writes, units, op, dict(vector.op_params))


def _f32(vec: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(vec, dtype=np.float32))


def _unit(vec: Any) -> np.ndarray:
    v = np.asarray(vec, dtype=np.float64)
    return (v / np.linalg.norm(v)).astype(np.float32)


def vector_wire(vector: Any) -> dict[str, Any]:
    """A vector for the workers' RPC: ``{"layers": [...], "data": [w bytes per layer],
    "units": [u bytes per layer] or None, "op", "params"}`` (raw float32, no pickle)."""
    rows = vector_rows(vector)
    layers = list(rows.writes)
    units = rows.units
    return {
        "layers": layers,
        "data": [_f32(rows.writes[layer]).tobytes() for layer in layers],
        "units": None if units is None else [_f32(units[layer]).tobytes() for layer in layers],
        "op": rows.op,
        "params": rows.params,
    }


def vectors_from_wire(wire: Mapping[str, Any], hidden: int) -> VectorRows:
    """:func:`vector_wire`'s rows."""

    def arrays(data: Any) -> dict[int, np.ndarray]:
        return {
            int(layer): np.frombuffer(raw, dtype=np.float32).reshape(hidden)
            for layer, raw in zip(wire["layers"], data, strict=True)
        }

    units = wire.get("units")
    return VectorRows(arrays(wire["data"]), None if units is None else arrays(units),
                      str(wire.get("op", "add")), dict(wire.get("params") or {}))  # fmt: skip
