"""Pooling-model throughput of probehook.LLM against plain vLLM, in one run.

``embed`` over a batch of sentences on all-MiniLM-L6-v2 (a 6-layer BERT, compiled mode), and the
tiny segmenter on a 256 x 256 image (1024 patch requests per input). Every configuration's
round is bracketed by two rounds of the plain engine and compared with their geometric mean;
the report quotes medians over rounds of that ratio (20 by default: on the 2-core machine the
median of 5 rounds moved by up to 0.2 between runs of the same code). Each round starts with a
garbage collection, so a full collection's pause lands on no particular configuration.
Configurations: one probe (scores only leave the worker), and one layer of rows plus the
probe.

Writes benchmarks/results/pooling.json and pooling.md. ``--smoke``: a few seconds' check that it
still runs (benchmarks/smoke.py: a few sentences, a small image, eager engines, nothing
written).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import smoke  # noqa: E402  (benchmarks/smoke.py)

RESULTS = Path(__file__).parent / "results"
BASELINE = "vLLM"
ONE_PROBE = "probehook, 1 probe"
ROWS_AND_PROBE = "probehook, 1 layer rows + 1 probe"


def sentences(n: int) -> list[str]:
    words = "the a cat dog sat ran on under mat sofa quickly slowly red blue big small"
    words = words.split()
    return [
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 24)) for i in range(n)
    ]


def bracketed(run: dict[str, Callable[[], int]], rounds: int) -> dict[str, object]:
    """Items per second of each configuration, and its ratio to the plain engine's rounds
    either side of it."""
    for fn in run.values():
        fn()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in run}
    ratios: dict[str, list[float]] = {name: [] for name in run if name != BASELINE}

    def rate(name: str) -> float:
        # A full collection of this process's heap (three engines' worth) takes ~0.4 s, more
        # than a round: start every round with none pending, as timeit does by disabling gc.
        gc.collect()
        start = time.perf_counter()
        items = run[name]()
        return items / (time.perf_counter() - start)

    base = rate(BASELINE)
    samples[BASELINE].append(base)
    for _ in range(rounds):
        for name in ratios:
            value = rate(name)
            after = rate(BASELINE)
            samples[name].append(value)
            samples[BASELINE].append(after)
            ratios[name].append(value / (base * after) ** 0.5)
            base = after
    return {
        "median_items_s": {n: statistics.median(s) for n, s in samples.items()},
        "median_bracketed_ratio": {n: statistics.median(s) for n, s in ratios.items()},
    }


def embed_workload(args: argparse.Namespace) -> dict[str, object]:
    import torch
    import vllm

    from probehook import LLM, LinearProbe
    from probehook.testing import minilm_path

    model = str(minilm_path())
    common = dict(dtype="float32", max_model_len=128, gpu_memory_utilization=0.1, seed=0)
    common |= smoke.engine_args(args)
    probe = LinearProbe(torch.randn(1, 384) / 384**0.5, torch.zeros(1), layer=3, kind="binary")
    texts = sentences(args.sentences)
    engines = {
        BASELINE: vllm.LLM(model, **common),
        ONE_PROBE: LLM(model, probes={"p": probe}, **common),
        ROWS_AND_PROBE: LLM(model, layers=[5], probes={"p": probe}, **common),
    }
    try:

        def embed(engine: object) -> Callable[[], int]:
            return lambda: len(engine.embed(texts, use_tqdm=False))  # type: ignore[attr-defined]

        return bracketed({name: embed(e) for name, e in engines.items()}, args.rounds)
    finally:
        smoke.shutdown(engines.values())


def segment_workload(args: argparse.Namespace) -> dict[str, object]:
    import numpy as np
    import torch
    import vllm

    from probehook import LLM, LinearProbe
    from probehook.models.segmenter import ENGINE_KWARGS, segmenter_path

    model = str(segmenter_path())
    common = dict(ENGINE_KWARGS, gpu_memory_utilization=0.1, seed=0, **smoke.engine_args(args))
    probe = LinearProbe(torch.randn(1, 32) / 32**0.5, torch.zeros(1), layer=1, kind="binary")
    image = Path(tempfile.mkdtemp()) / "image.npy"
    np.save(image, np.random.default_rng(0).random((args.image, args.image, 3)).astype("f4"))
    engines = {
        BASELINE: vllm.LLM(model, **common),
        ONE_PROBE: LLM(model, probes={"p": probe}, **common),
        ROWS_AND_PROBE: LLM(model, layers=[2], probes={"p": probe}, **common),
    }
    try:

        def segment(engine: object) -> Callable[[], int]:
            def run() -> int:
                data = {"data": {"image": str(image)}}
                engine.encode(data, pooling_task="plugin", use_tqdm=False)  # type: ignore[attr-defined]
                return (args.image // 8) ** 2  # patches

            return run

        return bracketed({name: segment(e) for name, e in engines.items()}, args.rounds)
    finally:
        smoke.shutdown(engines.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--image", type=int, default=256)
    smoke.add_flag(parser)
    args = smoke.shrink(parser.parse_args(), rounds=1, sentences=8, image=32)
    report = {"workload": vars(args)}
    report["embed"] = embed_workload(args)
    report["segment"] = segment_workload(args)
    lines = [
        f"Workloads: `embed` of {args.sentences} sentences (8-31 words) on all-MiniLM-L6-v2, "
        f"{'eager' if args.smoke else 'compiled'}; the tiny segmenter on a "
        f"{args.image}x{args.image} image "
        f"({(args.image // 8) ** 2} patch requests), eager (it has no compiled path). "
        f"{args.rounds} bracketed rounds each.",
        "",
        "| workload | config | median items/s | median bracketed ratio |",
        "| --- | --- | --- | --- |",
    ]
    for workload, unit in (("embed", "sentences"), ("segment", "patches")):
        result = report[workload]
        for name, value in result["median_items_s"].items():  # type: ignore[index]
            ratio = result["median_bracketed_ratio"].get(name, 1.0)  # type: ignore[index]
            lines.append(f"| {workload} | {name} | {value:.1f} {unit}/s | {ratio:.3f} |")
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "pooling.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "pooling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
