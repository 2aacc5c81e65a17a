"""Streaming throughput of probehook.AsyncLLM against plain vLLM AsyncLLM, in one run.

N concurrent streams (``generate`` with vLLM's default CUMULATIVE outputs) on each engine, all
engines compiled and alive in this process on one event loop. Every configuration's round is
bracketed by two rounds of plain AsyncLLM (B c1 B c2 B ...) and compared with their geometric
mean; the report quotes medians over rounds of that ratio, and of time to first token.
Configurations: one probe, no rows (what the issue's >= 0.95 target is about), and one layer
of rows plus the probe.

Then the front end's cost per yield of ONE long cumulative stream with SAE features (an
engine with one random SAE of ``--sae-features`` features on the middle layer, nothing else
captured): the time ``RequestStream.fill`` takes to fill a yielded output with the features of
every token to date, early in the stream (around token ``--sae-early``, 100) and late (the last
tokens of ``--sae-tokens``, 2,000), medians of the yields in each window, and their ratio.
Each row is decoded once per stream, so the late yields should cost about what the early ones
do (a ratio near 1; it grew with the stream's length when every yield decoded every row).
``--only sae-stream`` runs this part alone.

Writes benchmarks/results/async_streams.json and async_streams.md (``--only``:
async_streams.sae-stream.*). ``--smoke``: a few seconds' check that it still runs
(benchmarks/smoke.py: tiny model, eager engines, no one-probe engine, a 40-token SAE stream,
nothing written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).parent))

import smoke  # noqa: E402  (benchmarks/smoke.py)

RESULTS = Path(__file__).parent / "results"
SAE_STREAM = "sae-stream"
BASELINE = "vLLM AsyncLLM"
ONE_PROBE = "probehook AsyncLLM, 1 probe"
ROWS_AND_PROBE = "probehook AsyncLLM, 1 layer rows + 1 probe"


def build_engines(
    model_dir: str,
    max_model_len: int,
    hidden: int,
    layer: int,
    smoke_args: dict | None = None,
    sae: dict | None = None,
) -> dict[str, object]:
    """The configurations; ``smoke_args``: smoke mode's engine arguments (benchmarks/smoke.py),
    and no one-probe engine (the rows + probe engine runs the same path and more). ``sae``:
    the rows + probe engine's SAE arguments too (smoke mode runs the SAE stream on it: one
    engine core fewer)."""
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM as VllmAsyncLLM

    from probehook import AsyncLLM, LinearProbe

    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=max_model_len, seed=0)
    common |= smoke_args or {}
    g = torch.Generator().manual_seed(0)
    probe = LinearProbe(
        torch.randn(1, hidden, generator=g) / hidden**0.5,
        torch.zeros(1),
        layer=layer,
        kind="binary",
    )
    engines = {
        BASELINE: VllmAsyncLLM.from_engine_args(
            AsyncEngineArgs(model=model_dir, disable_log_stats=True, **common)
        )
    }
    if not smoke_args:
        engines[ONE_PROBE] = AsyncLLM(
            model_dir, probes={"p": probe}, disable_log_stats=True, **common
        )
    engines[ROWS_AND_PROBE] = AsyncLLM(
        model_dir,
        layers=[layer],
        probes={"p": probe},
        disable_log_stats=True,
        **(sae or {}),
        **common,
    )
    return engines


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


def sae_arguments(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    """The SAE stream engine's SAE: one random standard SAE (``--sae-features``) on the
    middle layer, read at top-``--sae-top-k``, named "s"."""
    from saes import write_sae

    folder = model_dir.parent / "sae"
    if not folder.exists():
        write_sae(folder, args.hidden, args.sae_features, args.layers // 2, seed=0)
    return {"saes": {"s": folder}, "sae_top_k": args.sae_top_k}


async def build_sae_engine(args: argparse.Namespace, model_dir: Path) -> object:
    """An AsyncLLM with the SAE alone, nothing else captured (built inside the running loop:
    vLLM's AsyncLLM starts its output handler on it)."""
    from probehook import AsyncLLM

    return AsyncLLM(
        str(model_dir),
        disable_log_stats=True,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.prompt_len + args.sae_tokens + 16,
        seed=0,
        **sae_arguments(args, model_dir),
        **smoke.engine_args(args),
    )


async def sae_stream(args: argparse.Namespace, engine: object) -> dict[str, object]:
    """One cumulative stream of ``args.sae_tokens`` tokens with SAE "s"'s features on
    ``engine``; the time ``RequestStream.fill`` takes per yielded output, by the output's
    token count."""
    from vllm import SamplingParams

    from probehook.frontend.request_stream import RequestStream

    fills: list[tuple[int, float]] = []
    fill = RequestStream.fill

    async def timed_fill(self: RequestStream, output: object) -> None:
        start = time.perf_counter()
        await fill(self, output)
        elapsed = time.perf_counter() - start
        fills.append((len(output.outputs[0].token_ids), elapsed))  # type: ignore[attr-defined]

    async def stream(max_tokens: int) -> tuple[int, int]:
        prompt = {"prompt_token_ids": [(j * 17) % 30000 + 100 for j in range(args.prompt_len)]}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        last, yields = None, 0
        async for out in engine.generate(prompt, params, uuid.uuid4().hex):  # type: ignore[attr-defined]
            last, yields = out, yields + 1
        assert last is not None
        tokens = len(last.outputs[0].token_ids)
        assert tokens == max_tokens and len(last.outputs[0].sae_features["s"]) == tokens
        return tokens, yields

    RequestStream.fill = timed_fill  # type: ignore[method-assign]
    try:
        await stream(8)  # warm-up outside the measurement
        fills.clear()
        start = time.perf_counter()
        tokens, yields = await stream(args.sae_tokens)
        elapsed = time.perf_counter() - start
    finally:
        RequestStream.fill = fill  # type: ignore[method-assign]
    half = max(1, min(50, args.sae_early // 2))  # 50-150 and 1900-2000 by default
    windows = {
        "early": (args.sae_early - half, args.sae_early + half),
        "late": (tokens - 2 * half, tokens),
    }
    medians = {}
    for name, (lo, hi) in windows.items():
        got = [seconds for count, seconds in fills if lo <= count <= hi]
        assert got, f"no yield held {lo}-{hi} tokens"
        medians[name] = statistics.median(got)
    return {
        "tokens": tokens,
        "yields": yields,
        "tokens_per_s": tokens / elapsed,
        "windows_tokens": windows,
        "median_fill_us": {k: 1e6 * v for k, v in medians.items()},
        "late_over_early": medians["late"] / medians["early"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sae-tokens", type=int, default=2000)
    parser.add_argument("--sae-early", type=int, default=100)
    parser.add_argument("--sae-features", type=int, default=16384)
    parser.add_argument("--sae-top-k", type=int, default=32)
    parser.add_argument(
        "--only", choices=[SAE_STREAM], help="measure only the SAE stream's cost per yield"
    )
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(),
        rounds=1,
        streams=4,
        prompt_len=8,
        max_tokens=4,
        hidden=128,
        layers=2,
        sae_tokens=40,
        sae_early=10,
        sae_features=512,
        sae_top_k=8,
    )

    model_dir = smoke.dummy_model(
        Path(tempfile.mkdtemp()) / "llama-dummy", hidden=args.hidden, layers=args.layers
    )
    prompts = [
        {"prompt_token_ids": [(i * 131 + j * 17) % 30000 + 100 for j in range(args.prompt_len)]}
        for i in range(args.streams)
    ]
    report: dict[str, object] = {"workload": vars(args)}
    lines: list[str] = []
    with asyncio.Runner() as runner:
        if args.only is None:
            engines = runner.run(_build(model_dir, args))
            try:
                samples, ttft, bracketed, ttft_ratio = runner.run(measure(args, engines, prompts))
                if args.smoke:  # the rows + probe engine has the SAE: no engine of its own
                    report[SAE_STREAM] = runner.run(sae_stream(args, engines[ROWS_AND_PROBE]))
            finally:
                for engine in engines.values():
                    engine.shutdown()  # type: ignore[attr-defined]
            report |= {
                "median_tok_s": {n: statistics.median(s) for n, s in samples.items()},
                "median_ttft_ms": {n: 1e3 * statistics.median(s) for n, s in ttft.items()},
                "median_bracketed_ratio": {n: statistics.median(s) for n, s in bracketed.items()},
                "median_ttft_ratio": {n: statistics.median(s) for n, s in ttft_ratio.items()},
            }
            lines += [
                f"Workload: Llama hidden {args.hidden}, {args.layers} layers, bf16 dummy weights, "
                f"{args.streams} concurrent streams x {args.prompt_len} prompt tokens -> "
                f"{args.max_tokens} new tokens, {args.rounds} bracketed rounds, "
                f"{'eager' if args.smoke else 'compiled'} mode.",
                "",
                "| config | median tok/s | median bracketed ratio | median TTFT ms | TTFT ratio |",
                "| --- | --- | --- | --- | --- |",
            ]
            for name in engines:
                ratio = report["median_bracketed_ratio"].get(name, 1.0)  # type: ignore[union-attr]
                t_ratio = report["median_ttft_ratio"].get(name, 1.0)  # type: ignore[union-attr]
                lines.append(
                    f"| {name} | {report['median_tok_s'][name]:.1f} | {ratio:.3f} | "  # type: ignore[index]
                    f"{report['median_ttft_ms'][name]:.1f} | {t_ratio:.3f} |"  # type: ignore[index]
                )
            lines.append("")
        if SAE_STREAM not in report:
            engine = runner.run(build_sae_engine(args, model_dir))
            try:
                report[SAE_STREAM] = runner.run(sae_stream(args, engine))
            finally:
                engine.shutdown()  # type: ignore[attr-defined]
    cost = report[SAE_STREAM]
    (early_lo, early_hi), (late_lo, late_hi) = cost["windows_tokens"].values()  # type: ignore[union-attr]
    fill_us = cost["median_fill_us"]
    lines += [
        f"One cumulative stream with SAE features (1 SAE of {args.sae_features} features on "
        f"layer {args.layers // 2}, top-{args.sae_top_k}, "
        f"{'on the rows + probe engine' if args.smoke else 'nothing else captured'}), "
        f"{args.prompt_len} prompt tokens -> {cost['tokens']} tokens in {cost['yields']} yields "
        f"({cost['tokens_per_s']:.1f} tok/s); the front end's fill of one yielded output "
        "(`RequestStream.fill`), median of the yields in each window:",
        "",
        "| yields holding | median fill µs |",
        "| --- | --- |",
        f"| tokens {early_lo}-{early_hi} (early) | {fill_us['early']:.1f} |",  # type: ignore[index]
        f"| tokens {late_lo}-{late_hi} (late) | {fill_us['late']:.1f} |",  # type: ignore[index]
        "",
        f"Late / early: {cost['late_over_early']:.2f}x",
    ]
    if not args.smoke:
        name = "async_streams" if args.only is None else f"async_streams.{args.only}"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
        (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


async def _build(model_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    # Built inside the loop: vLLM's AsyncLLM starts its output handler on the running loop.
    length = args.prompt_len + args.max_tokens + 16
    if args.smoke:  # the rows + probe engine runs the SAE stream too
        length = max(length, args.prompt_len + args.sae_tokens + 16)
    return build_engines(
        str(model_dir),
        length,
        args.hidden,
        args.layers // 2,
        smoke.engine_args(args),
        sae_arguments(args, model_dir) if args.smoke else None,
    )


if __name__ == "__main__":
    main()
