"""Reading keys back from a layer's paged KV cache (issue 51: attention per head reads the keys
a query sees from the cache, after the forward pass, instead of copying them).

A layer's cache is one tensor ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (vLLM 0.32,
every attention backend's logical view). What differs is how a page holds its keys:

- ``"token_major"`` (CUDA FlashAttention): each token's key then value, ``kv[b, h, o, :D]``;
- ``"vec"`` (vLLM's CPU kernel for float32/float16, ISAs ``vec``/``vec16``): each
  ``(block, head)`` page holds all its keys, then all its values; the keys column-major,
  ``[D, block_size]``;
- ``"amx"`` (the CPU kernel for bfloat16 on AMX): the same halves, keys in 16-token groups with
  dimensions in pairs, ``[block_size / 16, D / 2, 16, 2]``.

The adapter names a layer's layout (``probehook.adapter.worker.kv_cache``) and checks it once
against vLLM's own cache write before anything is read. No vLLM imports.
"""

from __future__ import annotations

import torch

LAYOUTS = ("token_major", "vec", "amx")


def read_keys(
    kv_cache: torch.Tensor, layout: str, blocks: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """The keys at ``(blocks[...], offsets[...])`` of a layer's cache: ``[*blocks.shape,
    kv_heads, head_size]`` in the cache's dtype (an fp8 cache's raw values: the caller scales
    them); ``blocks`` and ``offsets`` of one shape (``[n]``, or ``[requests, n]``)."""
    num_blocks, heads, block_size, width = kv_cache.shape
    dim = width // 2
    if layout == "token_major":
        return kv_cache[blocks, :, offsets, :dim]
    keys = kv_cache.view(num_blocks, heads, 2, block_size * dim)[:, :, 0]
    if layout == "vec":
        return keys.view(num_blocks, heads, dim, block_size)[blocks, :, :, offsets]
    if layout == "amx":
        packed = keys.view(num_blocks, heads, block_size // 16, dim // 2, 16, 2)
        picked = packed[blocks, :, offsets // 16, :, offsets % 16, :]  # [..., heads, D/2, 2]
        return picked.reshape(*blocks.shape, heads, dim)
    raise ValueError(f"unknown key layout {layout!r}; the layouts are {list(LAYOUTS)}")


def key_slots(
    block_row: torch.Tensor, positions: torch.Tensor, block_size: int, kernel_block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a request's keys at ``positions`` lie in a layer's cache: ``(blocks, offsets)``
    for :func:`read_keys`. ``block_row``: the request's row of its KV-cache group's block table
    (vLLM's block ids, ``block_size`` positions each; ``[requests, blocks]`` rows with
    ``[requests, n]`` positions read several requests at once); a backend whose kernel takes
    smaller blocks splits each into ``block_size // kernel_block_size`` kernel blocks, numbered
    ``block * ratio + j``."""
    if block_size % kernel_block_size:
        raise ValueError(
            f"blocks of {block_size} positions do not split into kernel blocks of "
            f"{kernel_block_size}"
        )
    ratio = block_size // kernel_block_size
    blocks = (
        block_row.gather(-1, positions // block_size) * ratio
        + (positions % block_size) // kernel_block_size
    )
    return blocks, positions % kernel_block_size
