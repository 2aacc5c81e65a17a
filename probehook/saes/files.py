"""What both SAE readers share: the file names, the error, the fingerprint."""

from __future__ import annotations

import hashlib
from pathlib import Path

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
