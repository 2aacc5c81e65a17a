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


def noise_write(plan: Any, stats: list[Any]) -> tuple[int, bytes, int]:
    """The ``probehook_patch_rows`` arguments of a sweep plan's noise rows: ``scale`` times
    the input embeddings' standard deviation (``stats``: every rank's
    ``probehook_embedding_stats``, vocabulary shards) times seeded normal draws
    (``probehook.frontend.patch_sweep.noise_rows``: the same on every rank)."""
    from probehook.frontend.patch_sweep import embedding_std, noise_rows

    stats = [s for s in stats if s is not None]
    std = embedding_std(stats)
    start, end = plan.noise["span"]
    rows = noise_rows(plan.noise["seed"], end - start, int(stats[0][3]), plan.noise["scale"], std)
    plan.noise["std"] = std
    return plan.noise["first"], rows.tobytes(), end - start
