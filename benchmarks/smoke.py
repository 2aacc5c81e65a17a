"""What ``--smoke`` means for every benchmark that ``make bench`` runs.

``python benchmarks/NAME.py --smoke`` runs the benchmark's whole path (its engines built, its
requests run, its figures computed and printed) on the smallest workload it allows: one
round, a few prompts and tokens, a Llama of hidden 128 and 2-4 layers (:func:`dummy_model`),
eager engines (no compiled graph to build: a compiled start-up costs about a minute on two
cores) with a KV cache of 64 MiB (``SMOKE_KV_CACHE_BYTES``; zeroing ``make bench``'s 1 GiB
takes a second or more an engine, and six engines live at once in some benchmarks), engines
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set: an offline
engine's core and worker in the benchmark's process, an AsyncLLM's or a server's worker in
its engine core, instead of a process and a vLLM import each, about 20 CPU-seconds here), and
without the comparisons that only matter for real figures. Its figures mean nothing; it
writes no results file (benchmarks/results/ keeps the last real run). It is what ``make
bench-smoke`` and tests/test_benchmarks_smoke.py run, so that a benchmark that no longer runs
fails there instead of at the next ``make bench``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

SMOKE_HELP = (
    "a run of seconds that only checks the benchmark still works: one round, a tiny model, "
    "eager engines, no results file written (overrides the workload's flags)"
)
SMOKE_KV_CACHE_BYTES = 64 << 20
"""Every smoke engine's KV cache (vLLM's ``kv_cache_memory_bytes``)."""
SMOKE_DONE = "--smoke: figures above computed; nothing written to benchmarks/results"
"""The line a benchmark prints last in smoke mode (tests/test_benchmarks_smoke.py looks for
the benchmark's own figures above it too)."""


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def shrink(args: argparse.Namespace, **small: Any) -> argparse.Namespace:
    """In smoke mode, ``args`` with ``small``'s values (the smoke workload), engines built
    in-process from now on (unless the environment says otherwise), and vLLM's
    ``VLLM_CPU_KVCACHE_SPACE`` unset (it would override every engine's
    ``kv_cache_memory_bytes``: :func:`engine_args`); else unchanged."""
    if args.smoke:
        for name, value in small.items():
            setattr(args, name, value)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return args


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments of smoke mode: eager (no compilation), a small KV cache; none
    otherwise. Every engine a smoke run builds takes them (a plain ``vllm.LLM`` without a
    memory setting would ask for most of the machine's memory)."""
    if not args.smoke:
        return {}
    return {"enforce_eager": True, "kv_cache_memory_bytes": SMOKE_KV_CACHE_BYTES}


def server_args(args: argparse.Namespace) -> list[str]:
    """A smoke server's command-line flags: eager. Its KV cache stays at 1 GiB:
    ``probehook.testing.ServerProcess`` sets ``VLLM_CPU_KVCACHE_SPACE=1`` when the
    environment has none, and vLLM lets that override ``--kv-cache-memory-bytes``."""
    return ["--enforce-eager"] if args.smoke else []


def dummy_model(folder: Path, hidden: int, layers: int, **config: Any) -> Path:
    """The benchmarks' config-only Llama (``load_format="dummy"``). Below hidden 1024 its
    heads are 64 wide (a size vLLM's CPU attention supports) and its MLP twice the hidden
    size, so hidden 128 is a model of a few million parameters, most of them the LM head."""
    from probehook.testing import write_dummy_config

    if hidden < 1024:
        config = {
            "num_heads": hidden // 64,
            "num_kv_heads": hidden // 64,
            "intermediate_size": 2 * hidden,
            **config,
        }
    return write_dummy_config(folder, hidden_size=hidden, num_layers=layers, **config)


def shutdown(engines: Any) -> None:
    """Stop offline engines (probehook's ``LLM`` and plain ``vllm.LLM``, which has no
    ``shutdown``) now, not at garbage collection: a process that goes on to run another
    benchmark (tests/test_benchmarks_smoke.py) gets their memory back."""
    for engine in engines:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        else:
            engine.llm_engine.engine_core.shutdown()


def done(args: argparse.Namespace) -> None:
    """Smoke mode's last line (the run wrote nothing)."""
    if args.smoke:
        print(SMOKE_DONE, flush=True)
