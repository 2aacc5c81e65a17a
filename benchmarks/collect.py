"""Collection throughput (`make bench`): capture-only engines against plain compiled vLLM, and
a collection on 1 and 2 replicas, measured in one run.

1. Prompt throughput on the benchmark model (Llama hidden 1024, 8 layers, dummy bf16
   weights, compiled), capturing layer L/4 = 2: plain vLLM ``generate(max_tokens=1)`` (the
   baseline: the cheapest way plain vLLM reads a prompt), probehook's capture-only engine
   (``capture()``, rows returned; it stops after layer 2), and a full probehook engine asked
   for the same rows with ``generate(max_tokens=1)``. Every call reads new prompts (plain vLLM
   would read repeated ones from its prefix cache). Every configuration's round is bracketed
   by two baseline rounds (``pooling.bracketed``); the report quotes medians of the ratios.
2. A collection into a store on tmpfs (``probehook.collect.collect``, layer 2, capture-only,
   compiled) on 1 replica (this process, both cores) and on 2 replicas (Ray actors, one core
   each): prompt tokens per second over the collection (engine start-up excluded) and per
   core, alternating the two over the rounds.

Writes benchmarks/results/collect.json and collect.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

from pooling import BASELINE, bracketed  # noqa: E402  (one bracketing rule for benchmarks)

RESULTS = Path(__file__).parent / "results"
CAPTURE_ONLY = "probehook capture-only, layer 2 rows"
FULL = "probehook generate(max_tokens=1), layer 2 prompt rows"


def token_prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (count, length), generator=g)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def capture_only_ratio(model: str, args: argparse.Namespace) -> dict[str, object]:
    import vllm

    from probehook import LLM, SamplingParams

    common = dict(load_format="dummy", max_model_len=args.prompt_len + 16, seed=0)
    seeds = itertools.count(1)
    tokens = args.prompts * args.prompt_len

    def prompts() -> list[dict]:
        # New prompts every call: plain vLLM would read repeated ones from its prefix cache
        # (capture requests skip reading it, to recompute every row).
        return token_prompts(args.prompts, args.prompt_len, 32000, seed=next(seeds))

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engines = {
        BASELINE: vllm.LLM(model, **common),
        CAPTURE_ONLY: LLM(model, layers=[args.layer], capture_only=True, **common),
        FULL: LLM(model, layers=[args.layer], include_prefill=True, include_decode=False, **common),
    }
    run = {
        BASELINE: lambda: len(engines[BASELINE].generate(prompts(), one, use_tqdm=False)),
        CAPTURE_ONLY: lambda: len(engines[CAPTURE_ONLY].capture(prompts(), use_tqdm=False)),
        FULL: lambda: len(engines[FULL].generate(prompts(), one, use_tqdm=False)),
    }
    run = {name: (lambda fn=fn: fn() and tokens) for name, fn in run.items()}  # prompt tokens
    try:
        return bracketed(run, args.rounds)
    finally:
        for engine in engines.values():
            engine.llm_engine.engine_core.shutdown()


def replicas_scaling(model: str, args: argparse.Namespace) -> dict[str, object]:
    from probehook.collect import collect

    prompts = token_prompts(args.collect_prompts, args.prompt_len, 32000, seed=2)
    texts = [p["prompt_token_ids"] for p in prompts]
    rates: dict[int, list[float]] = {1: [], 2: []}
    cores = len(os.sched_getaffinity(0))
    for _ in range(args.collect_rounds):
        for replicas in (1, 2):
            store = Path(tempfile.mkdtemp(dir="/dev/shm")) / "store"
            try:
                result = collect(
                    model,
                    texts,
                    store=store,
                    layers=[args.layer],
                    replicas=replicas,
                    batch_size=args.batch_size,
                    progress=False,
                    load_format="dummy",
                    max_model_len=args.prompt_len + 16,
                )
            finally:
                shutil.rmtree(store.parent, ignore_errors=True)
            rates[replicas].append(result.tokens_per_second)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    return {
        "cores": cores,
        "tokens_per_s": {"1 replica": rates[1], "2 replicas": rates[2]},
        "median_tokens_per_s": {"1 replica": one, "2 replicas": two},
        "median_tokens_per_s_per_core": {"1 replica": one / cores, "2 replicas": two / cores},
        "two_over_one": two / one,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--collect-prompts", type=int, default=512)
    parser.add_argument("--collect-rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    from probehook.testing import write_dummy_config

    model = str(write_dummy_config(Path(tempfile.mkdtemp()) / "llama-dummy"))
    report: dict[str, object] = {"workload": vars(args)}
    report["capture_only"] = ratio = capture_only_ratio(model, args)
    report["replicas"] = scaling = replicas_scaling(model, args)
    lines = [
        f"Workload: Llama hidden 1024, 8 layers, dummy bf16 weights, compiled; {args.prompts} "
        f"prompts of {args.prompt_len} tokens, layer {args.layer} (L/4); {args.rounds} "
        "bracketed rounds.",
        "",
        "| config | median prompt tokens/s | median bracketed ratio to vLLM |",
        "| --- | --- | --- |",
    ]
    for name, value in ratio["median_items_s"].items():  # type: ignore[union-attr]
        r = ratio["median_bracketed_ratio"].get(name, 1.0)  # type: ignore[union-attr]
        lines.append(f"| {name} | {value:,.0f} | {r:.3f} |")
    lines += [
        "",
        f"Collection of {args.collect_prompts} prompts x {args.prompt_len} tokens, layer "
        f"{args.layer}, store on tmpfs, {scaling['cores']} cores, median of "
        f"{args.collect_rounds} rounds:",
        "",
        "| replicas | tokens/s | tokens/s per core |",
        "| --- | --- | --- |",
    ]
    for name, value in scaling["median_tokens_per_s"].items():  # type: ignore[union-attr]
        per_core = scaling["median_tokens_per_s_per_core"][name]  # type: ignore[index]
        lines.append(f"| {name} | {value:,.0f} | {per_core:,.0f} |")
    lines.append(f"\n2 replicas / 1 replica: {scaling['two_over_one']:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "collect.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "collect.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
