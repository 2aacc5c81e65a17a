"""Streaming throughput of probehook.AsyncLLM against plain vLLM AsyncLLM, in one run.

N concurrent streams (``generate`` with vLLM's default CUMULATIVE outputs) on each engine, all
engines compiled and alive in this process on one event loop. Every configuration's round is
bracketed by two rounds of plain AsyncLLM (B c1 B c2 B ...) and compared with their geometric
mean; the report quotes medians over rounds of that ratio, and of time to first token.
Configurations: one probe, no rows (what the issue's >= 0.95 target is about), and one layer
of rows plus the probe.

Writes benchmarks/results/async_streams.json and async_streams.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

RESULTS = Path(__file__).parent / "results"
BASELINE = "vLLM AsyncLLM"
ONE_PROBE = "probehook AsyncLLM, 1 probe"
ROWS_AND_PROBE = "probehook AsyncLLM, 1 layer rows + 1 probe"


def build_engines(model_dir: str, max_model_len: int, hidden: int) -> dict[str, object]:
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM as VllmAsyncLLM

    from probehook import AsyncLLM, LinearProbe

    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=max_model_len, seed=0)
    g = torch.Generator().manual_seed(0)
    probe = LinearProbe(
        torch.randn(1, hidden, generator=g) / hidden**0.5, torch.zeros(1), layer=4, kind="binary"
    )
    return {
        BASELINE: VllmAsyncLLM.from_engine_args(
            AsyncEngineArgs(model=model_dir, disable_log_stats=True, **common)
        ),
        ONE_PROBE: AsyncLLM(model_dir, probes={"p": probe}, disable_log_stats=True, **common),
        ROWS_AND_PROBE: AsyncLLM(
            model_dir, layers=[4], probes={"p": probe}, disable_log_stats=True, **common
        ),
    }


async def run_once(engine: object, prompts: list[dict], max_tokens: int) -> tuple[float, float]:
    """Tokens per second over all streams, and the median time to first token (s)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    async def stream(prompt: dict) -> tuple[int, float]:
        start = time.perf_counter()
        first = None
        last = None
        async for out in engine.generate(prompt, params, uuid.uuid4().hex):  # type: ignore[attr-defined]
            if first is None:
                first = time.perf_counter() - start
            last = out
        assert last is not None and first is not None
        tokens = len(last.outputs[0].token_ids)
        scores = getattr(last.outputs[0], "probe_scores", {})
        if "p" in scores:
            assert len(scores["p"]) == tokens  # every token's score arrived
        return tokens, first

    start = time.perf_counter()
    results = await asyncio.gather(*(stream(p) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(tokens == max_tokens for tokens, _ in results)
    return sum(t for t, _ in results) / elapsed, statistics.median(f for _, f in results)


async def measure(args: argparse.Namespace, engines: dict[str, object], prompts: list[dict]):
    for engine in engines.values():  # warm-up outside the measurement
        await run_once(engine, prompts, 8)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    bracketed: dict[str, list[float]] = {name: [] for name in engines if name != BASELINE}
    ttft_ratio: dict[str, list[float]] = {name: [] for name in bracketed}
    for round_index in range(args.rounds):
        base, base_ttft = await run_once(engines[BASELINE], prompts, args.max_tokens)
        samples[BASELINE].append(base)
        ttft[BASELINE].append(base_ttft)
        for name in bracketed:
            value, first = await run_once(engines[name], prompts, args.max_tokens)
            after, after_ttft = await run_once(engines[BASELINE], prompts, args.max_tokens)
            samples[name].append(value)
            ttft[name].append(first)
            samples[BASELINE].append(after)
            ttft[BASELINE].append(after_ttft)
            bracketed[name].append(value / (base * after) ** 0.5)
            ttft_ratio[name].append(first / (base_ttft * after_ttft) ** 0.5)
            base, base_ttft = after, after_ttft
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{n}: {s[-1]:.0f} tok/s" for n, s in samples.items()),
            flush=True,
        )
    return samples, ttft, bracketed, ttft_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    from probehook.testing import write_dummy_config

    model_dir = write_dummy_config(
        Path(tempfile.mkdtemp()) / "llama-dummy", hidden_size=args.hidden, num_layers=args.layers
    )
    prompts = [
        {"prompt_token_ids": [(i * 131 + j * 17) % 30000 + 100 for j in range(args.prompt_len)]}
        for i in range(args.streams)
    ]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    engines = loop.run_until_complete(_build(model_dir, args))
    try:
        samples, ttft, bracketed, ttft_ratio = loop.run_until_complete(
            measure(args, engines, prompts)
        )
    finally:
        for engine in engines.values():
            engine.shutdown()  # type: ignore[attr-defined]
    report = {
        "workload": vars(args),
        "median_tok_s": {n: statistics.median(s) for n, s in samples.items()},
        "median_ttft_ms": {n: 1e3 * statistics.median(s) for n, s in ttft.items()},
        "median_bracketed_ratio": {n: statistics.median(s) for n, s in bracketed.items()},
        "median_ttft_ratio": {n: statistics.median(s) for n, s in ttft_ratio.items()},
    }
    lines = [
        f"Workload: Llama hidden {args.hidden}, {args.layers} layers, bf16 dummy weights, "
        f"{args.streams} concurrent streams x {args.prompt_len} prompt tokens -> "
        f"{args.max_tokens} new tokens, {args.rounds} bracketed rounds, compiled mode.",
        "",
        "| config | median tok/s | median bracketed ratio | median TTFT ms | TTFT ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in engines:
        ratio = report["median_bracketed_ratio"].get(name, 1.0)
        t_ratio = report["median_ttft_ratio"].get(name, 1.0)
        lines.append(
            f"| {name} | {report['median_tok_s'][name]:.1f} | {ratio:.3f} | "
            f"{report['median_ttft_ms'][name]:.1f} | {t_ratio:.3f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async_streams.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "async_streams.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


async def _build(model_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    # Built inside the loop: vLLM's AsyncLLM starts its output handler on the running loop.
    return build_engines(str(model_dir), args.prompt_len + args.max_tokens + 16, args.hidden)


if __name__ == "__main__":
    main()
