"""Train the tiny two-digit-addition Llama that ships in ``probehook/assets/tiny-arith``.

The model is trained only on correct statements ``"a+b=c."``; 10% of the ``(a, b)`` pairs are
held out. After training the script reloads the saved model, measures greedy exact-match
accuracy on the held-out pairs and fits linear probes (true vs false statements) on every
layer, and writes the numbers to ``training_report.json`` next to the weights.

Usage (about 5 minutes on 2 CPU cores)::

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
    answer_accuracy,
    format_prompt,
    make_statement,
    probe_layer_accuracies,
    split_pairs,
)

log = logging.getLogger("train_tiny_model")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "probehook" / "assets" / "tiny-arith"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Digits and the statement punctuation; the space is there so odd inputs stay representable.
CHARACTERS = list("0123456789+=. ")
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
    """A small Llama; head_dim is fixed at 64 because vLLM's CPU attention needs it."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 64,
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


def encode_training_set(
    tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]], loss_on: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``<s>a+b=c.</s>`` rows and their labels.

    With ``loss_on="answer"`` only the answer, ``"."`` and ``</s>`` are scored: the operands are
    uniformly random, so predicting them teaches nothing about addition.
    """
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    for a, b in pairs:
        ids = tokenizer(make_statement(a, b)).input_ids + [tokenizer.eos_token_id]
        n_prompt = len(tokenizer(format_prompt(a, b)).input_ids)
        rows.append(ids)
        masks.append([loss_on == "all" or i >= n_prompt for i in range(len(ids))])
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, mask) in enumerate(zip(rows, masks, strict=True)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(ids, mask)])
    return input_ids, labels


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.05) -> float:
    """Linear warm-up, then cosine decay to ``floor`` times the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    args: argparse.Namespace,
) -> list[float]:
    """Plain AdamW loop over reshuffled epochs; returns the loss of every step."""
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
    # A dedicated generator keeps the batch order a function of the seed alone.
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(input_ids), generator=generator)
    cursor = 0
    losses: list[float] = []
    model.train()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for _ in bar:
        if cursor + args.batch_size > len(order):
            order = torch.randperm(len(input_ids), generator=generator)
            cursor = 0
        batch = order[cursor : cursor + args.batch_size]
        cursor += args.batch_size
        # No attention mask: pads only ever follow real tokens, and causal attention means real
        # tokens never look at them; their labels are ignored.
        loss = model(input_ids=input_ids[batch], labels=labels[batch]).loss
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
    metrics: dict[str, object] = {
        "heldout_accuracy": answer_accuracy(model, tokenizer, heldout),
        "heldout_pairs": len(heldout),
        "train_accuracy_sample": answer_accuracy(model, tokenizer, train_sample),
        "train_sample_pairs": len(train_sample),
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
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loss-on", choices=["answer", "all"], default="answer")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.hidden_size % 64:
        raise SystemExit("--hidden-size must be a multiple of 64 (head_dim is 64)")
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
    input_ids, labels = encode_training_set(tokenizer, train_pairs, args.loss_on)

    train_started = time.perf_counter()
    losses = train(model, input_ids, labels, args)
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
