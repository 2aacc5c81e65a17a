"""Steering overhead against plain compiled vLLM, measured in one run (`make bench`).

Two engines in this process on the benchmark model (Llama, dummy bf16 weights): plain
compiled vLLM, and one probehook engine with 32 steering vectors on layer L/4 (one steering op
in the compiled graph, nothing captured) run three ways: no request steered, 16 requests each
steered with its own added vector, and 16 requests each with its own op of every kind (add,
ablate, cap, orthogonal, norm_scaled, swap: 16 distinct vectors and ops). As in overhead.py,
every configuration's run is bracketed by two baseline runs (B c1 B c2 B ...) and the report
quotes the median of those ratios over the rounds.

It also reports what steering costs per engine step inside the worker: the host time that
writes the step's slot index (and each new request's table row), and the step time of the
same engine steered vs not (their difference includes the op itself).

Writes benchmarks/results/steering.json and steering.md. ``--smoke``: a few seconds' check that
it still runs (benchmarks/smoke.py: tiny model, eager engines, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import smoke  # noqa: E402  (benchmarks/smoke.py)

RESULTS = Path(__file__).parent / "results"
BASELINE = "vLLM compiled"
IDLE = "probehook 16 vectors configured, no request steered"
STEERED = "probehook 16 requests, each its own vector"
OPS = "probehook 16 requests, 16 distinct ops (mixed kinds)"
OP_KINDS = ("add", "ablate", "cap", "orthogonal", "norm_scaled", "swap")


def run_once(llm: object, prompts: list[dict], max_tokens: int, steer: str | None) -> float:
    """``steer``: None, ``"v"`` (each request its own added vector) or ``"o"`` (its own op)."""
    from vllm import SamplingParams

    def params(i: int) -> SamplingParams:
        extra = {"probehook": {"steer": {f"{steer}{i % 16}": 0.5 + i / 32}}} if steer else None
        return SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0,
            detokenize=False,
            extra_args=extra,
        )

    batch = [params(i) for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate(prompts, batch, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(prompts) * max_tokens
    if steer:
        assert all(o.outputs[0].steering is not None for o in outs)
    return generated / elapsed


def worker_counters(llm: object) -> dict[str, int]:
    stats = next(s for s in llm.collective_rpc("probehook_stats") if s is not None)
    return {k: stats[k] for k in ("steps", "step_ns", "steps_steered", "steer_prepare_ns")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(), rounds=1, prompts=4, prompt_len=8, max_tokens=4, hidden=128, layers=2
    )

    import torch
    import vllm

    from probehook import LLM, SteeringVector

    model_dir = smoke.dummy_model(
        Path(tempfile.mkdtemp()) / "llama-dummy", hidden=args.hidden, layers=args.layers
    )
    prompts = [
        {"prompt_token_ids": [(i * 131 + j * 17) % 30000 + 100 for j in range(args.prompt_len)]}
        for i in range(args.prompts)
    ]
    layer = args.layers // 4
    g = torch.Generator().manual_seed(0)
    vectors = {
        f"v{i}": SteeringVector({layer: torch.randn(args.hidden, generator=g) * 0.01})
        for i in range(16)
    }
    for i in range(16):
        vector, kind = vectors[f"v{i}"], OP_KINDS[i % len(OP_KINDS)]
        if kind == "swap":
            vectors[f"o{i}"] = SteeringVector.swap(from_=vector, to=vectors[f"v{(i + 1) % 16}"])
        else:
            vectors[f"o{i}"] = vector.with_op(kind, **({"max": 0.5} if kind == "cap" else {}))
    common = dict(
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.prompt_len + args.max_tokens + 16,
        seed=0,
        **smoke.engine_args(args),
    )
    base = vllm.LLM(str(model_dir), **common)
    steering = LLM(str(model_dir), steering=vectors, **common)
    runs = {BASELINE: (base, None), IDLE: (steering, None), STEERED: (steering, "v"),
            OPS: (steering, "o")}  # fmt: skip
    for llm, steer in runs.values():  # warm-up outside the measurement
        run_once(llm, prompts, 8, steer)

    samples: dict[str, list[float]] = {name: [] for name in runs}
    bracketed: dict[str, list[float]] = {name: [] for name in runs if name != BASELINE}
    costs: dict[str, dict[str, int]] = {}
    for round_index in range(args.rounds):
        before_base = run_once(base, prompts, args.max_tokens, None)
        samples[BASELINE].append(before_base)
        for name, (llm, steer) in runs.items():
            if name == BASELINE:
                continue
            before = worker_counters(llm)
            value = run_once(llm, prompts, args.max_tokens, steer)
            after = worker_counters(llm)
            samples[name].append(value)
            total = costs.setdefault(name, dict.fromkeys(after, 0))
            for key in after:
                total[key] += after[key] - before[key]
            after_base = run_once(base, prompts, args.max_tokens, None)
            samples[BASELINE].append(after_base)
            bracketed[name].append(value / (before_base * after_base) ** 0.5)
            before_base = after_base
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{n}: {s[-1]:.0f} tok/s" for n, s in samples.items()),
            flush=True,
        )
    smoke.shutdown([steering, base])

    baseline = statistics.median(samples[BASELINE])
    rows = [
        {
            "config": name,
            "median_tok_s": round(statistics.median(values), 1),
            "ratio_of_medians": round(statistics.median(values) / baseline, 3),
            "median_bracketed_ratio": round(statistics.median(bracketed.get(name, [1.0])), 3),
            "bracketed_ratios": [round(r, 3) for r in bracketed.get(name, [1.0])],
        }
        for name, values in samples.items()
    ]
    per_step = [
        {
            "config": name,
            "steps": total["steps"],
            "steps_steered": total["steps_steered"],
            "step_us": round(total["step_ns"] / max(total["steps"], 1) / 1e3, 1),
            "index_us": round(total["steer_prepare_ns"] / max(total["steps"], 1) / 1e3, 1),
        }
        for name, total in costs.items()
    ]
    added = per_step[1]["step_us"] - per_step[0]["step_us"]
    report = {
        "workload": vars(args),
        "steered_layer": layer,
        "results": rows,
        "per_step": per_step,
        "added_step_us_steered_vs_not": round(added, 1),
    }
    lines = [
        f"Workload: Llama hidden {args.hidden}, {args.layers} layers, bf16 dummy weights, "
        f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} new tokens, "
        f"{args.rounds} interleaved rounds; steering op on layer {layer}.",
        "",
        "| config | median tok/s | ratio of medians | median bracketed ratio |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['config']} | {r['median_tok_s']} | {r['ratio_of_medians']} | "
        f"{r['median_bracketed_ratio']} |"
        for r in rows
    ]
    lines += [
        "",
        "Steering in the worker per engine step (the step is the worker's execute_model, "
        "forward included; index µs is the host time writing the step's slot index and new "
        "requests' table rows):",
        "",
        "| config | steps | steps steered | step µs | index µs |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['config']} | {r['steps']} | {r['steps_steered']} | {r['step_us']} | "
        f"{r['index_us']} |"
        for r in per_step
    ]
    lines += ["", f"Added step time, steered vs not (same engine): {added:.1f} µs"]
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "steering.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "steering.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
