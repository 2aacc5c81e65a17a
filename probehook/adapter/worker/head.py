"""The model's head as readouts read it (the lenses): its final norm and unembedding, the
logits as the model computes them (soft-capping, scales, the vocabulary without padding),
one token's logit by its unembedding row, and a tensor-parallel rank's vocabulary shard.
Built at load (:func:`model_parts`) from vLLM's model; taps and other surgery are in
``surgery.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from probehook.adapter.worker.surgery import FINAL_NORM_NAMES, decoder_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelParts:
    """What readouts that need parts of the model get at load (``TopKReadout.worker_bank``):
    the model's device and ``head(rows)``, its own final norm and unembedding (logits as the
    model computes them: soft-capping, scales, the vocabulary without padding)."""

    device: torch.device
    head: Callable[[torch.Tensor], torch.Tensor] | None
    """None: the model has no final norm probehook knows, or no unembedding (pooling)."""
    token_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """``token_logits(rows, ids)``: the head's logit of one token per row, ``[n]``, from that
    token's row of the unembedding (None: the model's head is not one probehook can read
    by rows; callers take the head's column)."""
    shard: VocabShard | None = None
    """Under tensor parallelism, this rank's shard of the vocabulary (``head`` would gather
    every rank's logits)."""
    group: TensorGroup | None = None
    """Under tensor parallelism, this rank's place in the group and its all-gather (a readout
    whose rank holds a slice of a layer's heads: attention's); None with one rank."""


@dataclass(frozen=True)
class TensorGroup:
    """The tensor-parallel group as a worker bank sees it."""

    all_gather: Callable[[torch.Tensor], torch.Tensor]
    """``[n, m]`` -> ``[n, ranks * m]`` across the group, in rank order."""
    ranks: int
    rank: int


def tensor_group() -> TensorGroup | None:
    """This worker's tensor-parallel group (None: one rank)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
    )

    ranks = get_tensor_model_parallel_world_size()
    if ranks == 1:
        return None

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_gather(t.contiguous(), dim=-1)

    return TensorGroup(all_gather, ranks, get_tensor_model_parallel_rank())


@dataclass(frozen=True)
class VocabShard:
    """This rank's shard of a vocabulary-parallel unembedding: what a lens reads on each rank,
    in step with the others, without gathering logits (the partial top-k lists and
    log-sum-exps are merged instead)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    """``[n, hidden]`` rows -> ``[n, width]`` logits of this shard (final norm, head, soft-cap
    and scale; padding columns ``-inf``); column ``j`` is token ``start + j``."""
    start: int
    vocab: int
    """The whole vocabulary (without padding)."""
    token_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(rows, ids)`` -> ``[n]``: each id's logit where this shard holds it, else ``-inf``."""
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    """``[n, m]`` -> ``[n, ranks * m]`` across the tensor-parallel group, in rank order."""
    ranks: int
    rank: int = 0
    """This rank's place in the group (its slice of a sharded lens matrix)."""


def model_parts(
    model: nn.Module, unembedding: Callable[[], torch.Tensor | None] | None = None
) -> ModelParts:
    """The model's device and head. A generative model run as a pooling model (a
    capture-only engine, ``runner="pooling"``) has no LM head, which vLLM leaves out when it
    converts the model: ``unembedding()`` then gives the checkpoint's ``[vocab, hidden]``
    unembedding (None: it has none), and the head applies it with the model's own logits
    processor's soft-cap and scale."""
    device = next(model.parameters()).device
    norm = None
    decoder = decoder_of(model)
    for name in FINAL_NORM_NAMES:
        if isinstance(getattr(decoder, name, None), nn.Module):
            norm = getattr(decoder, name)
            break
    # The class's own compute_logits: the instance's is wrapped to fire the step hook.
    compute_logits = getattr(type(model), "compute_logits", None)
    if norm is None or compute_logits is None:
        return ModelParts(device, None)
    if getattr(model, "is_pooling_model", False):
        logits = _pooling_logits(model, decoder, unembedding)
        if logits is None:
            return ModelParts(device, None)
        final_norm = norm  # exit_early may swap the decoder's norm for a pass-through later
        return ModelParts(device, lambda rows: logits(final_norm(rows)))

    def head(rows: torch.Tensor) -> torch.Tensor:
        return compute_logits(model, norm(rows))

    shard = _vocab_shard(model, norm)
    if shard is not None:
        return ModelParts(device, head, None, shard)
    return ModelParts(device, head, _token_logits(model, norm, head))


def _vocab_shard(model: nn.Module, norm: nn.Module) -> VocabShard | None:
    """The rank's shard of a vocabulary-parallel LM head (None: one rank holds it all, or the
    head is not vLLM's ``ParallelLMHead`` with its logits processor). The logits are the
    processor's own head call (``_apply_head``: the head's quantization and ``head_dtype``),
    then its soft-cap and scale, as vLLM's vocabulary-parallel top-k does."""
    lm_head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    ranks = int(getattr(lm_head, "tp_size", 1) or 1)
    indices = getattr(lm_head, "shard_indices", None)
    apply = getattr(processor, "_apply_head", None)
    if ranks == 1 or indices is None or apply is None:
        return None
    from vllm.distributed import tensor_model_parallel_all_gather

    finish = _finisher(processor)
    start, held = int(indices.org_vocab_start_index), int(indices.num_org_elements)
    padding = int(indices.num_org_vocab_padding)
    weight = lm_head.weight

    def logits(rows: torch.Tensor) -> torch.Tensor:
        out = finish(apply(lm_head, norm(rows), None).float())
        if padding:
            out[:, -padding:] = float("-inf")
        return out

    by_rows = type(lm_head.quant_method).__name__ in (
        "UnquantizedEmbeddingMethod",
        "UnquantizedLinearMethod",
    )  # else the shard's column: a quantized weight's rows are not its logits' rows

    def token_logits(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - start
        mine = (local >= 0) & (local < held)
        at = local.clamp(0, max(held - 1, 0))  # a rank may hold only padding
        if by_rows:
            out = finish(_row_dot(norm(rows), weight, at))
        else:
            out = logits(rows).gather(1, at.unsqueeze(1)).squeeze(1)
        return torch.where(mine, out, float("-inf"))

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_gather(t.contiguous(), dim=-1)

    vocab = int(processor.org_vocab_size)
    rank = int(getattr(lm_head, "tp_rank", 0) or 0)
    return VocabShard(logits, start, vocab, token_logits, all_gather, ranks, rank)


def _token_logits(
    model: nn.Module, norm: nn.Module, head: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """One logit per row from the LM head's rows of the asked tokens and the logits
    processor's soft-cap and scale; checked against the whole head at its first call (a
    model whose ``compute_logits`` does more than that, or a head under tensor parallelism
    or quantized, gets the head's column instead: None, or the check's fallback)."""
    lm_head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    weight = getattr(lm_head, "weight", None)
    method = type(getattr(lm_head, "quant_method", None)).__name__
    if (
        weight is None
        or processor is None
        or getattr(processor, "logits_as_input", False)
        or method not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
        or weight.shape[0] < int(processor.org_vocab_size)  # a vocabulary shard (TP)
    ):
        return None
    finish = _finisher(processor)
    checked: list[bool] = []

    def by_rows(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return finish(_row_dot(norm(rows), weight, ids))

    def token_logits(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not checked:
            full = head(rows).float().gather(1, ids.unsqueeze(1)).squeeze(1)
            tolerance = 1e-2 * (1.0 + full.abs().max().item())
            checked.append(bool((by_rows(rows, ids) - full).abs().max() <= tolerance))
            if not checked[0]:
                logger.warning(
                    "probehook: %s's logits are not its LM head's rows with the logits "
                    "processor's soft-cap and scale; lens targets take the whole head.",
                    type(model).__name__,
                )
            return full
        if checked[0]:
            return by_rows(rows, ids)
        return head(rows).float().gather(1, ids.unsqueeze(1)).squeeze(1)

    return token_logits


def _pooling_logits(
    model: nn.Module, decoder: Any, unembedding: Callable[[], torch.Tensor | None] | None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A converted pooling model's logits, ``[n, hidden]`` normed rows -> ``[n, vocab]``:
    vLLM keeps its logits processor (soft-cap, scale) as a placeholder's ``module`` and drops
    the LM head's weights; those come from the embeddings when tied, else the checkpoint."""
    processor = getattr(model, "logits_processor", None)
    processor = getattr(processor, "__dict__", {}).get("module", processor)
    if processor is None or getattr(processor, "logits_as_input", False):
        return None
    vocab = int(processor.org_vocab_size)
    weight = None
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        embed = getattr(decoder, "embed_tokens", None)
        weight = getattr(embed, "weight", None)
    elif unembedding is not None:
        weight = unembedding()
    if weight is None or weight.is_meta:
        return None
    first = next(model.parameters())
    weight = weight[:vocab].detach().to(first.device, first.dtype)
    finish = _finisher(processor)

    def logits(rows: torch.Tensor) -> torch.Tensor:
        return finish(rows.to(weight.dtype) @ weight.T)

    return logits


def _finisher(processor: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What vLLM's logits processor does to the head's logits: its soft-cap, then its scale
    (in the logits' dtype)."""
    soft_cap, scale = processor.soft_cap, float(processor.scale)

    def finish(logits: torch.Tensor) -> torch.Tensor:
        if soft_cap is not None:
            logits = torch.tanh(logits / soft_cap) * soft_cap
        return logits * scale if scale != 1.0 else logits

    return finish


def _row_dot(normed: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One float32 logit per row: its normed row dotted with the head's row of its token (an
    unquantized head's rows are its logits' rows)."""
    w = weight.index_select(0, ids).to(normed.dtype)
    return torch.bmm(normed.unsqueeze(1), w.unsqueeze(2)).reshape(-1).float()
