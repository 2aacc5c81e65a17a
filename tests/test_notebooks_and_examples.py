"""Notebooks and examples are executed, so they stay true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_notebook_runs(name: str, tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]
    assert not errors


@pytest.mark.parametrize("script", ["demo.py", "capture_hidden_states.py"])
def test_example_runs(script: str) -> None:
    # As a user runs them: vLLM's own log level, not the test suite's.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layer" in result.stdout
    # vLLM's warnings stay out of the result, and the engine shuts down cleanly.
    output = result.stdout + result.stderr
    assert " WARNING " not in output and "force killing" not in output.lower(), output[-3000:]
