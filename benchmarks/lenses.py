"""Lenses in the engine against plain compiled vLLM, measured in one run (`make bench`).

The benchmark model (Llama, hidden 1024, 8 layers, vocabulary 32,000, dummy bf16 weights):

- plain compiled vLLM (the baseline);
- the logit lens on one layer, no request asking (``"lenses": False``): no lens work;
- the logit lens on 1 layer, and on 4 layers, every request asking;
- a J-lens (a random ``[d, d]`` map, TransformerLens's file format) on 1 layer;
- prefill: the logit lens on every prompt row, and on the last prompt row only
  (``last_prefill_token=True``: what one row costs, not a prompt's worth).

Decode: 16 prompts of 32 tokens -> 64 new tokens, the lens on every generated token.
Prefill: 16 prompts of 256 tokens -> 1 token. Each configuration's run is bracketed by two
baseline runs and the report quotes the median bracketed ratio. The floor: a lens row costs
``2 V d`` FLOPs (the unembedding) plus ``2 d^2`` for the J-lens's map, per layer per token;
``f`` is that over the model's FLOPs per token, and the best ratio is ``1 / (1 + f)``. Target:
the measured ratio >= 0.95 of the floor for 1 and 4 lens layers; no request asking >= 0.99.

Writes benchmarks/results/lenses.json and lenses.md. ``--smoke``: a few seconds' check that it
still runs (benchmarks/smoke.py; nothing written).
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


def write_j_lens(path: Path, hidden: int, layers: list[int]) -> Path:
    """A random J-lens in TransformerLens's artifact format (fp16 matrices)."""
    import torch

    g = torch.Generator().manual_seed(0)
    eye = torch.eye(hidden)
    matrices = {L: (eye + torch.randn(hidden, hidden, generator=g) / hidden**0.5).half()
                for L in layers}  # fmt: skip
    payload = {"J": matrices, "n_prompts": 1, "source_layers": layers, "d_model": hidden}
    torch.save(payload, path)
    return path


def came_back(out: object) -> bool:
    """Whether a run's first output holds the readout's values."""
    return bool(out.outputs[0].lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--vocab",
        type=int,
        default=32000,
        help="the model's vocabulary (512: the small-vocabulary case, where a readout's "
        "fixed per-step costs show beside a cheap LM head)",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=5)
    smoke.add_flag(parser)
    args = smoke.shrink(parser.parse_args(), rounds=1, prompts=4)

    import vllm
    from collect import token_prompts

    from probehook import LLM

    if args.smoke:
        hidden, layers, inter, kv_dim, vocab = 128, 4, 256, 128, args.vocab
    else:
        hidden, layers, inter, kv_dim, vocab = 1024, 8, 2816, 256, args.vocab
    work = Path(tempfile.mkdtemp())
    model_dir = smoke.dummy_model(
        work / "llama-dummy", hidden=hidden, layers=layers, vocab_size=vocab
    )
    middle = layers // 2
    four = [(2 * i + 1) * layers // 8 for i in range(4)]  # 1, 3, 5, 7 of 8
    j_path = write_j_lens(work / "j.pt", hidden, sorted({middle, *four}))
    common = dict(
        load_format="dummy", dtype="bfloat16", max_model_len=512, seed=0, **smoke.engine_args(args)
    )
    base = vllm.LLM(str(model_dir), **common)
    lens = dict(lens_top_k=args.top_k, include_prefill=True, **common)
    one = LLM(str(model_dir), lenses={"logit": "logit"}, lens_layers=[middle], **lens)
    many = LLM(str(model_dir), lenses={"logit": "logit"}, lens_layers=four, **lens)
    jacobian = LLM(str(model_dir), lenses={"j": str(j_path)}, lens_layers=[middle], **lens)
    # The same J-lens with its map in the model's bfloat16 (lens_dtype) instead of float32.
    j_bf16 = LLM(str(model_dir), lenses={"j": str(j_path)}, lens_layers=[middle],
                 lens_dtype="bfloat16", **lens)  # fmt: skip
    seeds = itertools.count(1)

    def prompts(length: int) -> list[dict]:
        return token_prompts(args.prompts, length, min(30000, vocab - 2), seed=next(seeds))

    decode_only = {"include_prefill": False}
    workloads = {"decode": (32, 64), "prefill": (256, 1)}
    if args.smoke:
        workloads = {"decode": (8, 4), "prefill": (32, 1)}
    configs = {
        "decode": {
            "logit lens, 1 layer, no request asking": (one, {"lenses": False}, 0, 0),
            "logit lens, 1 layer": (one, decode_only, 1, 0),
            "logit lens, 4 layers": (many, decode_only, 4, 0),
            "J-lens, 1 layer": (jacobian, decode_only, 1, 1),
            "J-lens, 1 layer, lens_dtype=bfloat16": (j_bf16, decode_only, 1, 1),
        },
        "prefill": {
            "logit lens, 1 layer, no request asking": (one, {"lenses": False}, 0, 0),
            "logit lens, 1 layer, every prompt row": (one, {}, 1, 0),
            "logit lens, 1 layer, last prompt row": (one, {"last_prefill_token": True}, 0, 0),
            "logit lens, 4 layers, every prompt row": (many, {}, 4, 0),
            "J-lens, 1 layer, every prompt row": (jacobian, {}, 1, 1),
            "J-lens, 1 layer, every prompt row, lens_dtype=bfloat16": (j_bf16, {}, 1, 1),
        },
    }
    report: dict = {"workload": vars(args), "phases": {}}
    model = {
        "decode": model_flops_per_token(hidden, layers, inter, kv_dim, vocab),
        "prefill": model_flops_per_token(hidden, layers, inter, kv_dim, vocab, False),
    }
    unembed, transport = 2 * vocab * hidden, 2 * hidden * hidden
    for phase, (length, max_tokens) in workloads.items():
        run_once(base, prompts(length), max_tokens, None, came_back, "lenses")  # warm-up
        for llm, options, _, _ in configs[phase].values():
            run_once(llm, prompts(length), max_tokens, options, came_back, "lenses")
        measure = functools.partial(run_prompts, prompts, length, max_tokens, came_back,
                                    "lenses")  # fmt: skip
        runs = {name: (llm, options) for name, (llm, options, _, _) in configs[phase].items()}
        samples, ratios = bracketed_rounds(phase, args.rounds, measure, base, runs)
        work = {name: lens_layers * (unembed + maps * transport) / model[phase]
                for name, (_, _, lens_layers, maps) in configs[phase].items()}  # fmt: skip
        report["phases"][phase] = phase_rows(samples, ratios, work)
    smoke.shutdown([base, one, many, jacobian, j_bf16])
    lines = [
        f"Workload: Llama hidden {hidden}, {layers} layers, vocabulary {vocab}, bf16 dummy "
        f"weights; lenses at top-{args.top_k}; {args.prompts} prompts; {args.rounds} "
        "interleaved rounds. f: the lens FLOPs per token over the model's (2 V d per lens "
        "layer, + 2 d^2 for a J-lens), floor 1 / (1 + f).",
    ]
    lines += table_lines(report["phases"])
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        name = "lenses" if args.vocab == 32000 else f"lenses.vocab{args.vocab}"
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
        (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
