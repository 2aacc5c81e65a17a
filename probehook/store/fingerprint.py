"""Which model a store holds rows of: a fingerprint that survives library upgrades.

Fingerprint v2 hashes what decides the activations and nothing else:

* a fixed list of architecture fields of the HF config (:data:`CONFIG_FIELDS`, those present)
  and RoPE (theta and scaling, normalized so transformers 4's ``rope_theta``/``rope_scaling`` and
  transformers 5's ``rope_parameters`` agree); for a multimodal config, those of its text
  config, plus the top-level ``architectures`` and ``model_type``. Bookkeeping such as
  ``transformers_version``, ``_name_or_path`` or ``dtype`` is left out, so a newer transformers
  reading the same checkpoint agrees.
* when the weights are local files (a directory, or one file such as a GGUF) and the load
  format is not ``"dummy"``: the sorted names and sizes of the top-level weight files
  (:data:`WEIGHT_SUFFIXES`; only the ``*.safetensors`` ones when there are any, as vLLM then
  loads only those) and a sha256 of three samples of each (first, middle and last
  :data:`SAMPLE_BYTES`; a safetensors header, with every tensor's name, shape and offset, is in
  the first). A few hundred KiB read per file instead of the whole checkpoint.

With no local weights (dummy weights, or a hub id) it covers the config only, and ``covers``
says so. Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FINGERPRINT_VERSION = 2
CONFIG_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "n_inner",  # GPT-2's name for the MLP width (no attribute_map alias)
    "vocab_size",
    "hidden_act",
    "activation_function",  # GPT-2 / GPT-J
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "max_position_embeddings",
)
"""Architecture fields read with ``getattr`` (so aliases like GPT-2's ``n_embd`` resolve)."""
TOP_LEVEL_FIELDS = ("architectures", "model_type")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Top-level files that count as weights. ``.gguf``: vLLM's single-file GGUF checkpoints."""
SAMPLE_BYTES = 64 << 10
_CONFIG_ONLY_FORMATS = ("dummy",)


def model_fingerprint(
    hf_config: Any, model_path: str | os.PathLike[str] | None, load_format: str = "auto"
) -> dict[str, Any]:
    """``{"fingerprint": 16 hex chars, "version": 2, "covers": human-readable summary}``."""
    config = architecture_fields(hf_config)
    load_format = str(getattr(load_format, "value", load_format))  # vLLM may pass an enum
    weights, why_not = _weight_files(model_path, load_format)
    body: dict[str, Any] = {"version": FINGERPRINT_VERSION, "config": config}
    if weights:
        body["weights"] = [_file_digest(path) for path in weights]
        total = sum(entry["size"] for entry in body["weights"])
        covers = (
            f"architecture config ({len(config)} fields) + {len(weights)} weight file(s) "
            f"({_size(total)}; names, sizes, sampled sha256) in {model_path}"
        )
    else:
        covers = f"architecture config only ({len(config)} fields); weights not covered: {why_not}"
    digest = hashlib.sha256(_canonical_json(body).encode()).hexdigest()[:16]
    logger.debug("model fingerprint %s covers %s", digest, covers)
    return {"fingerprint": digest, "version": FINGERPRINT_VERSION, "covers": covers}


def legacy_fingerprint(hf_config: Any) -> str:
    """Fingerprint v1 (probehook 0.1 stores without ``fingerprint_version``): the whole HF
    config dict, so it changes with the transformers version and ignores the weights."""
    hf = hf_config.to_dict()
    hf.pop("_name_or_path", None)
    body = json.dumps(hf, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def architecture_fields(hf_config: Any) -> dict[str, Any]:
    """The normalized config fields that fingerprint v2 hashes."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    out: dict[str, Any] = {}
    for name in TOP_LEVEL_FIELDS:
        value = getattr(hf_config, name, None) or getattr(text, name, None)
        if value is not None:
            out[name] = value
    for name in CONFIG_FIELDS:
        value = getattr(text, name, None)
        if value is not None:
            out[name] = value
    # Fill defaults that some transformers releases store and others only imply, so the same
    # checkpoint gives the same fields under either.
    if "num_attention_heads" in out:
        out.setdefault("num_key_value_heads", out["num_attention_heads"])
        if "hidden_size" in out:
            out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
    rope = _rope(text)
    if rope is not None:
        out["rope"] = rope
    return out


def _rope(config: Any) -> dict[str, Any] | None:
    """RoPE as ``{"theta", "scaling"}``: transformers 4 keeps ``rope_theta`` and
    ``rope_scaling``, transformers 5 one ``rope_parameters`` dict; both normalize alike."""
    params = getattr(config, "rope_parameters", None)
    params = dict(params) if isinstance(params, dict) else {}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    if "type" in params:  # the pre-4.45 spelling of rope_type
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type") == "default" and len(params) == 1:
        params = {}
    if theta is None and not params:
        return None
    return {"theta": theta, "scaling": params or None}


def _weight_files(
    model_path: str | os.PathLike[str] | None, load_format: str
) -> tuple[list[Path], str]:
    """Weight files to sample, or none and why."""
    if load_format in _CONFIG_ONLY_FORMATS:
        return [], f"load_format={load_format!r} (no weights are read)"
    if not model_path:
        return [], "no model path"
    path = Path(model_path)
    if path.is_file():
        return [path], ""
    if not path.is_dir():
        return [], f"{model_path!r} is not a local path (hub id?)"
    files = sorted(
        (p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file()),
        key=lambda p: p.name,
    )
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    if safetensors:
        # A training_args.bin or a leftover pytorch_model.bin beside them is not what loads.
        files = safetensors
    if not files:
        return [], f"no {'/'.join(WEIGHT_SUFFIXES)} files in {model_path}"
    return files, ""


def _file_digest(path: Path) -> dict[str, Any]:
    """Name, size and the sha256 of three ``SAMPLE_BYTES`` samples (the whole file if small)."""
    size = path.stat().st_size  # follows symlinks, as in the HF cache's snapshot dirs
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for offset in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _canonical_json(value: Any) -> str:
    return json.dumps(_normalize(value), sort_keys=True, separators=(",", ":"), default=str)


def _normalize(value: Any) -> Any:
    """Integral floats as ints (a config may say 10000 or 10000.0); tuples as lists."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value
