"""Two-digit addition: the task behind the bundled ``tiny-arith`` model.

Statements look like ``"23+45=68."``. The training script, the tests and the demos all import
this module so that the held-out pairs, the false statements used for probing and the way
hidden states are read out are the same everywhere.

The plain-Python data helpers need nothing beyond the standard library; the evaluation helpers
at the bottom import torch, numpy and scikit-learn lazily so that importing the module stays
cheap.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Pair = tuple[int, int]
Position = Literal["period", "last_digit"]

MAX_OPERAND = 99
HOLDOUT_FRACTION = 0.1
# Wrong answers are near misses (c-10..c+10, never c): the hard case for a probe, and the
# answer length then rarely differs from the correct one, so length is no shortcut.
MAX_WRONG_OFFSET = 10
# Marker that follows a false statement in part of the training data ("23+45=69.!"); a true
# statement is followed by end-of-sequence instead. See docs/tiny-model.md for why.
FALSE_MARKER = "!"
# Offsets added to the seed so that the different random streams are independent of one
# another while all following from the one seed the user passes.
_PROBE_SPLIT_SALT = 1_000_003
_WRONG_ANSWER_SALT = 2_000_003


def all_pairs() -> list[Pair]:
    """Every ``(a, b)`` with ``0 <= a, b <= 99``, in lexicographic order."""
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]


def split_pairs(
    seed: int = 0, holdout_fraction: float = HOLDOUT_FRACTION
) -> tuple[list[Pair], list[Pair]]:
    """Split all pairs into ``(train, heldout)``, deterministically for a given seed.

    A private ``random.Random(seed)`` is used (not the global one) so that the split does not
    depend on anything else the caller has drawn. Both lists come back sorted.
    """
    pairs = all_pairs()
    random.Random(seed).shuffle(pairs)
    n_heldout = round(len(pairs) * holdout_fraction)
    return sorted(pairs[n_heldout:]), sorted(pairs[:n_heldout])


def format_prompt(a: int, b: int) -> str:
    """The prompt the model completes, e.g. ``format_prompt(23, 45) == "23+45="``."""
    return f"{a}+{b}="


def format_answer(c: int) -> str:
    """The completion for answer ``c`` (without the end-of-sequence token), e.g. ``"68."``."""
    return f"{c}."


def wrong_offsets(c: int) -> list[int]:
    """The offsets ``k`` with ``1 <= |k| <= 10`` that keep the wrong answer ``c + k`` >= 0."""
    return [k for k in range(-MAX_WRONG_OFFSET, MAX_WRONG_OFFSET + 1) if k != 0 and c + k >= 0]


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A near-miss wrong answer ``a + b + k``, ``k`` drawn uniformly from :func:`wrong_offsets`."""
    c = a + b
    return c + rng.choice(wrong_offsets(c))


def make_statement(a: int, b: int, correct: bool = True, rng: random.Random | None = None) -> str:
    """``"a+b=c."`` with the true sum, or (``correct=False``) a near-miss wrong one.

    ``rng`` is required for false statements so that callers control reproducibility.
    """
    if correct:
        return format_prompt(a, b) + format_answer(a + b)
    if rng is None:
        raise ValueError("make_statement(correct=False) needs an rng for the wrong answer")
    return format_prompt(a, b) + format_answer(wrong_answer(a, b, rng))


def all_wrong_statements(a: int, b: int) -> list[str]:
    """Every near-miss false statement about ``a + b`` (without the false marker)."""
    c = a + b
    return [format_prompt(a, b) + format_answer(c + k) for k in wrong_offsets(c)]


def probe_pair_split(heldout: Sequence[Pair], seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """Split held-out pairs in two halves: one to fit a probe on, one to score it on.

    Splitting by pair (not by statement) keeps the true and false statement about the same
    ``a + b`` on the same side, so a probe cannot score by recognising operands.
    """
    pairs = sorted(heldout)
    random.Random(seed + _PROBE_SPLIT_SALT).shuffle(pairs)
    half = len(pairs) // 2
    return sorted(pairs[:half]), sorted(pairs[half:])


def probe_statements(pairs: Sequence[Pair], seed: int = 0) -> tuple[list[str], list[int]]:
    """A balanced set: for every pair one true (label 1) and one false (label 0) statement."""
    rng = random.Random(seed + _WRONG_ANSWER_SALT)
    texts: list[str] = []
    labels: list[int] = []
    for a, b in pairs:
        texts += [make_statement(a, b, True), make_statement(a, b, False, rng)]
        labels += [1, 0]
    return texts, labels


# --- Evaluation helpers (Hugging Face transformers; shared by the script and the tests) ---


def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int = 6,
    batch_size: int = 500,
) -> list[str]:
    """Greedy-decode each prompt until ``</s>``; returns the generated text only.

    Prompts are batched by token length so no padding is needed, and every step re-runs the
    whole (at most ~12-token) sequence: simpler than a KV cache and fast at this size.
    """
    import torch

    eos = tokenizer.eos_token_id
    encoded = [tokenizer(p).input_ids for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out: list[str] = [""] * len(prompts)
    with torch.no_grad():
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                ids = torch.tensor([encoded[i] for i in chunk])
                done = torch.zeros(len(chunk), dtype=torch.bool)
                steps: list[torch.Tensor] = []
                for _ in range(max_new_tokens):
                    nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
                    nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                    steps.append(nxt)
                    done |= nxt == eos
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    if bool(done.all()):
                        break
                generated = torch.stack(steps, dim=1).tolist()
                for i, row in zip(chunk, generated, strict=True):
                    row = row[: row.index(eos)] if eos in row else row
                    out[i] = tokenizer.decode(row, skip_special_tokens=True)
    return out


def answer_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[Pair]
) -> float:
    """Greedy exact match of ``"c."`` after ``"a+b="`` over ``pairs``."""
    completions = greedy_completions(model, tokenizer, [format_prompt(a, b) for a, b in pairs])
    hits = sum(c == format_answer(a + b) for c, (a, b) in zip(completions, pairs, strict=True))
    return hits / len(pairs)


def verdict_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    labels: Sequence[int],
) -> float:
    """How often the model's own next-token choice after the final ``"."`` is right.

    Only ``</s>`` (statement true) and :data:`FALSE_MARKER` (statement false) are compared.
    """
    import torch

    eos = tokenizer.eos_token_id
    mark = tokenizer.convert_tokens_to_ids(FALSE_MARKER)
    enc = tokenizer(list(texts), padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    last = logits[torch.arange(len(texts)), enc["attention_mask"].sum(dim=1) - 1]
    says_true = (last[:, eos] > last[:, mark]).long()
    return (says_true == torch.tensor(list(labels))).sum().item() / len(texts)


def hidden_state_features(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    position: Position = "period",
    batch_size: int = 500,
) -> np.ndarray:
    """Hidden states at one token of each statement, for every HF ``hidden_states`` entry.

    Returns an array of shape ``(num_layers + 1, len(texts), hidden_size)``; entry 0 is the
    embedding output and entry ``L + 1`` the output of decoder layer ``L`` (the last entry has
    the final RMSNorm applied, as Hugging Face returns it). ``position`` picks the final
    ``"."`` or the last answer digit just before it.
    """
    import numpy as np
    import torch

    offset = 1 if position == "period" else 2
    chunks: list[np.ndarray] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            # Right padding: with causal attention real tokens never see the pads after them.
            enc = tokenizer(
                list(texts[start : start + batch_size]), padding=True, return_tensors="pt"
            )
            out = model(**enc, output_hidden_states=True)
            where = enc["attention_mask"].sum(dim=1) - offset
            rows = torch.arange(len(where))
            chunks.append(torch.stack([h[rows, where] for h in out.hidden_states]).numpy())
    return np.concatenate(chunks, axis=1)


def fit_probe(
    x_fit: np.ndarray,
    y_fit: Sequence[int],
    x_eval: np.ndarray,
    y_eval: Sequence[int],
    shuffle_seed: int | None = None,
) -> float:
    """Fit a standardised logistic-regression probe and return its accuracy on the eval set.

    With ``shuffle_seed`` the fit labels are permuted first: a control that should score near
    chance, showing that the probe is not just memorising.
    """
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = np.asarray(y_fit)
    if shuffle_seed is not None:
        y = np.random.default_rng(shuffle_seed).permutation(y)
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    probe.fit(x_fit, y)
    return float(probe.score(x_eval, np.asarray(y_eval)))


def probe_layer_accuracies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    heldout: Sequence[Pair],
    seed: int = 0,
    position: Position = "period",
    shuffle_seed: int | None = None,
) -> list[float]:
    """Probe accuracy (true vs false statement) for each HF ``hidden_states`` entry.

    The probe is fitted on statements about one half of the held-out pairs and scored on the
    other half (see :func:`probe_pair_split`).
    """
    fit_pairs, eval_pairs = probe_pair_split(heldout, seed)
    fit_texts, y_fit = probe_statements(fit_pairs, seed)
    eval_texts, y_eval = probe_statements(eval_pairs, seed + 1)
    x_fit = hidden_state_features(model, tokenizer, fit_texts, position)
    x_eval = hidden_state_features(model, tokenizer, eval_texts, position)
    return [
        fit_probe(x_fit[layer], y_fit, x_eval[layer], y_eval, shuffle_seed)
        for layer in range(x_fit.shape[0])
    ]
