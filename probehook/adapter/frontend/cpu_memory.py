"""How much memory a CPU engine reserves when the user chose nothing.

vLLM's CPU backend reads ``gpu_memory_utilization`` (default 0.92) as the fraction of *all*
memory to reserve, and refuses to start when less than that is free: on a laptop with a browser
open, the README's first example fails with "Engine core initialization failed". So on CPU,
when neither ``gpu_memory_utilization``, ``kv_cache_memory_bytes`` nor
``VLLM_CPU_KVCACHE_SPACE`` is set, probehook asks vLLM for a KV cache sized from the model
instead (``kv_cache_memory_bytes``, vLLM's own argument, which also skips the fraction check),
and says so in one log line. Anything the user sets wins.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

USER_CHOICES = ("gpu_memory_utilization", "kv_cache_memory_bytes")
"""Engine arguments that size vLLM's reservation; any one of them turns the default off."""
ENV_CHOICE = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM's CPU-only setting (GiB of KV cache); it also turns the default off."""
SEQUENCES = 4
"""Full-length sequences the default KV cache holds at least."""
MIN_BYTES = 256 << 20
"""Floor of the default: small models still batch many short requests."""
_told = False
MAX_SHARE = 0.25
"""The default never takes more than this share of the memory free at construction, unless
a single sequence of ``max_model_len`` needs more (vLLM then says what is missing)."""


def chose_memory(kwargs: dict[str, Any]) -> bool:
    """Whether the user sized vLLM's memory reservation themselves."""
    return any(kwargs.get(k) is not None for k in USER_CHOICES) or bool(os.environ.get(ENV_CHOICE))


def default_kv_cache_bytes(vllm_config: Any, available_bytes: int) -> tuple[int, int]:
    """``(bytes, tokens)`` of the default KV cache: ``SEQUENCES`` sequences of
    ``max_model_len`` tokens, at least ``MIN_BYTES``, at most ``MAX_SHARE`` of what is free
    but never less than one full sequence."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    itemsize = model.dtype.itemsize if cache_dtype == "auto" else _itemsize(cache_dtype)
    per_token = (
        (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel))
        * model.get_head_size()
        * itemsize
    )
    one_sequence = per_token * model.max_model_len
    wanted = max(SEQUENCES * one_sequence, MIN_BYTES)
    size = max(min(wanted, int(available_bytes * MAX_SHARE)), one_sequence)
    return size, size // max(per_token, 1)


def _itemsize(cache_dtype: str) -> int:
    return 1 if "fp8" in cache_dtype else 2


def size_for_cpu(
    model: str, kwargs: dict[str, Any], resolve: Any, reserved_bytes: int = 0
) -> dict[str, Any]:
    """``kwargs`` with ``kv_cache_memory_bytes`` set when the engine runs on CPU and the user
    chose no memory setting; unchanged otherwise.

    Args:
        resolve: builds the ``VllmConfig`` of ``(model, kwargs)`` without starting anything.
        reserved_bytes: what probehook itself will hold in the worker (SAE weights): not
            free for the KV cache.
    """
    if chose_memory(kwargs):
        return kwargs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return kwargs
    import psutil

    global _told
    available = max(psutil.virtual_memory().available - reserved_bytes, 0)
    size, tokens = default_kv_cache_bytes(resolve(model, kwargs), available)
    # Visible once per process (a warning reaches an unconfigured script's stderr), then info.
    log = logger.info if _told else logger.warning
    _told = True
    log(
        "probehook: on CPU, reserving %.2f GiB for the KV cache (%d tokens) instead of vLLM's "
        "default of 92%% of all memory (%.1f GiB free now). Set gpu_memory_utilization=, "
        "kv_cache_memory_bytes= or VLLM_CPU_KVCACHE_SPACE to choose.",
        size / (1 << 30),
        tokens,
        available / (1 << 30),
    )
    return {**kwargs, "kv_cache_memory_bytes": size}
