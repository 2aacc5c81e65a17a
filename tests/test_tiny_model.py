"""The bundled tiny-arith model: loads offline, does its task, and has a linear-probe signal.

Hugging Face transformers only (no vLLM), so these run anywhere in well under a minute. The
numbers are checked against the ``training_report.json`` written by
``scripts/train_tiny_model.py`` when the shipped weights were trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from probehook.models import tiny_model_path
from probehook.tasks.arithmetic import (
    answer_accuracy,
    fit_probe,
    format_prompt,
    hidden_state_features,
    probe_pair_split,
    probe_statements,
    split_pairs,
)

MAX_ASSET_BYTES = 10 * 1024 * 1024
# CPU float arithmetic may differ slightly across machines and thread counts.
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_path()


@pytest.fixture(scope="module")
def report(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "training_report.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


def test_assets_are_small_fp32_llama(model_dir: Path, model: LlamaForCausalLM) -> None:
    total = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    assert total <= MAX_ASSET_BYTES, f"assets are {total} bytes"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    # vLLM's CPU attention kernel only accepts some head sizes; 64 is one of them.
    assert model.config.head_dim == 64
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tokenizer_is_character_level_and_round_trips(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "23+45=68."
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_greedy_completion_example(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> None:
    enc = tokenizer(format_prompt(23, 45), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    completion = tokenizer.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
    assert completion == "68."


@pytest.mark.slow
def test_heldout_accuracy_matches_report(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, report: dict[str, Any]
) -> None:
    _, heldout = split_pairs(report["seed"])
    assert len(heldout) == report["heldout_pairs"]
    accuracy = answer_accuracy(model, tokenizer, heldout)
    assert accuracy == pytest.approx(report["heldout_accuracy"], abs=TOLERANCE)
    assert accuracy >= 0.9


def test_linear_probe_separates_true_from_false(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, report: dict[str, Any]
) -> None:
    seed = report["seed"]
    best = report["probe"]["best"]
    layer, position = best["hf_hidden_state_index"], best["position"]
    _, heldout = split_pairs(seed)
    fit_pairs, eval_pairs = probe_pair_split(heldout, seed)
    # Fitting and scoring on disjoint pairs: the probe cannot recognise operands.
    assert not set(fit_pairs) & set(eval_pairs)
    fit_texts, y_fit = probe_statements(fit_pairs, seed)
    eval_texts, y_eval = probe_statements(eval_pairs, seed + 1)
    assert sum(y_fit) * 2 == len(y_fit) and sum(y_eval) * 2 == len(y_eval)
    x_fit = hidden_state_features(model, tokenizer, fit_texts, position)[layer]
    x_eval = hidden_state_features(model, tokenizer, eval_texts, position)[layer]

    accuracy = fit_probe(x_fit, y_fit, x_eval, y_eval)
    assert accuracy >= 0.85
    assert accuracy >= best["accuracy"] - TOLERANCE

    control = fit_probe(x_fit, y_fit, x_eval, y_eval, shuffle_seed=seed)
    assert control < 0.65
