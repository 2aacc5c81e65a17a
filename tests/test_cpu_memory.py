"""The CPU memory default: a KV cache sized from the model when the user chose nothing.

The real-engine check is examples/quickstart.py, run by test_notebooks_and_examples.py with no
memory setting while another process holds 6 GiB (vLLM's default would refuse to start)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from probehook.adapter.frontend import cpu_memory

GIB = 1 << 30


def config(layers: int = 4, kv_heads: int = 2, head: int = 64, max_len: int = 256) -> Any:
    model = SimpleNamespace(
        dtype=torch.bfloat16,
        max_model_len=max_len,
        get_num_layers=lambda parallel: layers,
        get_num_kv_heads=lambda parallel: kv_heads,
        get_head_size=lambda: head,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=None,
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def test_small_models_get_the_floor() -> None:
    size, tokens = cpu_memory.default_kv_cache_bytes(config(), available_bytes=16 * GIB)
    per_token = 2 * 4 * 2 * 64 * 2
    assert size == cpu_memory.MIN_BYTES and tokens == size // per_token


def test_large_models_get_sequences_capped_by_free_memory() -> None:
    # An 8B-like shape: 32 layers, 8 KV heads of 128, 8k context: 1 GiB per sequence.
    big = config(layers=32, kv_heads=8, head=128, max_len=8192)
    one_sequence = 2 * 32 * 8 * 128 * 2 * 8192
    size, _ = cpu_memory.default_kv_cache_bytes(big, available_bytes=64 * GIB)
    assert size == cpu_memory.SEQUENCES * one_sequence
    size, _ = cpu_memory.default_kv_cache_bytes(big, available_bytes=8 * GIB)
    assert size == 2 * GIB  # a quarter of what is free
    size, _ = cpu_memory.default_kv_cache_bytes(big, available_bytes=2 * GIB)
    assert size == one_sequence  # never less than one full sequence


@pytest.mark.parametrize(
    "kwargs, env",
    [
        ({"gpu_memory_utilization": 0.2}, None),
        ({"kv_cache_memory_bytes": 1 << 28}, None),
        ({}, "3"),
    ],
)
def test_anything_the_user_sets_wins(kwargs: dict, env: str | None, monkeypatch) -> None:
    monkeypatch.delenv(cpu_memory.ENV_CHOICE, raising=False)
    if env is not None:
        monkeypatch.setenv(cpu_memory.ENV_CHOICE, env)

    def resolve(model: str, kwargs: dict) -> Any:
        raise AssertionError("the config is not resolved when the user chose")

    assert cpu_memory.size_for_cpu("m", kwargs, resolve) == kwargs


def test_nothing_set_on_cpu_sizes_the_kv_cache(monkeypatch, caplog) -> None:
    monkeypatch.delenv(cpu_memory.ENV_CHOICE, raising=False)
    caplog.set_level(logging.INFO, logger=cpu_memory.__name__)
    out = cpu_memory.size_for_cpu("m", {"max_model_len": 256}, lambda model, kwargs: config())
    assert out == {"max_model_len": 256, "kv_cache_memory_bytes": cpu_memory.MIN_BYTES}
    assert "reserving 0.25 GiB for the KV cache" in caplog.text
