"""Activation-patching sweeps against plain compiled vLLM, measured in one run (`make bench`).

Two engines in this process on the benchmark model (Llama, dummy bf16 weights): plain compiled
vLLM and probehook with ``patching=True`` (a patch term and a keep op at every layer's input and
output). Per round, each run bracketed by two plain-vLLM prefill runs (B x B y B):

- **requests that patch nothing** on the patching engine: prefill tokens per second of fresh
  prompts, against plain vLLM's (what the installed ops cost everyone else);
- **a sweep** over every layer and prompt position (``resid_pre``): cells per second, against
  the floor of plain vLLM's prefill tokens per second divided by the tokens each cell
  recomputes (the whole prompt: each cell is its own request with its own cache salt).

Writes benchmarks/results/patching.json and patching.md. ``--smoke``: a few seconds' check that
it still runs (benchmarks/smoke.py: tiny model, eager engines, nothing written).
"""

from __future__ import annotations

import argparse
import itertools
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
NOTHING = "patching engine, requests that patch nothing: prefill tok/s"
SWEEP = "a sweep over every layer and position: cells/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(), rounds=1, prompts=4, prompt_len=8, hidden=128, layers=2
    )

    import vllm
    from vllm import SamplingParams

    from probehook import LLM

    model_dir = smoke.dummy_model(
        Path(tempfile.mkdtemp()) / "llama-dummy", hidden=args.hidden, layers=args.layers
    )
    fresh = itertools.count()

    def prompts() -> list[dict]:
        """New prompts every run: a cached prefill would not be the floor."""
        k = next(fresh)
        return [
            {
                "prompt_token_ids": [
                    (k * 7919 + i * 131 + j * 17) % 30000 + 100 for j in range(args.prompt_len)
                ]
            }  # fmt: skip
            for i in range(args.prompts)
        ]

    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=args.prompt_len + 16,
                  seed=0, **smoke.engine_args(args))  # fmt: skip
    base = vllm.LLM(str(model_dir), **common)
    patching = LLM(str(model_dir), patching=64, **common)
    plain = SamplingParams(max_tokens=1, temperature=0, detokenize=False)

    def prefill(llm: object) -> float:
        batch = prompts()
        start = time.perf_counter()
        outs = llm.generate(batch, plain, use_tqdm=False)
        return sum(len(o.prompt_token_ids) for o in outs) / (time.perf_counter() - start)

    def sweep() -> tuple[float, int]:
        ids = prompts()[0]["prompt_token_ids"]
        clean = list(ids)
        clean[1] = (clean[1] + 1) % 30000 + 100
        start = time.perf_counter()
        result = patching.patch_sweep(prompt=ids, clean_prompt=clean, answer_token_id=5,
                                      foil_token_id=6, use_tqdm=False)  # fmt: skip
        elapsed = time.perf_counter() - start
        cells = int(result.grid.size)
        assert (
            cells == args.layers * args.prompt_len and result.recomputed_tokens == args.prompt_len
        )
        return cells / elapsed, result.recomputed_tokens

    for _ in range(2):  # warm-up outside the measurement (compilation, first batches)
        prefill(base), prefill(patching), sweep()

    ratios: dict[str, list[float]] = {NOTHING: [], SWEEP: []}
    values: dict[str, list[float]] = {"vLLM prefill tok/s": [], NOTHING: [], SWEEP: []}
    for round_index in range(args.rounds):
        before = prefill(base)
        nothing = prefill(patching)
        middle = prefill(base)
        cells, recomputed = sweep()
        after = prefill(base)
        values["vLLM prefill tok/s"] += [before, middle, after]
        values[NOTHING].append(nothing)
        values[SWEEP].append(cells)
        ratios[NOTHING].append(nothing / (before * middle) ** 0.5)
        floor = (middle * after) ** 0.5 / recomputed  # cells/s if each cell cost its prefill
        ratios[SWEEP].append(cells / floor)
        print(f"round {round_index + 1}/{args.rounds}: vLLM {middle:.0f} tok/s, patching "
              f"engine {nothing:.0f} tok/s, sweep {cells:.1f} cells/s (floor {floor:.1f})",
              flush=True)  # fmt: skip
    smoke.shutdown([patching, base])

    rows = [
        {"config": name, "median": round(statistics.median(v), 1),
         "median_bracketed_ratio": round(statistics.median(ratios.get(name, [1.0])), 3),
         "ratios": [round(r, 3) for r in ratios.get(name, [])]}
        for name, v in values.items()
    ]  # fmt: skip
    lines = [
        f"Workload: Llama hidden {args.hidden}, {args.layers} layers, bf16 dummy weights, "
        f"{args.prompts} prompts x {args.prompt_len} tokens a prefill run; a sweep of "
        f"{args.layers} x {args.prompt_len} cells (resid_pre, every layer and position); "
        f"{args.rounds} rounds, each run bracketed by plain-vLLM prefill runs.",
        "",
        "| config | median | median bracketed ratio |",
        "| --- | --- | --- |",
        *(f"| {r['config']} | {r['median']} | {r['median_bracketed_ratio']} |" for r in rows),
        "",
        "The sweep's ratio is to plain vLLM's prefill tokens per second divided by the "
        f"{args.prompt_len} tokens each cell recomputes.",
    ]
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "patching.json").write_text(
            json.dumps({"workload": vars(args), "results": rows}, indent=2)
        )
        (RESULTS / "patching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
