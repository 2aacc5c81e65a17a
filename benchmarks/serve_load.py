"""Serving throughput: ``probehook serve`` against plain ``vllm serve``, in one run.

Both servers run at once (compiled mode, the same dummy-weight model and flags; probehook's
with one layer and one probe it may capture). A round sends N concurrent streaming
completions from the ``openai`` async client to one server and measures generated tokens per
second and time to first token. Each probehook configuration's round is bracketed by two
rounds on plain vLLM and compared with their geometric mean; medians over rounds are reported.

Configurations: requests that ask for nothing (capture configured, off per request), requests
that ask for the probe's scores, and requests that ask for the scores and one layer of rows.

Writes benchmarks/results/serve_load.json and serve_load.md. ``--smoke``: a short check that it
still runs (benchmarks/smoke.py: tiny model, eager servers, one round, nothing written); its
time is the two servers' start-up (each a process and an engine core importing vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import smoke  # noqa: E402  (benchmarks/smoke.py)

RESULTS = Path(__file__).parent / "results"
BASELINE = "vllm serve"


def configs(layer: int) -> dict[str, dict | None]:
    """What each configuration's requests ask for; ``layer``: the captured layer (4 of 8)."""
    return {
        "probehook serve, request asks nothing": None,
        "probehook serve, 1 probe": {"probes": ["p"]},
        "probehook serve, 1 probe + 1 layer rows": {"probes": ["p"], "layers": [layer]},
    }


async def run_once(
    client: Any, prompts: list[list[int]], max_tokens: int, ask: dict | None
) -> tuple[float, float]:
    """Tokens per second over all streams, and the median time to first token (s)."""

    async def stream(prompt: list[int]) -> tuple[int, float]:
        body: dict[str, Any] = {"ignore_eos": True}
        if ask is not None:
            body["probehook"] = ask
        start = time.perf_counter()
        first, tokens, scores = None, 0, 0
        response = await client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={**body, "return_token_ids": True},
        )
        async for chunk in response:
            for choice in chunk.choices:
                new = len((choice.model_extra or {}).get("token_ids") or ())
                if new and first is None:
                    first = time.perf_counter() - start
                tokens += new
                field = (choice.model_extra or {}).get("probehook") or {}
                scores += len(field.get("probe_scores", {}).get("p", ()))
        assert first is not None and tokens == max_tokens, tokens
        assert scores == (tokens if ask else 0)  # every token's score arrived
        return tokens, first

    start = time.perf_counter()
    results = await asyncio.gather(*(stream(p) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(t for t, _ in results) / elapsed, statistics.median(f for _, f in results)


async def measure(args: argparse.Namespace, urls: dict[str, str], prompts: list[list[int]]):
    import openai

    plain = openai.AsyncOpenAI(base_url=urls["vllm"], api_key="x", max_retries=0, timeout=600)
    ours = openai.AsyncOpenAI(base_url=urls["probehook"], api_key="x", max_retries=0, timeout=600)
    asks = configs(args.layers // 2)
    await run_once(plain, prompts, 8, None)  # warm-up outside the measurement
    for ask in asks.values():
        await run_once(ours, prompts, 8, ask)
    samples: dict[str, list[float]] = {name: [] for name in [BASELINE, *asks]}
    ttft: dict[str, list[float]] = {name: [] for name in samples}
    ratio: dict[str, list[float]] = {name: [] for name in asks}
    ttft_ratio: dict[str, list[float]] = {name: [] for name in asks}
    for round_index in range(args.rounds):
        base, base_ttft = await run_once(plain, prompts, args.max_tokens, None)
        for name, ask in asks.items():
            value, first = await run_once(ours, prompts, args.max_tokens, ask)
            after, after_ttft = await run_once(plain, prompts, args.max_tokens, None)
            samples[name].append(value)
            ttft[name].append(first)
            samples[BASELINE] += [after]
            ttft[BASELINE] += [after_ttft]
            ratio[name].append(value / (base * after) ** 0.5)
            ttft_ratio[name].append(first / (base_ttft * after_ttft) ** 0.5)
            base, base_ttft = after, after_ttft
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{n}: {s[-1]:.0f} tok/s" for n, s in samples.items()),
            flush=True,
        )
    return samples, ttft, ratio, ttft_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(), rounds=1, clients=4, prompt_len=8, max_tokens=4, hidden=128, layers=2
    )

    import torch

    from probehook import LinearProbe
    from probehook.testing import ServerProcess

    work = Path(tempfile.mkdtemp())
    model_dir = smoke.dummy_model(work / "llama-dummy", hidden=args.hidden, layers=args.layers)
    layer = args.layers // 2
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1, args.hidden, generator=g) / args.hidden**0.5
    probe = LinearProbe(weight, torch.zeros(1), layer=layer, kind="binary", name="p")
    probe_path = probe.save(work / "p.safetensors")
    common = [str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0"]
    common += ["--max-model-len", str(args.prompt_len + args.max_tokens + 16)]
    common += ["--served-model-name", "m", "--disable-log-stats", "--disable-uvicorn-access-log"]
    common += smoke.server_args(args)
    capture = ["--layers", str(layer), "--probe", f"p={probe_path}"]
    servers = {
        "vllm": ServerProcess(common, work / "vllm.log", program="vllm"),
        "probehook": ServerProcess(common + capture, work / "probehook.log"),
    }
    try:
        for server in servers.values():
            server.wait(1200)
        urls = {name: server.base_url for name, server in servers.items()}
        prompts = [
            [(i * 131 + j * 17) % 30000 + 100 for j in range(args.prompt_len)]
            for i in range(args.clients)
        ]
        samples, ttft, ratio, ttft_ratio = asyncio.run(measure(args, urls, prompts))
    finally:
        for server in servers.values():
            server.stop()
    report = {
        "workload": vars(args),
        "median_tok_s": {n: statistics.median(s) for n, s in samples.items()},
        "median_ttft_ms": {n: 1e3 * statistics.median(s) for n, s in ttft.items()},
        "median_bracketed_ratio": {n: statistics.median(s) for n, s in ratio.items()},
        "median_ttft_ratio": {n: statistics.median(s) for n, s in ttft_ratio.items()},
    }
    lines = [
        f"Workload: Llama hidden {args.hidden}, {args.layers} layers, bf16 dummy weights, "
        f"{args.clients} concurrent streaming clients x {args.prompt_len} prompt tokens -> "
        f"{args.max_tokens} new tokens, {args.rounds} bracketed rounds, "
        f"{'eager' if args.smoke else 'compiled'} mode, both servers on this machine.",
        "",
        "| config | median tok/s | median bracketed ratio | median TTFT ms | TTFT ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in samples:
        lines.append(
            f"| {name} | {report['median_tok_s'][name]:.1f} | "
            f"{report['median_bracketed_ratio'].get(name, 1.0):.3f} | "
            f"{report['median_ttft_ms'][name]:.1f} | "
            f"{report['median_ttft_ratio'].get(name, 1.0):.3f} |"
        )
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "serve_load.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "serve_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
