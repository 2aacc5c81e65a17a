"""Lens files (provisional minimal reader; replaced by the full module)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from probehook.errors import CaptureConfigError


class JacobianLens:
    kind = "jacobian"

    def __init__(self, jacobians: dict[int, torch.Tensor], *, n_prompts: int, d_model: int,
                 metadata: dict | None = None, path: str | None = None) -> None:  # fmt: skip
        self.jacobians = {int(k): v.float() for k, v in jacobians.items()}
        self.n_prompts = n_prompts
        self.d_model = d_model
        self.metadata = dict(metadata or {})
        self.path = path

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.jacobians)

    @classmethod
    def load(cls, path: str | Path) -> JacobianLens:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        return cls(payload["J"], n_prompts=int(payload.get("n_prompts", 0)),
                   d_model=int(payload["d_model"]), metadata=payload.get("metadata"),
                   path=str(path))  # fmt: skip

    def matrix(self, layer: int, num_layers: int) -> torch.Tensor | None:
        if layer in self.jacobians:
            return self.jacobians[layer]
        if layer == num_layers - 1:
            return None
        raise CaptureConfigError(f"the J-lens has no layer {layer}: {self.source_layers}")


class TunedLens:
    kind = "tuned"

    def __init__(self, translators: dict, config: dict, path: str | None = None) -> None:
        self.translators = translators
        self.config = config
        self.d_model = int(config["d_model"])
        self.num_hidden_layers = int(config["num_hidden_layers"])
        self.path = path

    @classmethod
    def load(cls, folder: str | Path) -> TunedLens:
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        params = torch.load(folder / "params.pt", map_location="cpu", weights_only=True)
        translators = {}
        for key, value in params.items():
            index, _, part = key.partition(".")
            translators.setdefault(int(index), {})[part] = value.float()
        return cls(translators, config, str(folder))

    def affine(self, layer: int, num_layers: int) -> tuple[Any, Any]:
        if layer == num_layers - 1:
            return None, None
        t = self.translators.get(layer + 1)
        if t is None:
            raise CaptureConfigError(f"the tuned lens has no translator for layer {layer}")
        return torch.eye(self.d_model) + t["weight"], t.get("bias")


def load_lens(spec: Any) -> Any:
    if isinstance(spec, (JacobianLens, TunedLens)) or spec == "logit":
        return spec
    path = Path(str(spec))
    if path.is_dir():
        return TunedLens.load(path)
    if path.is_file():
        return JacobianLens.load(path)
    raise CaptureConfigError(f"lens {spec!r}: pass 'logit', a J-lens file or a tuned-lens folder")


def check_lens(lens: Any, name: str, *, hidden_size: int, num_layers: int,
               layers: Sequence[int], model_name: str | None) -> None:  # fmt: skip
    if lens.d_model != hidden_size:
        raise CaptureConfigError(f"lens {name}: d_model {lens.d_model} != {hidden_size}")
    for layer in layers:
        lens_affine(lens, layer, num_layers)
    if model_name and lens.kind == "jacobian" and lens.metadata.get("model_name") not in (
        None, model_name
    ):  # fmt: skip
        warnings.warn(f"lens {name} was fitted on {lens.metadata['model_name']}", stacklevel=2)


def lens_affine(lens: Any, layer: int, num_layers: int) -> tuple[Any, Any]:
    if lens == "logit":
        return None, None
    if lens.kind == "jacobian":
        return lens.matrix(layer, num_layers), None
    return lens.affine(layer, num_layers)
