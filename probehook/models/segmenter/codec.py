"""The tiny segmenter without vLLM: how pixels become token ids, and the network in plain torch.

A pixel of ``channels`` values in ``[0, 1]`` is quantised to ``levels`` steps per channel and
written as one token id (``sum(level_c * levels**c)``), so a patch is an ordinary token
prompt: vLLM's scheduler, batching and capture see nothing unusual. The network reads each
pixel on its own (an MLP with residual blocks; a toy, not a vision transformer) and gives one
class per pixel: 0 background (dark), 1 red, 2 green, 3 blue: whichever channel dominates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "tiny-segmenter"
CLASSES = ("background", "red", "green", "blue")


@dataclass(frozen=True)
class SegmenterSpec:
    """The shape of the network and of its input, as written in its ``config.json``."""

    channels: int = 3
    levels: int = 16
    patch_size: int = 8
    hidden_size: int = 32
    num_hidden_layers: int = 3
    num_labels: int = len(CLASSES)

    @classmethod
    def from_config(cls, config: Any) -> SegmenterSpec:
        """From a ``config.json`` dict or a transformers config object."""
        get = config.get if isinstance(config, dict) else lambda k, d: getattr(config, k, d)
        return cls(**{f: get(f, getattr(cls, f)) for f in cls.__dataclass_fields__})


def segmenter_path() -> Path:
    """Directory of the bundled tiny segmenter (weights trained by
    ``scripts/build_tiny_segmenter.py``)."""
    if not (ASSET_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"The bundled tiny segmenter is missing from {ASSET_DIR}. Reinstall probehook, "
            "or rebuild it with `python scripts/build_tiny_segmenter.py`."
        )
    return ASSET_DIR


def load_spec(path: str | Path | None = None) -> SegmenterSpec:
    return SegmenterSpec.from_config(
        json.loads((Path(path or segmenter_path()) / "config.json").read_text())
    )


def pixels_to_ids(pixels: np.ndarray, spec: SegmenterSpec) -> list[int]:
    """Token ids of ``pixels`` (``[..., channels]`` floats in ``[0, 1]``), in row-major order."""
    levels = np.clip(np.rint(pixels * (spec.levels - 1)), 0, spec.levels - 1).astype(np.int64)
    weights = spec.levels ** np.arange(spec.channels, dtype=np.int64)
    return (levels.reshape(-1, spec.channels) @ weights).tolist()


def ids_to_pixels(ids: torch.Tensor, spec: SegmenterSpec) -> torch.Tensor:
    """``[n, channels]`` quantised pixel values of token ids (inverse of :func:`pixels_to_ids`)."""
    ids = ids.long().unsqueeze(-1)
    steps = spec.levels ** torch.arange(spec.channels, device=ids.device)
    return ((ids // steps) % spec.levels).float() / (spec.levels - 1)


class Block(nn.Module):
    """One residual block; its output is the residual stream probehook captures."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class SegmenterNet(nn.Module):
    """Token ids -> per-pixel class logits. ``layers[i]`` returns the stream after block i."""

    def __init__(self, spec: SegmenterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Linear(spec.channels, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec.hidden_size) for _ in range(spec.num_hidden_layers))
        self.norm = nn.LayerNorm(spec.hidden_size)
        self.head = nn.Linear(spec.hidden_size, spec.num_labels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.stream(ids)[-1]))

    def stream(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The residual stream after each block (what capture returns per layer)."""
        x = self.embed(ids_to_pixels(ids, self.spec).to(self.embed.weight.dtype))
        out = []
        for layer in self.layers:
            x = layer(x)
            out.append(x)
        return out


def load_reference(path: str | Path | None = None) -> SegmenterNet:
    """The bundled network in plain torch (float32), for checking what vLLM computes."""
    from safetensors.torch import load_file

    path = Path(path or segmenter_path())
    net = SegmenterNet(load_spec(path))
    state = load_file(path / "model.safetensors")
    net.load_state_dict({k.removeprefix("encoder."): v for k, v in state.items()})
    return net.eval()


def label_pixels(pixels: np.ndarray, threshold: float = 0.3) -> np.ndarray:
    """The rule the network was trained to follow (ground truth for the synthetic data)."""
    dominant = pixels.argmax(-1) + 1
    return np.where(pixels.max(-1) < threshold, 0, dominant)
