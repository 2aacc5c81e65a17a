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

Writes benchmarks/results/collect.json and collect.md. ``--smoke``: a few seconds' check that
it still runs (benchmarks/smoke.py: hidden 128, 4 layers, eager engines, a collection on 1
replica only: no Ray cluster, whose replicas tests/test_collect.py runs; nothing written).
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

import smoke  # noqa: E402  (benchmarks/smoke.py)
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

    common = dict(
        load_format="dummy", max_model_len=args.prompt_len + 16, seed=0, **smoke.engine_args(args)
    )
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
        smoke.shutdown(engines.values())


def replicas_scaling(model: str, args: argparse.Namespace) -> dict[str, object]:
    from probehook.collect import collect

    prompts = token_prompts(args.collect_prompts, args.prompt_len, 32000, seed=2)
    texts = [p["prompt_token_ids"] for p in prompts]
    counts = (1,) if args.smoke else (1, 2)  # smoke: no Ray cluster
    rates: dict[int, list[float]] = {n: [] for n in counts}
    cores = len(os.sched_getaffinity(0))
    for _ in range(args.collect_rounds):
        for replicas in counts:
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
                    **smoke.engine_args(args),
                )
            finally:
                shutil.rmtree(store.parent, ignore_errors=True)
            rates[replicas].append(result.tokens_per_second)
    names = {n: f"{n} replica" + ("s" if n > 1 else "") for n in counts}
    medians = {names[n]: statistics.median(rates[n]) for n in counts}
    return {
        "cores": cores,
        "tokens_per_s": {names[n]: rates[n] for n in counts},
        "median_tokens_per_s": medians,
        "median_tokens_per_s_per_core": {name: v / cores for name, v in medians.items()},
        "two_over_one": medians["2 replicas"] / medians["1 replica"] if 2 in counts else None,
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
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(),
        rounds=1,
        prompts=4,
        prompt_len=16,
        collect_prompts=8,
        collect_rounds=1,
        batch_size=4,
        hidden=128,
        layers=4,
    )
    folder = Path(tempfile.mkdtemp()) / "llama-dummy"
    model = str(smoke.dummy_model(folder, hidden=args.hidden, layers=args.layers))
    report: dict[str, object] = {"workload": vars(args)}
    report["capture_only"] = ratio = capture_only_ratio(model, args)
    report["replicas"] = scaling = replicas_scaling(model, args)
    lines = [
        f"Workload: Llama hidden {args.hidden}, {args.layers} layers, dummy bf16 weights, "
        f"{'eager' if args.smoke else 'compiled'}; {args.prompts} prompts of {args.prompt_len} "
        f"tokens, layer {args.layer}{' (L/4)' if 4 * args.layer == args.layers else ''}; "
        f"{args.rounds} bracketed rounds.",
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
    if scaling["two_over_one"] is not None:
        lines.append(f"\n2 replicas / 1 replica: {scaling['two_over_one']:.2f}x")
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "collect.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "collect.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
