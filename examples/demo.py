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

import sys
import tempfile
from pathlib import Path

from probehook.logs import quiet_vllm

# vLLM's warnings and loading bars stay out of the result unless run with -v.
ENGINE = dict(max_model_len=64, enforce_eager=True, **quiet_vllm())


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


def strip_figure(sweep, examples: list[tuple[list[str], list[float]]], path: Path) -> Path:
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
    from probehook import LLM, ActivationStore, ProbeMonitor, SamplingParams, tiny_model_path
    from probehook.probes import sweep
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
    spread = fresh_pairs[::41]  # sorted pairs: take every 41st for variety
    fresh, fresh_labels = statements(spread[:4], seed=1)
    questions = [f"{a}+{b}=" for a, b in spread[4:7]]
    # Decode row 0 is the state at the prompt's last token: for a statement, its verdict.
    flag_false = ProbeMonitor("truth", 0.5, action="flag", direction="below")
    with LLM(
        model, probes={"truth": best}, monitors=[flag_false], include_prefill=True, **ENGINE
    ) as llm:
        params = SamplingParams(max_tokens=4, temperature=0)
        outs = llm.generate(fresh + questions, params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    print("5. Scores inside the engine: P(true) at each prompt token; '*' = the monitor")
    print("   flagged the statement as false (score below 0.5 at its final '.'):")
    examples = []
    for out, label in zip(outs, fresh_labels + [None] * len(questions), strict=True):
        completion = out.outputs[0]
        # Row p scores the state after token p; the first token is <s>.
        tokens = tokenizer.convert_ids_to_tokens(list(out.prompt_token_ids))
        scores = out.prefill_probe_scores["truth"].tolist()
        # The monitor flags decode row 0, the state at the statement's final ".".
        flagged = "*" if label is not None and 0 in completion.probe_flags["truth"] else " "
        truth = {None: "", 1: "(true)", 0: "(false)"}[label]
        cells = " ".join(f"{t}:{s:.2f}" for t, s in zip(tokens, scores, strict=True))
        print(f"   {flagged} {out.prompt:<11}{truth:<8} {cells}")
        if label is None:
            # Decode row i scores the state that produced generated token i; row 0 is the
            # prompt's last position, already above.
            generated = completion.probe_scores["truth"].tolist()
            print(
                f"     the model answers {completion.text!r}; P(true) after each generated "
                "token: " + " ".join(f"{s:.2f}" for s in generated[1:])
            )
            tokens += tokenizer.convert_ids_to_tokens(list(completion.token_ids))
            scores += generated[1:]
        n = min(len(tokens), len(scores))
        examples.append(([t if len(t) == 1 else "·" for t in tokens[:n]], scores[:n]))

    # 6. The figure.
    png = strip_figure(result, examples, work / "probes.png")
    print(f"\n6. Figure written to {png}")


if __name__ == "__main__":
    sys.exit(main())
