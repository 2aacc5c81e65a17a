"""What both SAE readers share: the file names, the error, the fingerprint, reading the
tensors (or only their shapes)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from probehook.errors import ProbehookError

SAELENS_WEIGHTS = "sae_weights.safetensors"
SPARSIFY_WEIGHTS = "sae.safetensors"
CONFIG = "cfg.json"


class SAEError(ProbehookError, ValueError):
    """An SAE cannot be read or used: a missing or damaged file, an architecture or hook
    probehook does not read, a size that does not match the model, a bad per-request name."""


def fingerprint_of(folder: Path, weights_file: str) -> str:
    """sha256 of the config and the weights: which SAE stored features came from."""
    digest = hashlib.sha256()
    for name in (CONFIG, weights_file):
        with open(folder / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_tensors(file: Path, weights: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; with ``weights=False`` only their shapes and dtypes
    (tensors on the ``meta`` device: the header is read, not the data)."""
    from safetensors import safe_open

    try:
        if weights:
            from safetensors.torch import load_file

            return load_file(os.fspath(file))
        with safe_open(os.fspath(file), framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = f.get_slice(name)
                dtype = _DTYPES.get(part.get_dtype())
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has dtype {part.get_dtype()}")
                out[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
            return out
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise SAEError(f"{os.fspath(file)!r} is not readable: {e}") from e


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}  # fmt: skip
