"""Shared fixtures. vLLM engines are session-scoped: a compiled start-up costs about a minute."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The CPU backend would otherwise size the KV cache from most of RAM and fail at start-up.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Many short-lived engines in one process: keep their logs readable.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _quick_engine_teardown() -> None:
    """vLLM's CPU engine-core process outlives its workers after SIGTERM, so every engine
    shutdown waits out vLLM's 5 s grace period and then kills it (plain vLLM does the same).
    The engines here hold nothing that needs the grace period (stores live in the front end,
    and the shutdown tests check the store, not the engine), so this process waits 1 s: about
    4 s saved per engine, minutes over the suite. Engines in subprocesses (examples,
    notebooks, servers) keep vLLM's default."""
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.shutdown

    def shutdown(procs: list, timeout: float | None = None) -> None:
        original(procs, timeout=1.0 if timeout is None else timeout)

    engine_utils.shutdown = shutdown


_quick_engine_teardown()

ENGINE_DEFAULTS = dict(dtype="float32", max_model_len=256, gpu_memory_utilization=0.1, seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine_defaults() -> dict:
    return dict(ENGINE_DEFAULTS)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from probehook.testing import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)


@pytest.fixture(scope="session")
def compiled_llm(llama_dir: Path) -> Iterator[object]:
    """vLLM's default compiled mode, under pressure: small prefill chunks, a KV cache small
    enough to force preemption, prefix caching on."""
    from probehook import LLM
    from probehook.testing import random_probes

    llm = LLM(
        str(llama_dir),
        layers="all",
        include_prefill=True,
        probes=random_probes(128),
        max_num_batched_tokens=32,
        max_num_seqs=16,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        num_gpu_blocks_override=12,
        block_size=32,
        disable_log_stats=False,
        **ENGINE_DEFAULTS,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def eager_llm(llama_dir: Path) -> Iterator[object]:
    from probehook import LLM

    llm = LLM(
        str(llama_dir), layers=[0, 2], include_prefill=True, enforce_eager=True, **ENGINE_DEFAULTS
    )
    yield llm
    llm.shutdown()
