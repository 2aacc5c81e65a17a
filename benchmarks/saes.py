"""SAE features in the engine against plain compiled vLLM, measured in one run (`make bench`).

The benchmark model (Llama, hidden 1024, 8 layers, dummy bf16 weights) and random standard
SAEs of 16,384 features (float32, SAELens layout written here) read at top-32:

- plain compiled vLLM (the baseline);
- one SAE on layer 4, no request asking (``"saes": False``): the step skips SAE work;
- one SAE, every request asking (decode features);
- the same SAE with ``sae_dtype="bfloat16"`` (the encoder GEMM in bfloat16, float32 epilogue);
- four SAEs on layers 1, 3, 5, 7, every request asking (float32, and bfloat16);
- the four-SAE engine (float32) whose requests each ask for ONE of its SAEs, against the
  one-SAE engine on the same prompts (``--only one-sae-per-request`` runs this part alone):
  each SAE runs only on the rows of the requests that asked for it, so the time ratio should
  stay near 1 (target <= 1.1). Two ways: every request asks for the same SAE, and the requests
  ask for the four in turn.

Decode: 16 prompts of 32 tokens -> 64 new tokens. Prefill: 16 prompts of 256 tokens -> 1
token, prompt features asked. As in steering.py, each configuration's run is bracketed by two
baseline runs and the report quotes the median bracketed ratio. The floor is the encode GEMM,
counted as the phase is bound: ``f`` = the SAE's FLOPs per token over the model's (2 x
parameters). Prefill is compute-bound: the best ratio one SAE can reach is 1 / (1 + f). Decode
is memory-bound (a step of 16 tokens reads every weight once): the floor counts bytes read per
step in each one's dtype, the model's bfloat16 weights against the encoder's ``W_enc`` in the
GEMM's dtype, ``b = f x itemsize / 2`` (float32: 2f; bfloat16: f), so 1 / (1 + b).

Writes benchmarks/results/saes.json and saes.md (``--only``: saes.one-sae-per-request.*).
``--smoke``: a few seconds' check that it still runs (benchmarks/smoke.py: hidden 128, 4
layers, SAEs of 512 features, eager engines, no bfloat16 variants, nothing written).
"""

from __future__ import annotations

import argparse
import itertools
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
BASELINE = "vLLM compiled"
ONE_OF_FOUR = "one-sae-per-request"
ONE_OF_FOUR_WAYS = ("every request asks for the same one", "requests ask for the four in turn")


def write_sae(folder: Path, d_in: int, d_sae: int, layer: int, seed: int) -> Path:
    """A random standard SAE in SAELens's layout (cfg.json + sae_weights.safetensors)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
            "b_enc": torch.randn(d_sae, generator=g) * 0.1 - 0.5,
            "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae**0.5,
            "b_dec": torch.zeros(d_in),
        },
        str(folder / "sae_weights.safetensors"),
    )
    cfg = {
        "architecture": "standard",
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": "float32",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": f"blocks.{layer}.hook_resid_post", "sae_lens_version": "6"},
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def run_once(
    llm: object, prompts: list[dict], max_tokens: int, options: dict | list[dict] | None
) -> float:
    """Tokens per second: generated ones (decode), or prompt ones when ``max_tokens`` is 1.
    ``options``: every request's probehook options, or a list of them (one per prompt)."""
    from vllm import SamplingParams

    def params(options: dict | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0,
            detokenize=False,
            extra_args={"probehook": options} if options is not None else None,
        )

    each = options if isinstance(options, list) else [options] * len(prompts)
    batch = [params(o) for o in options] if isinstance(options, list) else params(options)
    start = time.perf_counter()
    outs = llm.generate(prompts, batch, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out, asked in zip(outs, each, strict=True):
        if asked and asked.get("saes") is not False:
            assert out.outputs[0].sae_features, "no features came back"
            if isinstance(asked.get("saes"), list):  # only the SAEs it asked for
                assert sorted(out.outputs[0].sae_features) == sorted(asked["saes"])
    if max_tokens == 1:
        return sum(len(o.prompt_token_ids) for o in outs) / elapsed
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def model_flops_per_token(
    hidden: int, layers: int, inter: int, kv: int, vocab: int, head: bool = True
) -> int:
    """2 x the parameters a token goes through (attention scores left out); ``head``: the LM
    head too (a decode token; a prompt token computes no logits but the last)."""
    attention = 2 * hidden * hidden + 2 * hidden * kv
    return 2 * (layers * (attention + 3 * hidden * inter) + (hidden * vocab if head else 0))


def one_sae_per_request(
    single: object,
    many: object,
    four: list[str],
    workloads: dict[str, tuple[int, int]],
    prompts: Callable[[int], list[dict]],
    rounds: int,
) -> dict[str, dict[str, object]]:
    """The four-SAE engine's time when each request asks for one of its SAEs, over the
    one-SAE engine's on the same prompts: each 4-SAE run is bracketed by two 1-SAE runs and
    divided by their geometric mean (in time, so above 1 is slower); medians over rounds."""
    report: dict[str, dict[str, object]] = {}
    for phase, (length, max_tokens) in workloads.items():
        base = {"include_prefill": False} if phase == "decode" else {}  # as the phases above
        same = prompts(length)  # the same prompts for every run of the phase
        ways = {
            ONE_OF_FOUR_WAYS[0]: {**base, "saes": four[:1]},
            ONE_OF_FOUR_WAYS[1]: [
                {**base, "saes": [four[i % len(four)]]} for i in range(len(same))
            ],
        }
        run_once(single, same, max_tokens, base)  # warm-up
        for options in ways.values():
            run_once(many, same, max_tokens, options)
        singles: list[float] = []
        rates: dict[str, list[float]] = {way: [] for way in ways}
        ratios: dict[str, list[float]] = {way: [] for way in ways}
        before = run_once(single, same, max_tokens, base)
        singles.append(before)
        for round_index in range(rounds):
            for way, options in ways.items():
                value = run_once(many, same, max_tokens, options)
                after = run_once(single, same, max_tokens, base)
                singles.append(after)
                rates[way].append(value)
                ratios[way].append((before * after) ** 0.5 / value)
                before = after
            print(
                f"{phase}, one SAE per request, round {round_index + 1}/{rounds}: "
                + ", ".join(f"{w}: {ratios[w][-1]:.3f}x the 1-SAE engine's time" for w in ways),
                flush=True,
            )
        report[phase] = {
            "one_sae_engine_median_tok_s": round(statistics.median(singles), 1),
            "four_sae_engine_median_tok_s": {
                w: round(statistics.median(v), 1) for w, v in rates.items()
            },
            "median_time_ratio": {w: round(statistics.median(v), 3) for w, v in ratios.items()},
            "time_ratios": {w: [round(r, 3) for r in v] for w, v in ratios.items()},
        }
    return report


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
    parser.add_argument("--d-sae", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument(
        "--only",
        choices=[ONE_OF_FOUR],
        help="measure only the 4-SAE engine whose requests each ask for one SAE against the "
        "1-SAE engine (no plain vLLM, no bfloat16 engines)",
    )
    smoke.add_flag(parser)
    args = smoke.shrink(parser.parse_args(), rounds=1, prompts=4, d_sae=512, top_k=8)

    import vllm
    from collect import token_prompts

    from probehook import LLM

    if args.smoke:  # smoke.dummy_model's shapes: heads of 64, MLP 2 x hidden
        hidden, layers, inter, kv_dim, vocab = 128, 4, 256, 128, args.vocab
    else:
        hidden, layers, inter, kv_dim, vocab = 1024, 8, 2816, 256, args.vocab
    everything = args.only is None
    work = Path(tempfile.mkdtemp())
    model_dir = smoke.dummy_model(
        work / "llama-dummy", hidden=hidden, layers=layers, vocab_size=vocab
    )
    middle = layers // 2  # layer 4 of 8
    one = {f"res{middle}": write_sae(work / f"res{middle}", hidden, args.d_sae, middle, 0)}
    four = {
        f"res{L}": write_sae(work / f"res{L}", hidden, args.d_sae, L, L)
        for L in ((2 * i + 1) * layers // 8 for i in range(4))  # 1, 3, 5, 7 of 8
    }
    common = dict(
        load_format="dummy", dtype="bfloat16", max_model_len=512, seed=0, **smoke.engine_args(args)
    )
    base = vllm.LLM(str(model_dir), **common) if everything else None
    single = LLM(str(model_dir), saes=one, sae_top_k=args.top_k, include_prefill=True, **common)
    many = LLM(str(model_dir), saes=four, sae_top_k=args.top_k, include_prefill=True, **common)
    single_bf16 = many_bf16 = None
    if everything and not args.smoke:  # the bfloat16 GEMM: real figures only
        half = dict(sae_top_k=args.top_k, include_prefill=True, sae_dtype="bfloat16", **common)
        single_bf16 = LLM(str(model_dir), saes=one, **half)
        many_bf16 = LLM(str(model_dir), saes=four, **half)

    seeds = itertools.count(1)

    def prompts(length: int) -> list[dict]:
        # New prompts every call: plain vLLM would read repeated ones from its prefix cache,
        # while a request that asks for prompt features skips reading it (every prompt row
        # is computed), so repeated prompts would compare cached prefill with computed.
        return token_prompts(args.prompts, length, min(30000, vocab - 2), seed=next(seeds))

    decode_only = {"include_prefill": False}
    workloads = {"decode": (32, 64), "prefill": (256, 1)}
    if args.smoke:
        workloads = {"decode": (8, 4), "prefill": (32, 1)}
    configs = {
        "decode": {
            "1 SAE, no request asking": (single, {"saes": False}),
            "1 SAE, every request": (single, decode_only),
            "1 SAE bf16 GEMM, every request": (single_bf16, decode_only),
            "4 SAEs, every request": (many, decode_only),
            "4 SAEs bf16 GEMM, every request": (many_bf16, decode_only),
        },
        "prefill": {
            "1 SAE, no request asking": (single, {"saes": False}),
            "1 SAE, every request (prompt features)": (single, {}),
            "1 SAE bf16 GEMM, every request (prompt features)": (single_bf16, {}),
            "4 SAEs, every request (prompt features)": (many, {}),
            "4 SAEs bf16 GEMM, every request (prompt features)": (many_bf16, {}),
        },
    }
    configs = {  # without the engines this run did not build
        phase: {name: run for name, run in runs.items() if run[0] is not None}
        for phase, runs in configs.items()
    }
    report: dict = {"workload": vars(args), "phases": {}}
    sae_flops = 2 * hidden * args.d_sae
    fractions = {
        "decode": sae_flops / model_flops_per_token(hidden, layers, inter, kv_dim, vocab),
        "prefill": sae_flops / model_flops_per_token(hidden, layers, inter, kv_dim, vocab, False),
    }
    report["sae_flops_fraction"] = {k: round(v, 4) for k, v in fractions.items()}

    def floor(phase: str, saes: int, itemsize: int) -> float:
        """The best ratio ``saes`` SAEs of a GEMM dtype of ``itemsize`` bytes can reach."""
        f = fractions[phase]
        return 1 / (1 + saes * (f * itemsize / 2 if phase == "decode" else f))

    for phase, (length, max_tokens) in workloads.items() if everything else ():
        run_once(base, prompts(length), max_tokens, None)  # warm-up
        for llm, options in configs[phase].values():
            run_once(llm, prompts(length), max_tokens, options)
        bracketed: dict[str, list[float]] = {name: [] for name in configs[phase]}
        samples: dict[str, list[float]] = {BASELINE: [], **{n: [] for n in configs[phase]}}
        for round_index in range(args.rounds):
            before = run_once(base, prompts(length), max_tokens, None)
            samples[BASELINE].append(before)
            for name, (llm, options) in configs[phase].items():
                value = run_once(llm, prompts(length), max_tokens, options)
                after = run_once(base, prompts(length), max_tokens, None)
                samples[name].append(value)
                samples[BASELINE].append(after)
                bracketed[name].append(value / (before * after) ** 0.5)
                before = after
            print(
                f"{phase} round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{n}: {s[-1]:.0f} tok/s" for n, s in samples.items()),
                flush=True,
            )
        report["phases"][phase] = [
            {
                "config": name,
                "median_tok_s": round(statistics.median(values), 1),
                "median_bracketed_ratio": round(statistics.median(bracketed[name]), 3)
                if name in bracketed
                else 1.0,
                "bracketed_ratios": [round(r, 3) for r in bracketed.get(name, [])],
            }
            for name, values in samples.items()
        ]
    report[ONE_OF_FOUR] = one_sae_per_request(
        single, many, list(four), workloads, prompts, args.rounds
    )
    smoke.shutdown(e for e in (base, single, many, single_bf16, many_bf16) if e is not None)
    lines = [
        f"Workload: Llama hidden {hidden}, {layers} layers, bf16 dummy weights; standard SAEs of "
        f"{args.d_sae} features (float32) at top-{args.top_k}; {args.prompts} prompts; "
        f"{args.rounds} interleaved rounds.",
        "",
        "SAE FLOPs per token over the model's (f; a prompt token computes no LM head): "
        + "; ".join(f"{phase} f = {f:.4f}" for phase, f in fractions.items())
        + ". Floors: prefill (compute-bound) 1 / (1 + f) per SAE; decode (memory-bound) "
        "1 / (1 + b), b = f x the GEMM dtype's bytes / 2 (the model's weights are bfloat16): "
        + ", ".join(
            f"{what} {floor(phase, saes, itemsize):.3f}"
            for phase in fractions
            for saes, itemsize, what in (
                (1, 4, f"{phase} 1 SAE float32"),
                (1, 2, f"{phase} 1 SAE bf16"),
                (4, 4, f"{phase} 4 float32"),
            )  # fmt: skip
        )
        + ".",
    ]
    for phase, rows in report["phases"].items():
        unit = "generated" if phase == "decode" else "prompt"
        lines += [
            "",
            f"{phase} ({unit} tokens/s):",
            "",
            "| config | median tok/s | median bracketed ratio | ratio / floor |",
            "| --- | --- | --- | --- |",
        ]
        for r in rows:
            saes = 4 if r["config"].startswith("4 SAEs") else 1
            asks = "no request" not in r["config"] and r["config"] != BASELINE
            itemsize = 2 if "bf16" in r["config"] else 4
            bound = floor(phase, saes, itemsize) if asks else 1.0
            lines.append(
                f"| {r['config']} | {r['median_tok_s']} | {r['median_bracketed_ratio']} | "
                f"{r['median_bracketed_ratio'] / bound:.3f} |"
            )
    lines += [
        "",
        "4 SAEs (float32), each request asking for ONE of them, against the 1-SAE engine on "
        "the same prompts: the 4-SAE engine's time over the 1-SAE engine's (each run bracketed "
        "by two 1-SAE runs, median over rounds; target <= 1.1):",
        "",
        "| phase | requests | 1-SAE engine tok/s | 4-SAE engine tok/s | time ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for phase, result in report[ONE_OF_FOUR].items():
        for way in ONE_OF_FOUR_WAYS:
            lines.append(
                f"| {phase} | {way} | {result['one_sae_engine_median_tok_s']} | "
                f"{result['four_sae_engine_median_tok_s'][way]} | "  # type: ignore[index]
                f"{result['median_time_ratio'][way]} |"  # type: ignore[index]
            )
    if not args.smoke:
        name = "saes" if everything else f"saes.{args.only}"
        if args.vocab != 32000:
            name += f".vocab{args.vocab}"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
        (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
