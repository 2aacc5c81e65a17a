"""EleutherAI sparsify folders (``cfg.json`` + ``sae.safetensors``, eai-sparsify 1.x).

sparsify encodes ``TopK_k(ReLU((x - b_dec) @ encoder.weight.T + encoder.bias))`` and stores
``W_dec`` as ``[num_latents, d_in]`` (SAELens's converter transposes it and fails on such
files). That is SAELens's ``topk`` architecture with ``apply_b_dec_to_input`` and no decoder
rescale (ReLU before or after the top-k keeps the same non-zero set).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from probehook.saes.encode import SAEWeights
from probehook.saes.files import SPARSIFY_WEIGHTS, SAEError, fingerprint_of, read_tensors

_LAYER_FOLDER = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)$")


def read_sparsify(
    folder: Path, cfg: dict[str, Any], layer: int | None, weights: bool = True
) -> dict[str, Any]:
    """The arguments of :class:`~probehook.saes.sae.SAE` for a sparsify folder (``weights``:
    as :meth:`~probehook.saes.sae.SAE.load`)."""
    where = os.fspath(folder)
    if cfg.get("transcode"):
        raise SAEError(f"sparsify SAE {where!r} is a transcoder (transcode: true): not read.")
    if cfg.get("activation", "topk") != "topk":
        raise SAEError(
            f"sparsify SAE {where!r} has activation={cfg.get('activation')!r}; probehook reads "
            "'topk' only."
        )
    if cfg.get("skip_connection"):
        raise SAEError(f"sparsify SAE {where!r} has a skip connection: not read.")
    if layer is None:
        match = _LAYER_FOLDER.match(folder.name)
        if match is None:
            raise SAEError(
                f"sparsify SAE {where!r}: its layer comes from a folder named layers.L; this "
                "one is not, so pass layer= to SAE.load."
            )
        layer = int(match.group(1))
    tensors = read_tensors(folder / SPARSIFY_WEIGHTS, weights)
    missing = sorted({"encoder.weight", "encoder.bias", "W_dec", "b_dec"} - set(tensors))
    if missing:
        raise SAEError(f"sparsify SAE {where!r} lacks tensor(s) {missing}.")
    encoder = tensors["encoder.weight"]  # [num_latents, d_in]
    W_dec = tensors["W_dec"]
    if W_dec.shape != encoder.shape:
        raise SAEError(
            f"sparsify SAE {where!r}: W_dec {tuple(W_dec.shape)} is not [num_latents, d_in] "
            f"like encoder.weight {tuple(encoder.shape)}."
        )
    k = int(cfg.get("k", 32))
    weights = SAEWeights(
        "topk",
        encoder.T.contiguous(),
        tensors["encoder.bias"],
        tensors["b_dec"],
        True,
        "none",
        k=k,
    )
    settings = {"format": "sparsify", "architecture": "topk", "k": k}
    return {
        "weights": weights,
        "layer": layer,
        "hook_name": folder.name,
        "path": where,
        "fingerprint": fingerprint_of(folder, SPARSIFY_WEIGHTS),
        "W_dec": W_dec,
        "settings": settings,
    }
