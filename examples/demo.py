"""`make demo`: capture, train probes, and watch generation through them, on the bundled model.

Runs offline with no arguments, on the tiny two-digit-addition model that ships inside the
package (docs/tiny-model.md):

1. labelled true/false statements ("23+45=68." / "23+45=71.") from held-out pairs;
2. captured into an activation store (one row per layer at each statement's last token);
3. a probe per layer, trained from the store, split by request, and the layer sweep table;
4. the best layer's held-out accuracy;
5. generation with that probe inside the engine: per-token scores, and a monitor that flags
   statements the probe reads as false;
6. a PNG with accuracy by layer and a token-by-token score strip.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# vLLM's CPU backend sizes its KV cache from this (GiB); its default claims most of RAM.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM logs pages of INFO/WARNING lines around a short result; keep its errors only.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ENGINE = dict(max_model_len=64, enforce_eager=True)


def statements(pairs: list[tuple[int, int]], seed: int) -> tuple[list[str], list[int]]:
    from probehook.tasks.arithmetic import probe_statements

    return probe_statements(pairs, seed=seed)


def capture(model: Path, store_dir: Path, texts: list[str]) -> list[str]:
    """Step 2: one row per layer at each statement's last token, streamed into the store."""
    from probehook import LLM, SamplingParams

    with LLM(
        model, layers="all", include_prefill=True, include_decode=False,
        last_prefill_token=True, store=store_dir, **ENGINE,
    ) as llm:  # fmt: skip
        outs = llm.generate(texts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=True)
    return [o.store_id for o in outs]


def strip_figure(sweep, examples: list[tuple[str, list[float]]], path: Path) -> Path:
    """Step 6: accuracy by layer, and each example's score per token."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 2.2 + 0.55 * len(examples)))
    grid = fig.add_gridspec(2, 1, height_ratios=[2.2, 0.55 * len(examples)])
    ax = fig.add_subplot(grid[0])
    layers = [row.layer for row in sweep.rows]
    ax.plot(layers, [row.accuracy for row in sweep.rows], "o-", label="held-out accuracy")
    ax.axhline(0.5, color="grey", lw=0.8, ls="--", label="chance")
    ax.set(xlabel="layer", ylabel="accuracy", xticks=layers, ylim=(0.4, 1.02))
    ax.legend(loc="lower right")
    strip = fig.add_subplot(grid[1])
    width = max(len(text) for text, _ in examples)
    grid_values = [[float("nan")] * width for _ in examples]
    for row, (_, scores) in enumerate(examples):
        grid_values[row][: len(scores)] = scores
    image = strip.imshow(grid_values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for row, (text, _) in enumerate(examples):
        for col, char in enumerate(text):
            strip.text(col, row, char, ha="center", va="center", fontsize=9)
    strip.set(xticks=[], yticks=[], title="P(true) at each token")
    fig.colorbar(image, ax=strip, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    from probehook.probes import sweep

    from probehook import LLM, ActivationStore, ProbeMonitor, SamplingParams, tiny_model_path
    from probehook.tasks.arithmetic import probe_pair_split, split_pairs

    model = tiny_model_path()
    work = Path(tempfile.mkdtemp(prefix="probehook-demo-"))
    print(f"Bundled tiny model: {model}\nWorking directory: {work}\n")

    # 1. Held-out pairs (never seen in training): half to train probes, half kept fresh.
    _, heldout = split_pairs()
    probe_pairs, fresh_pairs = probe_pair_split(heldout)
    texts, labels = statements(probe_pairs, seed=0)
    print(f"1. {len(texts)} labelled statements, e.g. {texts[0]!r} (true), {texts[1]!r} (false)")

    # 2. Capture.
    print("2. Capturing the residual stream at each statement's last token:", flush=True)
    ids = capture(model, work / "store", texts)
    store = ActivationStore.open(work / "store")
    print(f"   {len(store)} requests in {work / 'store'}\n")

    # 3. A probe per layer, trained from the store.
    label_of = dict(zip(ids, labels, strict=True))
    result = sweep(store, layers="all", labels=label_of, token="last", phase="prefill")
    print("3. Layer sweep (logistic regression, split by request):")
    print(result, "\n")

    # 4. The best layer.
    best = result.best
    print(f"4. Best layer: {best.layer}")
    print(f"accuracy {best.metrics['accuracy']:.3f}\n")
    best.save(work / "truth.safetensors")

    # 5. The probe inside the engine, on fresh statements and on the model's own answers.
    fresh, fresh_labels = statements(fresh_pairs[:6], seed=1)
    questions = [f"{a}+{b}=" for a, b in fresh_pairs[6:9]]
    # Decode row 0 is the state at the prompt's last token: for a statement, its verdict.
    flag_false = ProbeMonitor("truth", 0.5, action="flag", direction="below")
    with LLM(
        model, probes={"truth": best}, monitors=[flag_false], include_prefill=True, **ENGINE
    ) as llm:
        params = SamplingParams(max_tokens=4, temperature=0)
        outs = llm.generate(fresh + questions, params, use_tqdm=False)
    print("5. Scores inside the engine (P(true) at each prompt token; '*' = flagged false):")
    examples = []
    for out, label in zip(outs, fresh_labels + [None] * len(questions), strict=True):
        prompt_scores = out.prefill_probe_scores["truth"].tolist()
        flagged = 0 in out.outputs[0].probe_flags.get("truth", [])
        truth = "" if label is None else ("  (true)" if label else "  (false)")
        verdict = "*" if flagged else " "
        cells = " ".join(f"{c}:{s:.2f}" for c, s in zip(out.prompt, prompt_scores, strict=True))
        print(f"   {verdict} {out.prompt:<12}{truth:<9} {cells}")
        if label is None:
            text = out.prompt + out.outputs[0].text
            scores = prompt_scores + out.outputs[0].probe_scores["truth"].tolist()[1:]
            print(
                f"     model answers {out.outputs[0].text!r}; P(true) per generated token: "
                + " ".join(f"{s:.2f}" for s in out.outputs[0].probe_scores["truth"].tolist())
            )
            n = min(len(text), len(scores))
            examples.append((text[:n], scores[:n]))
        else:
            examples.append((out.prompt, prompt_scores))

    # 6. The figure.
    png = strip_figure(result, examples, work / "probes.png")
    print(f"\n6. Figure written to {png}")


if __name__ == "__main__":
    sys.exit(main())
