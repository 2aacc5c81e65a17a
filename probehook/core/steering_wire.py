"""Steering vectors in the form the front end sends them to the workers: one layer's vector
as raw float32 bytes (no pickle), and the bank's default capacity both sides assume. No vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

DEFAULT_CAPACITY = 64
"""The most named vectors an engine's steering bank holds at once, unless told otherwise."""


def vector_wire(vector: Any) -> dict[str, Any]:
    """A vector for the workers' RPC: ``{"layers": [...], "data": [raw float32 bytes per
    layer]}`` (no pickle)."""
    layers = list(vector.layers)
    return {
        "layers": layers,
        "data": [
            np.ascontiguousarray(vector.vector(layer).numpy(), dtype=np.float32).tobytes()
            for layer in layers
        ],
    }


def vectors_from_wire(wire: Mapping[str, Any], hidden: int) -> dict[int, np.ndarray]:
    return {
        int(layer): np.frombuffer(data, dtype=np.float32).reshape(hidden)
        for layer, data in zip(wire["layers"], wire["data"], strict=True)
    }
