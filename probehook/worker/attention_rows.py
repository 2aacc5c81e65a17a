"""One request's attention per head, from its query rows and the keys they can see (issue 51):
each head's top keys by probability, the entropy of its whole distribution and the mass on
named key ranges. The model's own probabilities, as its kernel forms them, in float32:
``softmax(soft_cap(scale * q . k))`` over every visible key (causal, and inside the sliding
window where the layer has one), a sink logit per head joining the denominator where the layer
has sinks, grouped-query heads paired as Hugging Face's ``repeat_kv`` pairs them (query head
``h`` reads KV head ``h // (heads / kv_heads)``).

No vLLM imports: the adapter hands the rows, the keys (``probehook.worker.paged_keys``) and the
layer's terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TILE_ROWS = 64
"""Query rows scored at once: a tile's logits are ``[rows, heads, keys]`` float32."""


@dataclass(frozen=True)
class AttentionTerms:
    """What a layer's kernel applies to ``q . k`` (from vLLM's attention module)."""

    scale: float
    soft_cap: float | None = None
    """``cap * tanh(logit / cap)`` (Gemma 2); None: none."""
    window: int | None = None
    """A key at ``j`` is visible to the query at ``p`` when ``p - window < j <= p``."""
    sinks: torch.Tensor | None = None
    """``[heads]`` logits that join each head's denominator (no key of theirs)."""


@dataclass
class HeadReadings:
    positions: torch.Tensor
    """int64 ``[rows, heads, k]``: the most attended key positions, by descending
    probability; -1 where fewer than k keys pass ``min_p``."""
    probs: torch.Tensor
    """float32 ``[rows, heads, k]``: their probabilities (0 at -1 slots)."""
    entropy: torch.Tensor
    """float32 ``[rows, heads]``: nats, over the keys and the sink (where there is one)."""
    spans: torch.Tensor
    """float32 ``[rows, heads, spans]``: the probability mass on each ``[start, end)``."""


def head_readings(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    terms: AttentionTerms,
    k: int,
    min_p: float = 0.0,
    spans: torch.Tensor | None = None,
) -> HeadReadings:
    """``queries`` ``[rows, heads, D]`` at ``query_positions`` ``[rows]`` against ``keys``
    ``[keys, kv_heads, D]`` at ``key_positions`` ``[keys]`` (any order; each row sees those at
    or before its position, inside the window); ``spans`` int64 ``[spans, 2]``."""
    rows, heads, dim = queries.shape
    kv_heads = _kv_heads(keys, heads)
    shared = keys.permute(1, 2, 0).float()  # [kv_heads, D, keys]
    spans = spans if spans is not None else keys.new_zeros(0, 2, dtype=torch.int64)
    in_span = _in_span(key_positions[None], spans[None])[0].float()  # [spans, keys]
    parts = []
    for lo in range(0, rows, TILE_ROWS):
        tile = queries[lo : lo + TILE_ROWS].float()
        count = len(tile)
        # [kv_heads, rows x group, D] @ [kv_heads, D, keys]: one batched matmul per KV head
        grouped = tile.view(count, kv_heads, -1, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
        logits = torch.bmm(grouped, shared).view(kv_heads, count, -1, shared.shape[-1])
        logits = logits.transpose(0, 1).reshape(count, heads, -1)
        parts.append(_readings(logits, query_positions[lo : lo + TILE_ROWS],
                               key_positions.expand(count, -1), terms, k, min_p,
                               in_span.expand(count, -1, -1)))  # fmt: skip
    return HeadReadings(*(torch.cat([p[i] for p in parts]) for i in range(4)))


def batched_head_readings(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    terms: AttentionTerms,
    k: int,
    min_p: float = 0.0,
    spans: torch.Tensor | None = None,
) -> HeadReadings:
    """One row each of ``R`` requests at once (a decode step): ``queries`` ``[R, heads, D]``
    at ``query_positions`` ``[R]`` against each one's own ``keys`` ``[R, M, kv_heads, D]`` at
    ``key_positions`` ``[R, M]`` (-1: padding, never visible); ``spans`` int64
    ``[R, spans, 2]`` (``[0, 0]``: no span)."""
    rows, heads, dim = queries.shape
    kv_heads = _kv_heads(keys, heads)
    spans = spans if spans is not None else keys.new_zeros(rows, 0, 2, dtype=torch.int64)
    # [R, kv_heads, group, D] @ [R, kv_heads, D, M] (einsum took ten times as long on CPUs)
    grouped = queries.float().view(rows, kv_heads, -1, dim)
    logits = torch.matmul(grouped, keys.permute(0, 2, 3, 1).float()).view(rows, heads, -1)
    in_span = _in_span(key_positions, spans).float()
    return HeadReadings(*_readings(logits, query_positions, key_positions, terms, k, min_p,
                                   in_span))  # fmt: skip


def _kv_heads(keys: torch.Tensor, heads: int) -> int:
    """Keys ``[..., kv_heads, D]``'s KV heads; query head ``h`` reads KV head
    ``h // (heads / kv_heads)`` (``repeat_kv``), so the queries' view ``[kv_heads, group]``
    pairs them."""
    kv_heads = keys.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    return kv_heads


def _in_span(key_positions: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """bool ``[R, spans, keys]``: whether each key lies in each ``[start, end)``."""
    at = key_positions[:, None, :]
    return (at >= spans[..., :1]) & (at < spans[..., 1:]) & (at >= 0)


def _readings(
    logits: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    terms: AttentionTerms,
    k: int,
    min_p: float,
    in_span: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """From raw ``q . k`` logits ``[rows, heads, keys]`` of keys at ``key_positions``
    ``[rows, keys]`` (-1: padding): the kernel's terms, the softmax over the visible keys
    (and the sink), and the readings."""
    logits = logits * terms.scale
    if terms.soft_cap:
        logits = terms.soft_cap * torch.tanh(logits / terms.soft_cap)
    distance = query_positions[:, None] - key_positions  # [rows, keys]
    visible = (distance >= 0) & (key_positions >= 0)
    if terms.window is not None:
        visible &= distance < terms.window
    logits = logits.masked_fill(~visible[:, None, :], -math.inf)
    if terms.sinks is not None:
        sink = terms.sinks.float()[None, :, None].expand(len(logits), -1, 1)
        full = torch.cat([logits, sink], dim=-1).log_softmax(dim=-1)
        log_p = full[..., :-1]
        entropy = -(full.exp() * full.nan_to_num(neginf=0.0)).sum(dim=-1)
    else:
        log_p = logits.log_softmax(dim=-1)
        entropy = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(dim=-1)
    probs = log_p.exp()
    width = min(k, probs.shape[-1])
    top, at = probs.topk(width, dim=-1)
    kept = (top > 0) & (top >= min_p)
    where = key_positions[:, None, :].expand(-1, probs.shape[1], -1).gather(-1, at)
    positions = torch.where(kept, where, -1)
    top = torch.where(kept, top, 0.0)
    if width < k:  # fewer keys than k: pad
        pad = k - width
        positions = torch.nn.functional.pad(positions, (0, pad), value=-1)
        top = torch.nn.functional.pad(top, (0, pad), value=0.0)
    if in_span.shape[1]:
        masses = torch.bmm(probs, in_span.transpose(1, 2))
    else:
        masses = probs.new_zeros(*probs.shape[:2], 0)
    return positions, top, entropy, masses
