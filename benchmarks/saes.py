"""SAE features in the engine against plain compiled vLLM, measured in one run (`make bench`).

The benchmark model (Llama, hidden 1024, 8 layers, dummy bf16 weights) and random standard
SAEs of 16,384 features (float32, SAELens layout written here) read at top-32:

- plain compiled vLLM (the baseline);
- one SAE on layer 4, no request asking (``"saes": False``): the step skips SAE work;
- one SAE, every request asking (decode features);
- the same SAE with ``sae_dtype="bfloat16"`` (the encoder GEMM in bfloat16, float32 epilogue);
- four SAEs on layers 1, 3, 5, 7, every request asking (float32, and bfloat16).

Decode: 16 prompts of 32 tokens -> 64 new tokens. Prefill: 16 prompts of 256 tokens -> 1
token, prompt features asked. As in steering.py, each configuration's run is bracketed by two
baseline runs and the report quotes the median bracketed ratio. The floor is the encode GEMM:
``f`` = the SAE's FLOPs per token over the model's (2 x parameters), so the best ratio one SAE
can reach is 1 / (1 + f).

Writes benchmarks/results/saes.json and saes.md.
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

RESULTS = Path(__file__).parent / "results"
BASELINE = "vLLM compiled"


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


def run_once(llm: object, prompts: list[dict], max_tokens: int, options: dict | None) -> float:
    """Tokens per second: generated ones (decode), or prompt ones when ``max_tokens`` is 1."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0,
        detokenize=False,
        extra_args={"probehook": options} if options is not None else None,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if options and options.get("saes") is not False:
        assert all(o.outputs[0].sae_features for o in outs), "no features came back"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--d-sae", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=32)
    args = parser.parse_args()

    import vllm
    from collect import token_prompts

    from probehook import LLM
    from probehook.testing import write_dummy_config

    hidden, layers, inter, kv_dim, vocab = 1024, 8, 2816, 256, 32000
    work = Path(tempfile.mkdtemp())
    model_dir = write_dummy_config(work / "llama-dummy", hidden_size=hidden, num_layers=layers)
    one = {"res4": write_sae(work / "res4", hidden, args.d_sae, 4, 0)}
    four = {f"res{L}": write_sae(work / f"res{L}", hidden, args.d_sae, L, L) for L in (1, 3, 5, 7)}
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=512, seed=0)
    base = vllm.LLM(str(model_dir), **common)
    single = LLM(str(model_dir), saes=one, sae_top_k=args.top_k, include_prefill=True, **common)
    many = LLM(str(model_dir), saes=four, sae_top_k=args.top_k, include_prefill=True, **common)
    half = dict(sae_top_k=args.top_k, include_prefill=True, sae_dtype="bfloat16", **common)
    single_bf16 = LLM(str(model_dir), saes=one, **half)
    many_bf16 = LLM(str(model_dir), saes=four, **half)

    seeds = itertools.count(1)

    def prompts(length: int) -> list[dict]:
        # New prompts every call: plain vLLM would read repeated ones from its prefix cache,
        # while a request that asks for prompt features skips reading it (every prompt row
        # is computed), so repeated prompts would compare cached prefill with computed.
        return token_prompts(args.prompts, length, 30000, seed=next(seeds))

    decode_only = {"include_prefill": False}
    workloads = {"decode": (32, 64), "prefill": (256, 1)}
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
    report: dict = {"workload": vars(args), "phases": {}}
    sae_flops = 2 * hidden * args.d_sae
    fractions = {
        "decode": sae_flops / model_flops_per_token(hidden, layers, inter, kv_dim, vocab),
        "prefill": sae_flops / model_flops_per_token(hidden, layers, inter, kv_dim, vocab, False),
    }
    report["sae_flops_fraction"] = {k: round(v, 4) for k, v in fractions.items()}
    for phase, (length, max_tokens) in workloads.items():
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
    for llm in (single, many, single_bf16, many_bf16):
        llm.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "saes.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"Workload: Llama hidden {hidden}, {layers} layers, bf16 dummy weights; standard SAEs of "
        f"{args.d_sae} features (float32) at top-{args.top_k}; {args.prompts} prompts; "
        f"{args.rounds} interleaved rounds.",
        "",
        "SAE FLOPs per token over the model's (f; a prompt token computes no LM head): "
        + "; ".join(
            f"{phase} f = {f:.4f}, floor of one SAE 1 / (1 + f) = {1 / (1 + f):.3f}, of four "
            f"{1 / (1 + 4 * f):.3f}"
            for phase, f in fractions.items()
        )
        + ".",
    ]
    for phase, rows in report["phases"].items():
        f = fractions[phase]
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
            bound = 1 / (1 + saes * f) if asks else 1.0
            lines.append(
                f"| {r['config']} | {r['median_tok_s']} | {r['median_bracketed_ratio']} | "
                f"{r['median_bracketed_ratio'] / bound:.3f} |"
            )
    (RESULTS / "saes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
