"""Attention per head in the engine against plain compiled vLLM, measured in one run (`make
bench`).

The benchmark model (Llama, hidden 1024, 8 layers, 16 heads on 4 KV heads, vocabulary 32,000,
dummy bf16 weights), attention read at top-8:

- plain compiled vLLM (the baseline);
- attention of one layer, no request asking (``"attention": False``): the query tap runs,
  nothing is read;
- attention of one layer, and of every layer, every request asking (decode rows);
- prefill: one layer, every prompt row.

Decode: 16 prompts of 32 tokens -> 64 new tokens (concurrency 16). Prefill: 16 prompts of 256
tokens -> 1 token. Each configuration's run is bracketed by two baseline runs and the report
quotes the median bracketed ratio. The floor is the work itself. Decode is memory-bound: a
step reads every weight once and every layer's keys and values of the batch; reading one
layer's keys once more adds ``B c d_kv`` bf16 values (``c``: the mean context, 64), so
``f = layers read x B c d_kv / (params + layers x 2 B c d_kv)`` in bytes and the best ratio
is ``1 / (1 + f)``. Prefill is compute-bound: scoring a row against the ``n / 2`` keys it sees
on average costs ``2 d n / 2`` FLOPs per layer read, over the model's FLOPs per token.
Targets (issue 51): one layer >= 0.97, every layer >= 0.80.

Writes benchmarks/results/attention.json and attention.md. ``--smoke``: a few seconds' check
that it still runs (benchmarks/smoke.py; nothing written).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import smoke  # noqa: E402  (benchmarks/smoke.py)
from bracketed import bracketed_rounds, phase_rows, run_once, run_prompts, table_lines  # noqa: E402
from saes import model_flops_per_token  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def came_back(out: object) -> bool:
    """Whether a run's first output holds the readout's values."""
    return bool(out.outputs[0].attention or out.prefill_attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    smoke.add_flag(parser)
    args = smoke.shrink(parser.parse_args(), rounds=1, prompts=4)

    import vllm
    from collect import token_prompts

    from probehook import LLM

    if args.smoke:
        hidden, layers, heads, kv_heads, inter, vocab = 128, 4, 2, 2, 256, 512
    else:
        hidden, layers, heads, kv_heads, inter, vocab = 1024, 8, 16, 4, 2816, 32000
    kv_dim = hidden // heads * kv_heads
    work = Path(tempfile.mkdtemp())
    model_dir = smoke.dummy_model(work / "llama-dummy", hidden=hidden, layers=layers,
                                  num_heads=heads, num_kv_heads=kv_heads,
                                  intermediate_size=inter, vocab_size=vocab)  # fmt: skip
    middle = layers // 2
    common = dict(
        load_format="dummy", dtype="bfloat16", max_model_len=512, seed=0, **smoke.engine_args(args)
    )
    base = vllm.LLM(str(model_dir), **common)
    reading = dict(attention_top_k=args.top_k, include_prefill=True, **common)
    one = LLM(str(model_dir), attention_layers=[middle], **reading)
    every = LLM(str(model_dir), attention_layers="all", **reading)
    seeds = itertools.count(1)

    def prompts(length: int) -> list[dict]:
        return token_prompts(args.prompts, length, min(30000, vocab - 2), seed=next(seeds))

    decode_only = {"include_prefill": False}
    workloads = {"decode": (32, 64), "prefill": (256, 1)}
    if args.smoke:
        workloads = {"decode": (8, 4), "prefill": (32, 1)}
    configs = {
        "decode": {
            "attention, 1 layer, no request asking": (one, {"attention": False}, 0),
            "attention, 1 layer": (one, decode_only, 1),
            f"attention, every layer ({layers})": (every, decode_only, layers),
        },
        "prefill": {
            "attention, 1 layer, no request asking": (one, {"attention": False}, 0),
            "attention, 1 layer, every prompt row": (one, {}, 1),
        },
    }
    params = model_flops_per_token(hidden, layers, inter, kv_dim, vocab) // 2
    prefill_flops = model_flops_per_token(hidden, layers, inter, kv_dim, vocab, False)

    def extra(phase: str, read: int, length: int, max_tokens: int) -> float:
        """``f``: the work of reading ``read`` layers over the model's (see the docstring)."""
        if phase == "decode":
            batch, context = args.prompts, length + max_tokens / 2
            keys = batch * context * kv_dim
            return read * keys / (params + layers * 2 * keys)
        return read * 2 * hidden * (length / 2) / prefill_flops

    report: dict = {"workload": vars(args), "phases": {}}
    for phase, (length, max_tokens) in workloads.items():
        run_once(base, prompts(length), max_tokens, None, came_back, "attention")  # warm-up
        for llm, options, _ in configs[phase].values():
            run_once(llm, prompts(length), max_tokens, options, came_back, "attention")
        measure = functools.partial(run_prompts, prompts, length, max_tokens, came_back,
                                    "attention")  # fmt: skip
        runs = {name: (llm, options) for name, (llm, options, _) in configs[phase].items()}
        samples, ratios = bracketed_rounds(phase, args.rounds, measure, base, runs)
        work = {name: extra(phase, read, length, max_tokens)
                for name, (_, _, read) in configs[phase].items()}  # fmt: skip
        report["phases"][phase] = phase_rows(samples, ratios, work)
    smoke.shutdown([base, one, every])
    lines = [
        f"Workload: Llama hidden {hidden}, {layers} layers, {heads} heads on {kv_heads} KV "
        f"heads, vocabulary {vocab}, bf16 dummy weights; attention at top-{args.top_k}; "
        f"{args.prompts} prompts; {args.rounds} interleaved rounds. f: the work of reading the "
        "layers' keys over the step's (decode: bytes; prefill: FLOPs), floor 1 / (1 + f).",
    ]
    lines += table_lines(report["phases"])
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "attention.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
