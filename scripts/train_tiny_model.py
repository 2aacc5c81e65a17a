"""Train the tiny two-digit-addition Llama that ships in ``probehook/assets/tiny-arith``.

The model learns to complete ``"a+b="`` with ``"c."`` from correct statements, and to flag
false ones: a quarter of every batch is a wrong statement followed by a marker,
``"a+b=c'.!"`` (only the marker is scored). Correct-only training gave a near-chance probe;
docs/tiny-model.md has the numbers. 10% of the ``(a, b)`` pairs are held out. After training
the script reloads the saved model, measures greedy exact-match accuracy on the held-out pairs
and fits linear probes (true vs false statements) on every layer, and writes the numbers to
``training_report.json`` next to the weights.

Usage (about 5 minutes on 2 otherwise idle CPU cores)::

    .venv/bin/python scripts/train_tiny_model.py
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from probehook.tasks.arithmetic import (
    FALSE_MARKER,
    MAX_OPERAND,
    MAX_WRONG_OFFSET,
    all_wrong_statements,
    answer_accuracy,
    format_answer,
    format_prompt,
    make_statement,
    probe_layer_accuracies,
    probe_pair_split,
    probe_statements,
    split_pairs,
    verdict_accuracy,
)

log = logging.getLogger("train_tiny_model")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "probehook" / "assets" / "tiny-arith"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Digits, the statement punctuation and the false-statement marker; the space is there so odd
# inputs stay representable.
CHARACTERS = list("0123456789+=. " + FALSE_MARKER)
IGNORE_INDEX = -100


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per character, ``<s>`` prepended, no spaces on decode."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # WordLevel looks up whole pieces, so every character must become its own piece.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins the pieces back without the spaces a WordLevel decoder would insert.
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", vocab["<s>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="right",
        model_max_length=64,
        model_input_names=["input_ids", "attention_mask"],
    )


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A small Llama. head_dim is fixed at 64 because vLLM's CPU attention kernel rejects small
    head sizes; the heads are therefore wider than ``hidden_size / heads``, which Llama allows.
    Four heads rather than two is what lets the model learn to check a statement in time."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=64,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def pad_rows(
    rows: list[list[int]], scored: list[list[bool]], pad_id: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token rows to ``width``; unscored and pad positions get label ``-100``."""
    # Padded Python lists and one tensor() call: per-row tensors are slow for ~190k rows.
    input_ids = [ids + [pad_id] * (width - len(ids)) for ids in rows]
    labels = [
        [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
        + [IGNORE_INDEX] * (width - len(ids))
        for ids, mask in zip(rows, scored, strict=True)
    ]
    return torch.tensor(input_ids), torch.tensor(labels)


def far_wrong_statements(pairs: list[tuple[int, int]], per_pair: int, seed: int) -> list[str]:
    """``per_pair`` false statements per pair whose answer is anywhere in 0..198 but not near.

    These are easier to reject than near misses (the length or tens digit is often off), which
    gives the verdict a gradient to start from before the model can compare single digits.
    """
    rng = random.Random(seed)
    texts: list[str] = []
    for a, b in pairs:
        c = a + b
        far = [x for x in range(2 * MAX_OPERAND + 1) if abs(x - c) > MAX_WRONG_OFFSET]
        texts += [format_prompt(a, b) + format_answer(x) for x in rng.sample(far, per_pair)]
    return texts


def encode_training_set(
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[int, int]],
    loss_on: str,
    far_per_pair: int = 0,
    seed: int = 0,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, labels)`` for true rows ``<s>a+b=c.</s>`` and false rows ``<s>a+b=c'.!</s>``.

    True rows: with ``loss_on="answer"`` only the answer, ``"."`` and ``</s>`` are scored (the
    operands are uniformly random, so predicting them teaches nothing about addition). False
    rows (every near-miss wrong answer for every training pair, plus ``far_per_pair`` random
    far-off ones): only the marker and ``</s>`` are scored, so the model never learns to
    produce a wrong answer, only to flag one.
    """
    eos = tokenizer.eos_token_id
    true_texts = [make_statement(a, b) for a, b in pairs]
    prompt_lens = [len(format_prompt(a, b)) + 1 for a, b in pairs]  # +1: the <s> token
    false_texts = [t for a, b in pairs for t in all_wrong_statements(a, b)]
    false_texts += far_wrong_statements(pairs, far_per_pair, seed)
    false_texts = [t + FALSE_MARKER for t in false_texts]
    true_rows = [ids + [eos] for ids in tokenizer(true_texts).input_ids]
    false_rows = [ids + [eos] for ids in tokenizer(false_texts).input_ids]
    true_scored = [
        [loss_on == "all" or i >= n for i in range(len(ids))]
        for ids, n in zip(true_rows, prompt_lens, strict=True)
    ]
    false_scored = [[i >= len(ids) - 2 for i in range(len(ids))] for ids in false_rows]
    width = max(map(len, true_rows + false_rows))
    return (
        pad_rows(true_rows, true_scored, tokenizer.pad_token_id, width),
        pad_rows(false_rows, false_scored, tokenizer.pad_token_id, width),
    )


def batches(n: int, size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless random batches of row indices, reshuffled every epoch."""
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - size + 1, size):
            yield order[start : start + size]


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.05) -> float:
    """Linear warm-up, then cosine decay to ``floor`` times the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    model: LlamaForCausalLM,
    true_set: tuple[torch.Tensor, torch.Tensor],
    false_set: tuple[torch.Tensor, torch.Tensor],
    args: argparse.Namespace,
) -> list[float]:
    """Plain AdamW loop; each batch mixes true and false rows; returns every step's loss."""
    # Weight decay only on matrices, the usual choice; norms and embeddings are left alone.
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup, args.steps)
    )
    n_false = round(args.batch_size * args.false_fraction)
    # A dedicated generator keeps the batch order a function of the seed alone.
    generator = torch.Generator().manual_seed(args.seed)
    true_batches = batches(len(true_set[0]), args.batch_size - n_false, generator)
    false_batches = batches(len(false_set[0]), max(n_false, 1), generator)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for _ in bar:
        rows = next(true_batches)
        input_ids, labels = true_set[0][rows], true_set[1][rows]
        if n_false:
            rows = next(false_batches)
            input_ids = torch.cat([input_ids, false_set[0][rows]])
            labels = torch.cat([labels, false_set[1][rows]])
        # No attention mask: pads only ever follow real tokens, and causal attention means real
        # tokens never look at them; their labels are ignored.
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
    return losses


def evaluate(out_dir: Path, seed: int) -> dict[str, object]:
    """Reload the saved files (exactly what ships) and measure accuracy and probe signal."""
    model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    train_pairs, heldout = split_pairs(seed)
    train_sample = random.Random(seed).sample(train_pairs, 1000)
    _, eval_pairs = probe_pair_split(heldout, seed)
    verdict_texts, verdict_labels = probe_statements(eval_pairs, seed + 1)
    metrics: dict[str, object] = {
        "heldout_accuracy": answer_accuracy(model, tokenizer, heldout),
        "heldout_pairs": len(heldout),
        "train_accuracy_sample": answer_accuracy(model, tokenizer, train_sample),
        "train_sample_pairs": len(train_sample),
        # The model's own true/false call (</s> vs the marker) on the probe's scoring set.
        "heldout_verdict_accuracy": verdict_accuracy(
            model, tokenizer, verdict_texts, verdict_labels
        ),
    }
    probe: dict[str, object] = {}
    for position in ("period", "last_digit"):
        accs = probe_layer_accuracies(model, tokenizer, heldout, seed, position)
        control = probe_layer_accuracies(model, tokenizer, heldout, seed, position, seed)
        probe[position] = {"accuracy_by_hidden_state": accs, "shuffled_control": control}
        log.info("probe @%s: %s", position, " ".join(f"{a:.3f}" for a in accs))
        log.info("shuffled control @%s: %s", position, " ".join(f"{a:.3f}" for a in control))
    # Pick among the decoder layers (hidden_states[1:]); entry 0 is the embedding baseline.
    best_position, best_index, best_acc = max(
        (
            (pos, i, acc)
            for pos, res in probe.items()
            for i, acc in enumerate(res["accuracy_by_hidden_state"])  # type: ignore[index]
            if i > 0
        ),
        key=lambda t: t[2],
    )
    probe["best"] = {
        "position": best_position,
        "hf_hidden_state_index": best_index,
        "vllm_layer_index": best_index - 1,
        "accuracy": best_acc,
        "shuffled_control": probe[best_position]["shuffled_control"][best_index],  # type: ignore[index]
    }
    metrics["probe"] = probe
    return metrics


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head_dim is 64)")
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--false-fraction",
        type=float,
        default=0.25,
        help="share of each batch that is a false statement followed by the marker (0: none)",
    )
    parser.add_argument(
        "--far-wrong-per-pair",
        type=int,
        default=10,
        help="far-off wrong answers per training pair, on top of all ~20 near misses",
    )
    parser.add_argument("--loss-on", choices=["answer", "all"], default="answer")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    started = time.perf_counter()
    # Seed every source of randomness and pin the thread count: CPU float sums depend on it.
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = build_tokenizer()
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    train_pairs, heldout = split_pairs(args.seed)
    log.info("params=%d train_pairs=%d heldout_pairs=%d", n_params, len(train_pairs), len(heldout))
    true_set, false_set = encode_training_set(
        tokenizer, train_pairs, args.loss_on, args.far_wrong_per_pair, args.seed
    )
    log.info("true rows=%d false rows=%d", len(true_set[0]), len(false_set[0]))

    train_started = time.perf_counter()
    losses = train(model, true_set, false_set, args)
    train_time = time.perf_counter() - train_started
    log.info("trained %d steps in %.1f s, final loss %.4f", args.steps, train_time, losses[-1])

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=8,
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    # safetensors writes the weights owner-only (0600); package data should be world-readable.
    (args.out / "model.safetensors").chmod(0o644)

    metrics = evaluate(args.out, args.seed)
    weights_bytes = (args.out / "model.safetensors").stat().st_size
    report = {
        "seed": args.seed,
        "steps": args.steps,
        "hyperparameters": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"
        },
        "num_parameters": n_params,
        "model_safetensors_bytes": weights_bytes,
        "train_time_s": round(train_time, 1),
        "final_train_loss": round(sum(losses[-20:]) / 20, 5),
        **metrics,
        "total_time_s": round(time.perf_counter() - started, 1),
        "torch_num_threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info(
        "heldout accuracy %.4f, best probe %s, total %.1f s",
        metrics["heldout_accuracy"],
        metrics["probe"]["best"],  # type: ignore[index]
        report["total_time_s"],
    )


if __name__ == "__main__":
    main()
