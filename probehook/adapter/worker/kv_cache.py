"""Which key layout a vLLM attention layer's paged cache has (``probehook.worker.paged_keys``),
checked once against vLLM's own cache write: a layout probehook has not classified, or a build
of vLLM whose packing moved, is refused by name before a single key is read (the C++ kernels'
packing is not part of vLLM's Python API).

vLLM 0.32's CPU backend (``CPUAttentionBackendImpl``) packs keys by the layer's ISA
(``layer.isa``): ``vec``/``vec16`` column-major (float32, float16 and bfloat16 without AMX),
``amx`` in 16-token groups (bfloat16 on AMX); other ISAs (``neon``, ``vxe``, ``vsx``, ``rvv``)
are refused until checked. CUDA's FlashAttention keeps each token's key then value
(``token_major``; not checked here: no device in the tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from probehook.errors import UnsupportedModelError
from probehook.worker.attention_rows import AttentionTerms
from probehook.worker.paged_keys import key_slots, read_keys

CPU_ISA_LAYOUTS = {"vec": "vec", "vec16": "vec", "amx": "amx"}
"""The CPU kernel's ISAs probehook reads keys of, by the layout their cache has."""


def key_layout(layer: Any, loading: bool = False) -> str:
    """The key layout of vLLM attention layer ``layer``'s cache, or a refusal naming what it
    is (the backend, the ISA). ``loading``: before vLLM's CPU metadata builder has chosen the
    layer's ISA (at load), a CPU layer is ``"cpu"``: its ISA is checked at the first read."""
    impl = type(getattr(layer, "impl", None)).__name__
    if impl == "CPUAttentionBackendImpl" and loading and getattr(layer, "isa", None) is None:
        return "cpu"
    if impl == "CPUAttentionBackendImpl":
        isa = getattr(layer, "isa", None)
        if isa not in CPU_ISA_LAYOUTS:
            raise UnsupportedModelError(
                f"vLLM's CPU attention runs layer {getattr(layer, 'layer_name', '?')!r} with "
                f"the {isa!r} kernel, whose key cache layout probehook has not checked (it "
                f"reads {sorted(CPU_ISA_LAYOUTS)}); attention cannot be read on this CPU."
            )
        return CPU_ISA_LAYOUTS[isa]
    if impl == "FlashAttentionImpl":
        return "token_major"
    raise UnsupportedModelError(
        f"Attention layer {getattr(layer, 'layer_name', '?')!r} runs vLLM's {impl}, whose key "
        "cache probehook has not classified; attention can be read with vLLM's CPU backend "
        "or FlashAttention."
    )


def check_cpu_layout(isa: str, dtype: torch.dtype, kv_heads: int, head_size: int,
                     block_size: int) -> None:  # fmt: skip
    """Write random keys with vLLM's CPU cache write for ``isa`` into a scratch cache of two
    blocks and read them back: a refusal unless every key comes back bit-equal."""
    from vllm import _custom_ops as ops

    layout = CPU_ISA_LAYOUTS.get(isa)
    if layout is None:
        raise UnsupportedModelError(f"no key layout is known for vLLM's CPU ISA {isa!r}")
    generator = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(2, kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.randperm(2 * block_size, generator=generator)[: block_size + 3]
    keys = torch.randn(len(slots), kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(len(slots), kv_heads, head_size, generator=generator).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    got = read_keys(cache, layout, slots // block_size, slots % block_size)
    if not torch.equal(got, keys):
        wrong = int((got != keys).any(dim=(1, 2)).sum())
        raise UnsupportedModelError(
            f"vLLM's CPU cache write for ISA {isa!r} ({dtype}, {kv_heads} KV heads of "
            f"{head_size}, blocks of {block_size}) does not store keys in the {layout!r} "
            f"layout probehook reads ({wrong} of {len(slots)} keys read back wrong): this "
            "vLLM build packs them otherwise; attention cannot be read."
        )


def attention_of(decoder_layer: Any) -> Any:
    """The vLLM ``Attention`` module of a decoder layer (a Llama layer's ``self_attn.attn``):
    the one module of its class in the layer, or a refusal naming what was found."""
    from vllm.model_executor.layers.attention import Attention

    found = [m for m in decoder_layer.modules() if isinstance(m, Attention)]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{type(decoder_layer).__name__} holds {len(found)} vLLM Attention modules; "
            "probehook reads attention of layers that hold exactly one (self-attention)."
        )
    return found[0]


def request_keys(
    runner: Any, attention: Any, batch_row: Any, positions: torch.Tensor
) -> torch.Tensor:
    """The keys at ``positions`` of the request at ``batch_row`` of the V1 runner's batch, as
    ``attention``'s cache holds them (``[n, kv_heads, head_size]``, the cache's dtype), through
    the request's row of its KV-cache group's block table; ``batch_row`` a list of ``R``
    requests with ``[R, n]`` positions: ``[R, n, kv_heads, head_size]``. Read in the step's
    recorder window: the keys of every position the step computed are written, those of
    prefix-cache hits too."""
    groups = runner.kv_cache_config.kv_cache_groups
    group = next(
        (g for g, spec in enumerate(groups) if attention.layer_name in spec.layer_names), None
    )
    if group is None:
        raise UnsupportedModelError(f"no KV-cache group holds layer {attention.layer_name!r}")
    table = runner.input_batch.block_table[group]
    row = torch.from_numpy(table.block_table.np[batch_row]).long()  # a copy: vLLM's array moves on
    row = row.to(positions.device, non_blocking=True)  # no stream sync (a blocking copy is one)
    cache = attention.kv_cache
    layout = key_layout(attention)
    if layout != "token_major":  # vLLM's CPU kernel: its packing checked once per shape
        _checked_cpu_layout(attention.isa, cache.dtype, cache.shape[1], cache.shape[3] // 2,
                            cache.shape[2])  # fmt: skip
    blocks, offsets = key_slots(row, positions, table.block_size, cache.shape[2])
    return read_keys(cache, layout, blocks, offsets)


@functools.cache
def _checked_cpu_layout(isa: str, dtype: torch.dtype, kv_heads: int, head_size: int,
                        block_size: int) -> None:  # fmt: skip
    check_cpu_layout(isa, dtype, kv_heads, head_size, block_size)


def check_readable(attention: Any, loading: bool = False) -> None:
    """Refuse, naming the setting, a vLLM attention layer whose probabilities probehook would
    not read as its kernel forms them: a tripwire over every setting of vLLM 0.32's
    ``Attention`` that changes them, so that a new model family fails loudly at load instead
    of reading wrong numbers. Classified: the module is vLLM's ``Attention`` itself (not a
    subclass: chunked local, encoder-only, cross, MLA and static-sink attention are
    subclasses or other modules), its backend's key layout is known (:func:`key_layout`), it
    is a decoder's self-attention, the cache holds keys in the model's dtype (no fp8 scales),
    it reads its own cache (no KV sharing across layers), no bidirectional multimodal prefix,
    no ALiBi; the scale, soft-cap, window and sinks are read (:func:`attention_terms`).
    ``loading``: at load, before vLLM's CPU backend has chosen the layer's ISA."""
    from vllm.model_executor.layers.attention import Attention

    name = getattr(attention, "layer_name", "?")
    if type(attention) is not Attention:
        raise UnsupportedModelError(
            f"Attention layer {name!r} is vLLM's {type(attention).__name__}, whose attention "
            "probehook has not classified (it reads vLLM's Attention of a decoder's "
            "self-attention)."
        )
    key_layout(attention, loading)  # a backend probehook has not classified is refused first
    kind = str(getattr(attention, "attn_type", "decoder")).rsplit(".", 1)[-1].lower()
    unclassified = {
        "attn_type": (kind, "decoder"),
        "kv_cache_dtype": (getattr(attention, "kv_cache_dtype", "auto"), "auto"),
        "kv_sharing_target_layer_name": (
            getattr(attention, "kv_sharing_target_layer_name", None), None),
        "use_mm_prefix": (bool(getattr(attention, "use_mm_prefix", False)), False),
        "use_alibi_sqrt": (bool(getattr(attention, "use_alibi_sqrt", False)), False),
        "alibi_slopes": (getattr(attention.impl, "alibi_slopes", None) is not None, False),
    }  # fmt: skip
    off = {k: v for k, (v, want) in unclassified.items() if v != want}
    if off:
        raise UnsupportedModelError(
            f"Attention layer {name!r} has {off}; probehook reads attention where these are "
            f"{ {k: want for k, (_, want) in unclassified.items()} } (a decoder's "
            "self-attention over its own cache in the model's dtype: fp8 KV caches, KV "
            "sharing across layers, multimodal prefixes and ALiBi are not read yet)."
        )


def attention_terms(attention: Any) -> AttentionTerms:
    """What ``attention``'s kernel applies to ``q . k``, from its vLLM impl (what the kernel
    uses, not the Hugging Face config): the scale, the logit soft-cap, the sliding window and
    the sinks, after :func:`check_readable`."""
    impl = attention.impl
    check_readable(attention)
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, tuple):  # FlashAttention: (left, right) = (window - 1, 0)
        window = None if window[0] < 0 else window[0] + 1
    elif window is not None and window < 0:  # the CPU impl's "none"
        window = None
    return AttentionTerms(
        scale=float(impl.scale),
        soft_cap=float(impl.logits_soft_cap) if impl.logits_soft_cap else None,
        window=window,
        sinks=getattr(impl, "sinks", None),
    )
