"""A patching sweep's requests as vLLM sampling parameters (``probehook.frontend.patch_sweep``):
one greedy token, the full-row log-probs of the answer and the foil (vLLM's
``logprob_token_ids``: the log-softmax over the whole vocabulary, never a top-k list)."""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams

from probehook.core.request_options import EXTRA_ARGS_KEY


def sweep_params(options: dict[str, Any], token_ids: list[int]) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(token_ids),
                          extra_args={EXTRA_ARGS_KEY: options})  # fmt: skip
