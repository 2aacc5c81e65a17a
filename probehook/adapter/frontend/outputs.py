"""vLLM's output classes with probehook's attributes documented, and the read-only aliases
that users of vllm-probe-hook type (``hidden``, ``prefill_hidden``).

Finished outputs get these classes (subclasses of vLLM's, so ``isinstance`` checks and every
vLLM attribute keep working) when probehook fills them with their rows.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.outputs import CompletionOutput, RequestOutput

from probehook.frontend.fill import completions, derive

Rows = dict[int, torch.Tensor]
Scores = dict[str, torch.Tensor]


class CapturedCompletionOutput(CompletionOutput):
    """``vllm.CompletionOutput`` plus ``hidden_states`` (layer -> ``[n_generated, hidden]``),
    ``probe_scores`` (probe name -> ``[n_generated]``, or ``[n_generated, n_classes]`` for a
    multi-class probe; row ``i`` scores the state that produced token ``i``) and
    ``probe_flags`` (probe name -> the rows where a flag monitor's threshold was crossed)."""

    hidden_states: Rows
    probe_scores: Scores
    probe_flags: dict[str, list[int]]

    @property
    def hidden(self) -> Rows:
        """Alias of ``hidden_states`` (vllm-probe-hook's name)."""
        return self.hidden_states


class CapturedRequestOutput(RequestOutput):
    """``vllm.RequestOutput`` plus ``prefill_hidden_states`` (layer -> ``[n_prompt, hidden]``),
    ``prefill_probe_scores`` (probe name -> one score per prompt token), and the first
    completion's ``hidden_states`` and ``probe_scores``."""

    hidden_states: Rows
    prefill_hidden_states: Rows
    probe_scores: Scores
    prefill_probe_scores: Scores
    store_id: str | None
    """The request's key in the activation store (``store[store_id]``); None when it was not
    stored (no store, capture switched off, or its capture failed)."""

    @property
    def hidden(self) -> Rows:
        """Alias of ``hidden_states`` (vllm-probe-hook's name)."""
        return self.hidden_states

    @property
    def prefill_hidden(self) -> Rows:
        """Alias of ``prefill_hidden_states`` (vllm-probe-hook's name)."""
        return self.prefill_hidden_states


def decorate(output: Any) -> None:
    """Finish an output for the user: probehook's output classes (on it and its completions),
    then every registered output processor's derived values (``OutputProcessor.fill``)."""
    if type(output) is RequestOutput:
        output.__class__ = CapturedRequestOutput
    for completion in completions(output):
        if type(completion) is CompletionOutput:
            completion.__class__ = CapturedCompletionOutput
    derive(output)
