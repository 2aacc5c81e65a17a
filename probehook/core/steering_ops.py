"""Steering's ops as one form: every op a vector can apply is ``h += coef(h) * w`` with

    coef(h) = a + b * (h . u) + c * clamp(h . u, lo, hi) + d * |h|

for the residual row ``h`` after the layer, the vector's unit direction ``u`` and a write
vector ``w``. An op fixes ``u``, ``w`` and how ``(a, b, c, d)`` follow from the request's scale
``s`` (:data:`OP_CONSTANTS`: each coefficient is ``s * slope + offset``); the worker's op
(``probehook.worker.steer_op``) reads only those rows, so one op in the compiled graph applies
them all. With ``v`` the vector at a layer and ``u = v / |v|``:

=============  ===================================  ======================================
op             effect on h                          u, w
=============  ===================================  ======================================
add            h + s v                              -, v
ablate         h - s (h.u) u                        u, u
cap            h + s (clamp(h.u, min, max) - h.u) u u, u
orthogonal     h + (s - 1) (h.u) u                  u, u
norm_scaled    h + s |h| u                          u, u
swap           h + s (h.u_from) (u_to - u_from)     u_from, u_to - u_from
=============  ===================================  ======================================

No torch, no vLLM: the front end checks with it and both sides read the same table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

OPS = ("add", "ablate", "cap", "orthogonal", "norm_scaled", "swap")
"""Every op a steering vector may apply (``SteeringVector.with_op``; ``swap`` is made by
``SteeringVector.swap``)."""

SITE = "resid_post"
"""Where steering writes: the residual stream after the layer (where the taps read)."""

OP_CONSTANTS: dict[str, tuple[tuple[float, float], ...]] = {
    # ((a slope, a offset), (b ...), (c ...), (d ...)): coefficient = s * slope + offset
    "add": ((1.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)),
    "ablate": ((0.0, 0.0), (-1.0, 0.0), (0.0, 0.0), (0.0, 0.0)),
    "cap": ((0.0, 0.0), (-1.0, 0.0), (1.0, 0.0), (0.0, 0.0)),
    "orthogonal": ((0.0, 0.0), (1.0, -1.0), (0.0, 0.0), (0.0, 0.0)),
    "norm_scaled": ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (1.0, 0.0)),
    "swap": ((0.0, 0.0), (1.0, 0.0), (0.0, 0.0), (0.0, 0.0)),
}

SCALARS = 6
"""A term's scalars in the worker's table: ``a, b, c, d, lo, hi``."""


def row_scalars(op: str, params: Mapping[str, Any], scale: float) -> list[float]:
    """A term's ``[a, b, c, d, lo, hi]`` for ``op`` at scale ``scale`` (``lo``/``hi``: the
    cap's bounds, infinite where it has none)."""
    coefficients = [scale * slope + offset for slope, offset in OP_CONSTANTS[op]]
    lo, hi = params.get("min"), params.get("max")
    return [*coefficients, -math.inf if lo is None else float(lo),
            math.inf if hi is None else float(hi)]  # fmt: skip


def describe_op(op: str, params: Mapping[str, Any]) -> str:
    """``"cap(max=4)"``, ``"ablate"``: an op and its parameters in words (outputs, viewer)."""
    shown = [f"{k}={v:g}" for k, v in sorted(params.items()) if v is not None]
    return f"{op}({', '.join(shown)})" if shown else op
