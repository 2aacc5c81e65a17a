"""The steering vector file: one safetensors file, one tensor per layer plus a JSON header in its
metadata. No pickle.

tensors   layer.<L> [hidden] float32, one per layer (a swap's from directions), and to.<L> for a
          swap's to directions
metadata  {"probehook_steering": JSON {"format_version": 1, "name", "layers", "hidden_size",
          "model_fingerprint", "made_by", "probehook_version", "op", "op_params", "site"}}

A file without ``op`` (written before the other ops) loads as ``add`` at ``resid_post``; a
vector loads with the op and site its file records and nothing else (a direction saved for
ablation is never added unless asked with ``with_op("add")``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from probehook.core.steering_ops import SITE
from probehook.errors import CaptureConfigError
from probehook.probes.file import METADATA_KEY as PROBE_METADATA_KEY
from probehook.probes.file import json_header
from probehook.steering.vector import SteeringVector

FORMAT_VERSION = 1
METADATA_KEY = "probehook_steering"
"""Key of the JSON header in the safetensors metadata of a steering vector file."""


def tensor_name(layer: int) -> str:
    return f"layer.{layer}"


def to_name(layer: int) -> str:
    return f"to.{layer}"


def save_vector(vector: SteeringVector, path: str | os.PathLike[str]) -> Path:
    """Write ``vector`` to ``path`` (atomically: a crash never leaves half a file)."""
    from safetensors.torch import save_file

    from probehook._version import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {tensor_name(layer): vec for layer, vec in vector.vectors.items()}
    tensors.update({to_name(layer): vec for layer, vec in vector.swap_to.items()})
    header = {
        "format_version": FORMAT_VERSION,
        "name": vector.name,
        "layers": list(vector.layers),
        "hidden_size": vector.hidden_size,
        "model_fingerprint": vector.model_fingerprint,
        "made_by": vector.made_by,
        "probehook_version": __version__,
        "op": vector.op,
        "op_params": vector.op_params,
        "site": vector.site,
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, os.fspath(tmp), metadata={METADATA_KEY: json.dumps(header)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_vector(path: str | os.PathLike[str]) -> SteeringVector:
    """Read a steering vector file; anything damaged or foreign is a CaptureConfigError naming
    the file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No steering vector file at {path}.")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as e:  # safetensors raises its own SafetensorError for any damage
        raise CaptureConfigError(
            f"{path} is not a readable steering vector file ({e}); it may be truncated or not "
            "written by SteeringVector.save."
        ) from e
    header = _header(path, metadata)
    layers = header.get("layers")
    if not isinstance(layers, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in layers
    ):
        raise CaptureConfigError(
            f"{path}: its header's layers must be a list of integers, got {layers!r}."
        )
    op = header.get("op", "add")
    site = header.get("site", SITE)
    if site != SITE:
        raise CaptureConfigError(
            f"{path}: its vector applies at site {site!r}; steering vectors apply at {SITE!r} "
            "(the layer's output) only."
        )
    expected = {tensor_name(layer) for layer in layers}
    if op == "swap":
        expected |= {to_name(layer) for layer in layers}
    if set(tensors) != expected:
        missing = sorted(expected - set(tensors))
        extra = sorted(set(tensors) - expected)
        raise CaptureConfigError(
            f"{path}: its tensors do not match its header's layers {layers}: missing "
            f"{missing}, unexpected {extra}."
        )
    for key, t in tensors.items():
        if t.dtype != torch.float32:
            raise CaptureConfigError(f"{path}: tensor {key!r} is {t.dtype}, not float32.")
        if t.ndim != 1 or len(t) != header.get("hidden_size"):
            raise CaptureConfigError(
                f"{path}: tensor {key!r} has shape {tuple(t.shape)} but the header says hidden "
                f"size {header.get('hidden_size')!r}."
            )
    params = header.get("op_params") or {}
    if not isinstance(params, dict):
        raise CaptureConfigError(f"{path}: its op_params must be an object, got {params!r}.")
    try:
        return SteeringVector(
            {layer: tensors[tensor_name(layer)] for layer in layers},
            header.get("name"),
            model_fingerprint=header.get("model_fingerprint"),
            made_by=header.get("made_by"),
            op=op,
            op_params=params,
            swap_to={layer: tensors[to_name(layer)] for layer in layers} if op == "swap" else None,
        )
    except CaptureConfigError as e:
        raise CaptureConfigError(f"{path} holds an invalid steering vector: {e}") from e


def _header(path: Path, metadata: dict[str, str]) -> dict[str, Any]:
    if METADATA_KEY not in metadata and PROBE_METADATA_KEY in metadata:
        raise CaptureConfigError(
            f"{path} is a probe file (LinearProbe.save), not a steering vector; use "
            "SteeringVector.from_probe(LinearProbe.load(path))."
        )
    return json_header(
        path,
        metadata,
        METADATA_KEY,
        FORMAT_VERSION,
        CaptureConfigError,
        "SteeringVector.save",
        "steering vector",
    )
