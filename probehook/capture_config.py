"""Capture options: which layers and which phases, for the engine and for one request."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from probehook.errors import CaptureConfigError

LayerSpec = Sequence[int] | str


def resolve_layers(layers: LayerSpec, num_layers: int) -> tuple[int, ...]:
    """Turn ``[1, -1]``, ``"all"`` or ``["all"]`` into sorted, unique, non-negative indices.

    Any integer type works (``numpy.int64`` from ``np.arange``, for instance).
    """
    if not isinstance(layers, str) and isinstance(layers, Sequence) and list(layers) == ["all"]:
        layers = "all"
    if isinstance(layers, str):
        if layers != "all":
            raise CaptureConfigError(
                f"layers={layers!r} is not valid: pass a list of ints in "
                f"-{num_layers}..{num_layers - 1} or the string 'all'."
            )
        return tuple(range(num_layers))
    if hasattr(layers, "tolist"):  # a numpy array or a tensor of layer indices
        layers = layers.tolist()
    if not isinstance(layers, Sequence) or len(layers) == 0:
        raise CaptureConfigError(
            f"layers={layers!r} is not valid: pass a non-empty list of ints in "
            f"-{num_layers}..{num_layers - 1}, or 'all'."
        )
    resolved = set()
    for item in layers:
        layer = as_int(item)
        if layer is None:
            raise CaptureConfigError(
                f"layer {item!r} is not an int; layers must be ints in "
                f"-{num_layers}..{num_layers - 1} or 'all'."
            )
        if not -num_layers <= layer < num_layers:
            raise CaptureConfigError(
                f"layer {layer} is out of range for a model with {num_layers} layers; "
                f"valid layers are 0..{num_layers - 1} (or -{num_layers}..-1 from the end)."
            )
        resolved.add(layer % num_layers)
    return tuple(sorted(resolved))


def as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer of any type (numpy ones too), else None;
    ``bool`` is not a layer index."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def parse_layers(text: str) -> list[int] | str:
    """The value of a command line's ``--layers`` (``probehook capture``, ``probehook serve``):
    ``"1,3"`` or ``"all"``; exits with a usage error otherwise."""
    if text == "all":
        return "all"
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(
            f"error: --layers {text!r} must be comma-separated ints or 'all'"
        ) from None


@dataclass(frozen=True)
class CaptureConfig:
    """What an engine captures. Requests may narrow it, never widen it."""

    layers: tuple[int, ...]
    """Decoder layers whose output residual stream is captured (resolved, ascending)."""
    include_prefill: bool = False
    """Capture one row per prompt token (``RequestOutput.prefill_hidden_states``)."""
    include_decode: bool = True
    """Capture one row per generated token (``CompletionOutput.hidden_states``)."""
    last_prefill_token: bool = False
    """Keep only the last prompt row of the prefill capture."""
    last_decode_token: bool = False
    """Keep only the last decode row."""

    def __post_init__(self) -> None:
        if not (self.include_prefill or self.include_decode):
            raise CaptureConfigError(
                "include_prefill and include_decode are both False, so nothing would be "
                "captured; set at least one of them to True (or pass layers=None to "
                "disable capture)."
            )
        for name in (
            "include_prefill",
            "include_decode",
            "last_prefill_token",
            "last_decode_token",
        ):
            if not isinstance(getattr(self, name), bool):
                raise CaptureConfigError(f"{name}={getattr(self, name)!r} must be True or False.")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaptureConfig:
        return cls(**{**d, "layers": tuple(d["layers"])})

    def narrow(self, options: Mapping[str, Any] | None) -> CaptureConfig | None:
        """Apply a request's ``extra_args["probehook"]`` options; reject widening.

        Returns None when the request switches capture off (both phases False).
        """
        if not options:
            return self
        known = {f.name for f in fields(self)}
        unknown = set(options) - known
        if unknown:
            raise CaptureConfigError(
                f"Unknown per-request capture option(s) {sorted(map(str, unknown))}; valid "
                f"options are {sorted(known)}."
            )
        merged = {**self.to_dict(), **options}
        layers = merged["layers"]
        if isinstance(layers, str) and layers == "all":
            layers = list(self.layers)
        if isinstance(layers, int) or not isinstance(layers, Sequence):
            raise CaptureConfigError(
                f"Per-request layers={layers!r} must be a list of ints from the engine's "
                f"layers {list(self.layers)}."
            )
        wanted = []
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise CaptureConfigError(f"Per-request layer {layer!r} is not an int.")
            # Negative indices only make sense against the model depth, which requests
            # don't know; accept them only when they name an engine layer unambiguously.
            if layer < 0 or layer not in self.layers:
                raise CaptureConfigError(
                    f"Per-request layer {layer} was not captured by this engine; it was "
                    f"built with layers={list(self.layers)}. Ask for a subset of those, or "
                    f"build the LLM with the layer included."
                )
            wanted.append(layer)
        if merged["include_prefill"] and not self.include_prefill:
            raise CaptureConfigError(
                "This request asks for include_prefill=True but the engine was built with "
                "include_prefill=False; build the LLM with include_prefill=True to allow it."
            )
        if merged["include_decode"] and not self.include_decode:
            raise CaptureConfigError(
                "This request asks for include_decode=True but the engine was built with "
                "include_decode=False; build the LLM with include_decode=True to allow it."
            )
        if not (merged["include_prefill"] or merged["include_decode"]):
            return None
        return CaptureConfig(
            layers=tuple(sorted(set(wanted))),
            include_prefill=merged["include_prefill"],
            include_decode=merged["include_decode"],
            last_prefill_token=merged["last_prefill_token"],
            last_decode_token=merged["last_decode_token"],
        )
