"""probehook's own output processors: the residual-stream rows, probe results and steering that
probehook attaches to outputs. Registered in ``OUTPUT_PROCESSORS`` like any other processor.

This module knows nothing about vLLM.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from probehook.outputs.array_codec import decode_array, encode_array
from probehook.outputs.registry import MonitorFlags, OutputProcessor
from probehook.outputs.top_k import json_floats, json_nans


def _concat_by_key(pieces: list[dict[Any, torch.Tensor]]) -> dict[Any, torch.Tensor]:
    keys = list(dict.fromkeys(k for piece in pieces for k in piece))
    out = {}
    for key in keys:
        parts = [piece[key] for piece in pieces if key in piece]
        out[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


class HiddenStates(OutputProcessor):
    """Residual-stream rows by layer: ``[rows, hidden]`` tensors; base64 arrays online."""

    name: ClassVar[str] = "hidden_states"
    request_attributes = ("prefill_hidden_states",)
    completion_attributes = ("hidden_states",)
    source = "hidden"

    def merge(self, pieces: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
        return _concat_by_key(pieces)

    def to_response(self, value: dict[int, torch.Tensor]) -> dict[str, Any]:
        return {str(layer): encode_array(rows) for layer, rows in value.items()}

    def from_response(self, response: dict[str, Any]) -> dict[int, torch.Tensor]:
        return {int(k): torch.from_numpy(decode_array(v).copy()) for k, v in response.items()}


class ProbeScores(OutputProcessor):
    """Probe scores by probe name, one per token (a row of class probabilities for a
    multi-class probe); lists of floats online."""

    name: ClassVar[str] = "probe_scores"
    request_attributes = ("prefill_probe_scores",)
    completion_attributes = ("probe_scores",)
    source = "scores"

    def merge(self, pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return _concat_by_key(pieces)

    def to_response(self, value: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {name: json_floats(scores) for name, scores in value.items()}

    def from_response(self, response: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {
            name: torch.tensor(json_nans(scores), dtype=torch.float32)
            for name, scores in response.items()
        }


class ProbeFlags(MonitorFlags):
    """The rows where a flag monitor's threshold was crossed, by probe name."""

    def __init__(self) -> None:
        super().__init__("probe_flags")


class Steering(OutputProcessor):
    """Which steering applied to a completion: ``{"vectors": {name: scale}, "phase", "start"}``
    (plus ``"gate"`` for probe-gated steering); None when it was not steered. Online the same
    dict, in each streamed chunk's field (a gate's ``start`` appears once it crossed)."""

    name: ClassVar[str] = "steering"
    completion_attributes = ("steering",)

    def empty(self) -> Any:
        return None

    def merge(self, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        return pieces[-1]  # every piece describes the whole completion; the last is newest


BUILTIN = (
    HiddenStates,
    ProbeScores,
    ProbeFlags,
    Steering,
)
