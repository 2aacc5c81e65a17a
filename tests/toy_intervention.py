"""A test-only intervention: scale the residual stream at a layer's input (``resid_pre(L)``;
layer 0's is the embeddings) by a request's factor ``c``. The proof that an intervention is
one module plus one registration line (``OUTPUT_PROCESSORS.register(RowScale)``, or the entry
point ``row_scale = toy_intervention:RowScale`` in ``probehook.output_processors``): nothing in
probehook names it, and it reaches offline outputs, streams, the server, the store and the
viewer (what it applied: ``completion.steering["scale"]``).

- engine option ``scale_layers=[1, 3]`` (served: the generated flag ``--scale-layers``): one
  instance a layer, named ``"L1"``, ``"L3"``;
- request option ``{"scale": 0.5}`` (every instance) or ``{"scale": {"L1": 0.5}}``;
- worker kind ``"scale"``: ``stream *= c`` on the request's tokens (a per-slot factor table
  whose row 0 is 1: other requests' rows untouched)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from probehook.errors import CaptureConfigError
from probehook.outputs.intervention import EngineFacts, Intervention
from probehook.worker.write_op import WRITE_KINDS, write_kind
from probehook.worker.write_table import InstanceWriter, WriterContext


class RowScale(Intervention):
    name = "row_scale"
    engine_option = "scale_layers"
    request_option = "scale"
    kind = "scale"
    worker_writer = "toy_intervention:scale_writers"
    cli_help = "layers whose input requests may scale (a JSON list)"

    def instances(self, value: Any, engine: EngineFacts) -> dict[str, dict[str, Any]]:
        if not isinstance(value, Sequence) or isinstance(value, str) or not value:
            raise CaptureConfigError(
                f"scale_layers={value!r} is not valid: pass a non-empty list of layers."
            )
        return {f"L{layer}": {"layer": layer, "site": "resid_pre"} for layer in value}

    def check_terms(self, value: Any, instances: Mapping[str, Mapping[str, Any]]) -> dict:
        by = value if isinstance(value, Mapping) else dict.fromkeys(instances, value)
        out = {}
        for name, factor in by.items():
            if name not in instances:
                raise CaptureConfigError(
                    f"scale names {name!r}; this engine scales {sorted(instances)}."
                )
            if isinstance(factor, bool) or not isinstance(factor, int | float):
                raise CaptureConfigError(f"scale[{name!r}]={factor!r} is not a number.")
            if not math.isfinite(factor):
                raise CaptureConfigError(f"scale[{name!r}]={factor!r} is not finite.")
            out[name] = float(factor)
        return dict(sorted(out.items()))

    def mark(self, applied: Any) -> str:
        return ", ".join(f"scaled the input of {n} by {c:g}" for n, c in applied.items())


def scale(
    hidden: torch.Tensor, residual: torch.Tensor | None, tensors: Sequence[torch.Tensor], _: str
) -> None:
    """``stream[t] *= factors[index[t]]``, where the stream is ``hidden + residual``: adding
    ``(c - 1) * stream`` to ``hidden`` scales their sum."""
    index, factors = tensors
    stream = hidden if residual is None else hidden + residual
    c = factors.index_select(0, index[: hidden.shape[0]]).to(hidden.dtype)
    hidden.add_((c - 1).unsqueeze(1) * stream)


if "scale" not in WRITE_KINDS:
    write_kind("scale")(scale)


class ScaleWriter(InstanceWriter):
    kind = "scale"
    site = "resid_pre"

    def __init__(self, layer: int, slots: int, device: torch.device) -> None:
        self.layer = layer
        self.buffers = {"factors": torch.ones(slots, dtype=torch.float32, device=device)}

    def plan(self, terms: Any) -> float:
        return float(terms)

    def write_row(self, row: int, plan: float) -> None:
        self.buffers["factors"][row] = plan


def scale_writers(
    entry: Any, instances: Mapping[str, Mapping[str, Any]], context: WriterContext
) -> dict[str, ScaleWriter]:
    return {
        name: ScaleWriter(int(s["layer"]), context.slots, context.device)
        for name, s in instances.items()
    }
