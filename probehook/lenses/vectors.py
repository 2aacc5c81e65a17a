"""Lens vectors: the residual-stream direction a lens reads as one vocabulary token.

For a lens whose map at layer ``L`` is ``M`` (``J_L`` for the J-lens, ``I + A_L`` for the tuned
lens, ``I`` for the logit lens), the vector of token ``t`` is row ``t`` of ``W_U M``:
``v_t = M^T W_U[t]``, in layer ``L``'s coordinates (TransformerLens's
``JacobianLens.lens_vectors``). ``W_U`` is the model's own unembedding, read from its
checkpoint (``lm_head.weight``, or the embeddings when they are tied); no model is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from probehook.errors import CaptureConfigError
from probehook.lenses.artifacts import lens_affine

UNEMBEDDING_KEYS = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
"""Where a Hugging Face checkpoint keeps its unembedding (the embeddings when tied)."""


def unembedding_rows(model_path: str | os.PathLike[str], token_ids: Sequence[int]) -> torch.Tensor:
    """``W_U[token_ids]``, ``[n, d]`` float32, read from the checkpoint's safetensors files."""
    from safetensors import safe_open

    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CaptureConfigError(
            f"model={os.fspath(model_path)!r} has no safetensors files to read the "
            "unembedding from: pass the local folder of the model's checkpoint."
        )
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    tied = config.get("tie_word_embeddings") is not False
    keys = UNEMBEDDING_KEYS if tied else UNEMBEDDING_KEYS[:1]
    for key in keys:
        for file in files:
            with safe_open(str(file), "pt") as f:
                if key not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                    continue
                rows = f.get_slice(key)
                vocab = rows.get_shape()[0]
                bad = [t for t in token_ids if not 0 <= t < vocab]
                if bad:
                    raise CaptureConfigError(
                        f"token id(s) {bad} are outside the model's vocabulary (0..{vocab - 1})."
                    )
                return torch.stack([rows[t : t + 1][0] for t in token_ids]).float()
    raise CaptureConfigError(
        f"found no unembedding ({', '.join(keys)}) in {os.fspath(model_path)!r}."
    )


def token_ids_of(model_path: str | os.PathLike[str], tokens: Sequence[Any]) -> list[int]:
    """Token ids from ids or strings (each must be one token of the model's tokenizer)."""
    ids: list[int] = []
    tokenizer = None
    for token in tokens:
        if isinstance(token, int) and not isinstance(token, bool):
            ids.append(token)
            continue
        if not isinstance(token, str):
            raise CaptureConfigError(f"token {token!r} is neither a token id nor a string.")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_path))
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise CaptureConfigError(
                f"token {token!r} is {len(encoded)} tokens ({encoded}) for this tokenizer: "
                "pass one token (or its id)."
            )
        ids.append(encoded[0])
    return ids


def lens_vectors(
    lens: Any, layer: int, tokens: Sequence[Any], model_path: str | os.PathLike[str]
) -> torch.Tensor:
    """``[n, d]`` float32: the lens's vector of each token at ``layer``."""
    num_layers = _num_layers(model_path)
    ids = token_ids_of(model_path, tokens)
    columns = unembedding_rows(model_path, ids)  # [n, d]
    matrix, _ = lens_affine(lens, layer, num_layers)
    return columns if matrix is None else columns @ matrix


def _num_layers(model_path: str | os.PathLike[str]) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text["num_hidden_layers"])
