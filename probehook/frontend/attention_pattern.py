"""``LLM.attention_pattern(prompt, layer)``: the full attention matrix of a short prompt, every
query head of one layer (the picture researchers draw), from the attention readout's prompt
rows: with ``attention_top_k`` at least the prompt's length every key a row can see is among
its top k, so the rows' positions and probabilities scatter into the whole matrix exactly
(a key whose probability is 0 in float32 stays 0). Offline only, under a byte cap.

No vLLM imports: the engine is the caller's ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from probehook.errors import CaptureConfigError

DEFAULT_MAX_BYTES = 256 << 20
"""The largest matrix ``attention_pattern`` returns by default (``heads x n x n`` float32)."""


def attention_pattern(
    generate: Callable[[Any, Any], list[Any]],
    tokenize: Callable[[str], list[int]],
    readouts: Mapping[str, Any],
    include_prefill: bool,
    prompt: str | Sequence[int],
    layer: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> torch.Tensor:
    """float32 ``[n_heads, n, n]``: row ``p`` of head ``h`` is the attention of prompt position
    ``p`` over key positions ``0..n-1`` (0 past ``p``). ``generate(prompt, extra)`` runs one
    request with ``extra`` as its probehook options; ``readouts``: the engine's top-k readout
    sets by source."""
    attention = readouts.get("attention")
    if attention is None:
        raise CaptureConfigError(
            "attention_pattern needs an engine that reads attention: build the LLM with "
            "attention_layers=[...], include_prefill=True and attention_top_k at least the "
            "prompt's length."
        )
    readout = attention.readout
    name = _layer_name(readout, attention.instances, layer)
    settings = attention.instances[name]
    if settings.get("min_p", 0.0) > 0:
        raise CaptureConfigError(
            f"attention_pattern reads every key of each row, but this engine keeps only keys "
            f"of probability >= attention_min_p={settings['min_p']}; build the LLM without "
            "attention_min_p to draw whole patterns."
        )
    if not include_prefill:
        raise CaptureConfigError(
            "attention_pattern reads the prompt's rows: build the LLM with include_prefill=True."
        )
    ids = tokenize(prompt) if isinstance(prompt, str) else _token_ids(prompt)
    n, heads = len(ids), int(settings["heads"])
    if n > attention.k:
        raise CaptureConfigError(
            f"attention_pattern reads each prompt row's every key from its top k: the prompt "
            f"has {n} tokens, the engine keeps attention_top_k={attention.k}; build the LLM "
            f"with attention_top_k >= {n} (at most {readout.max_k}), or pass a shorter prompt."
        )
    size = heads * n * n * 4
    if size > max_bytes:
        raise CaptureConfigError(
            f"attention_pattern of {n} tokens and {heads} heads is {size:,} bytes, over "
            f"max_bytes={max_bytes:,}; pass a shorter prompt or a larger max_bytes."
        )
    options = {"attention": True, "attention_layers": [int(name)], "include_prefill": True,
               "include_decode": False}  # fmt: skip
    out = generate({"prompt_token_ids": list(ids)}, options)[0]
    rows = out.prefill_attention[int(name)]
    return rows.dense(n).permute(1, 0, 2).contiguous()


def _layer_name(readout: Any, instances: Mapping[str, Any], layer: Any) -> str:
    from probehook.outputs.lens import user_layers

    num_layers = int(next(iter(instances.values()))["num_layers"])
    name = str(user_layers([layer], num_layers, "attention_pattern's layer")[0])
    if name not in instances:
        raise CaptureConfigError(
            f"attention_pattern(layer={layer!r}): the engine does not read that layer's "
            f"attention; its attention_layers: {sorted(int(n) for n in instances)}."
        )
    return name


def _token_ids(prompt: Sequence[int]) -> list[int]:
    ids = list(prompt)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise CaptureConfigError(
            f"attention_pattern's prompt {prompt!r} is not valid: pass a string or a non-empty "
            "list of token ids."
        )
    return ids
