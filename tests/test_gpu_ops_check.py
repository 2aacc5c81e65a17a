"""scripts/gpu_ops_check.py, the worker ops' check for a GPU machine (eager, torch.compile and
CUDA-graph replay agree), behaves where there is no GPU: it says it needs CUDA, its
``--cpu-smoke`` mode passes, and it never imports vLLM (that machine has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_ops_check.py"
OP_ROWS = (
    "matmul (reference)",
    "layer only (no op)",
    "probehook::tap",
    "probehook::write steer (16 ops)",
    "probehook::write patch + probehook::keep",
    "SAEBank read_top_k (jumprelu)",
    "SAEBank read_top_k (topk)",
    "probehook::write clamp (jumprelu)",
    "probehook::write clamp (topk)",
    "LensBank read (logit lens, eager)",
    "AttentionBank read (paged keys, eager)",
)


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # No GPU, even on a machine that has one: the test is about the CPU-only behaviour.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_without_cuda_it_exits_2_naming_cuda() -> None:
    result = _run(str(SCRIPT))
    assert result.returncode == 2, result.stderr
    assert "needs CUDA" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_it_imports_no_vllm() -> None:
    """Every module the script and the ops import (-X importtime lists them) is vLLM-free,
    and an ``import vllm`` anywhere would fail (``sys.modules["vllm"] = None``)."""
    wrapper = (
        "import runpy, sys\n"
        "sys.modules['vllm'] = None\n"
        f"sys.argv = [{str(SCRIPT)!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    result = _run("-X", "importtime", "-c", wrapper)
    assert result.returncode == 2, result.stderr[-2000:]  # the no-CUDA exit, after every import
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "probehook.worker.clamp_op" in imported
    assert not [name for name in imported if "vllm" in name]


@pytest.mark.slow
def test_cpu_smoke_passes_and_prints_every_op(tmp_path: Path) -> None:
    """Eager vs torch.compile (inductor) of every op on tiny shapes: 15 s with a warm inductor
    cache, about a minute cold, on two cores."""
    out = tmp_path / "ops.md"
    result = _run(str(SCRIPT), "--cpu-smoke", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line
        for line in result.stdout.splitlines()
        if line.startswith("| ")
    }
    for op in OP_ROWS:
        assert op in rows, f"no row for {op}:\n{result.stdout}"
    for op in OP_ROWS[1:]:
        assert rows[op].rstrip().endswith("| ok |"), rows[op]
    assert "all checks passed" in result.stdout
    assert "vllm imported: False" in result.stdout
    assert out.read_text().strip() in result.stdout
