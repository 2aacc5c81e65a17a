"""Position arithmetic: which positions a request keeps, and which rows an output gets.

This is the only place that does it; the worker (what to keep) and the front end (what to ask
for) both call :func:`completion_spans`.

Words used across probehook:

- *position*: index of a token in its sequence; prompt tokens are ``0 .. P-1``, the first
  generated token is position ``P``. The row at position ``p`` is the residual stream after
  the model read token ``p``.
- *span*: a half-open range of positions ``[lo, hi)``.
- Decode row ``i`` is position ``P - 1 + i``: the state whose logits produced output token
  ``i``. ``N`` generated tokens give the decode span ``[P - 1, P - 1 + N)``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from probehook.capture_config import CaptureConfig

OPEN = sys.maxsize
"""``hi`` of a decode span while the request is still generating."""


@dataclass(frozen=True)
class Span:
    """Positions ``lo <= p < hi``."""

    lo: int
    hi: int

    def __len__(self) -> int:
        return max(self.hi - self.lo, 0)


@dataclass(frozen=True)
class KeepPlan:
    """What the worker keeps for one completion.

    ``dense`` positions are kept row by row. Positions ``>= latest_from`` (when set) are kept as
    one slot holding the highest position seen, so ``last_decode_token`` costs O(1) rows.
    """

    dense: Span | None
    latest_from: int | None


def completion_spans(
    config: CaptureConfig, prompt_len: int, num_generated: int | None, completion_index: int = 0
) -> tuple[Span | None, Span | None]:
    """The (prefill, decode) spans one completion returns.

    Args:
        config: the request's (narrowed) capture config.
        prompt_len: number of prompt tokens ``P``.
        num_generated: tokens generated so far; ``None`` while the worker cannot know the end
            (the decode span is then open-ended).
        completion_index: the completion's index among ``n``; prefill rows belong to index 0
            only, so the other completions of the same prompt never keep them.
    """
    last_prompt = max(prompt_len - 1, 0)
    prefill = None
    if config.include_prefill and completion_index == 0:
        prefill = Span(last_prompt if config.last_prefill_token else 0, prompt_len)
    decode = None
    if config.include_decode:
        if num_generated is None:
            decode = Span(last_prompt, OPEN)
        else:
            end = last_prompt + num_generated
            lo = end - 1 if config.last_decode_token and num_generated > 0 else last_prompt
            decode = Span(lo, end)
    return prefill, decode


def score_config(config: CaptureConfig) -> CaptureConfig:
    """The spans probe scores cover: the request's phases, every token of them (a score is a
    few bytes, so ``last_*_token`` does not thin scores out)."""
    return replace(config, last_prefill_token=False, last_decode_token=False)


def readout_config(config: CaptureConfig, last_prefill_token: bool) -> CaptureConfig:
    """The spans a top-k readout covers: as scores (:func:`score_config`), but the prompt's
    last row alone under ``last_prefill_token`` when the readout follows it (a lens on the
    last prompt token costs one row, not a prompt's worth)."""
    spans = score_config(config)
    if last_prefill_token and config.last_prefill_token:
        spans = replace(spans, last_prefill_token=True)
    return spans


def keep_plan(
    config: CaptureConfig, prompt_len: int, completion_index: int, end_known_in_worker: bool
) -> KeepPlan:
    """What the worker keeps for one completion, before it knows how many tokens it returns.

    Args:
        end_known_in_worker: the engine decides where generation ends (EOS, stop token ids,
            max_tokens). False with stop strings, which the front end matches after the worker
            may already have computed further positions: ``last_decode_token`` then keeps
            every decode row and the front end picks the last returned one.
    """
    prefill, decode = completion_spans(config, prompt_len, None, completion_index)
    latest_from = None
    if decode is not None and config.last_decode_token and end_known_in_worker:
        latest_from, decode = decode.lo, None
    spans = [s for s in (prefill, decode) if s is not None]
    dense = Span(min(s.lo for s in spans), max(s.hi for s in spans)) if spans else None
    return KeepPlan(dense, latest_from)
