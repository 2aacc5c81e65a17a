"""Notebooks and examples are executed, so they stay true.

Notebooks are committed executed (readers on GitHub see their outputs). Executing one here also
checks that its committed outputs are fresh: ``make notebooks`` (scripts/execute_notebooks.py)
refreshes them.

Each notebook runs in its own kernel, the examples one after another in one process
(tests/example_host.py: each as its own main module, with its own output); their engines run
in-process, as everywhere outside the topology set (tests/README.md). They start at the
session's first test (tests/conftest.py, ``background``) and run beside the rest of the suite,
the slowest first; this module's tests run after the rest and check what they gave.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from engine_layout import IN_PROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# openai_client.py runs in tests/test_server.py, against that module's server.
EXAMPLES = [
    "demo.py",
    "capture_hidden_states.py",
    "stream_rows.py",
    "segment_image.py",
    "quickstart.py",
    "collect_and_probe.py",
    "sae_features.py",
    "lenses.py",
]
NOISE = ("Triton", "FutureWarning", "NUMA binding", "Loading safetensors", " WARNING ")
"""vLLM's warnings and loading bars, which the examples keep out of their output."""
SUBPROCESS_TIMEOUT_S = 600
SLOWEST_FIRST = ("examples", "05_non_text_outputs.ipynb", "03_probes.ipynb")
"""The longest runs here (the examples' host, then notebooks), started first so that none is
left to run alone at the end."""


class Run(NamedTuple):
    """A notebook or example running in the background, and its working directory."""

    process: Future[subprocess.CompletedProcess]
    directory: Path | None = None


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=ROOT,
    )


def _execute_notebook(name: str, directory: Path) -> subprocess.CompletedProcess:
    """scripts/execute_notebooks.py --into: the notebook runs as ``make notebooks`` runs it,
    with ``directory`` as working directory, and its executed copy lands there."""
    script = str(ROOT / "scripts" / "execute_notebooks.py")
    # The kernel hosts its engines in-process, whatever the layout of the test running now.
    env = {**os.environ, **IN_PROCESS_ENV}
    return _run([script, "--into", str(directory), str(ROOT / "notebooks" / name)], env)


def _run_examples(names: list[str], out: Path) -> dict[str, subprocess.CompletedProcess]:
    """tests/example_host.py runs ``names`` in one process; what each gave, by name."""
    # As a user runs them: vLLM's own log level and memory defaults, not the test suite's.
    unset = ("VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE")
    env = {k: v for k, v in os.environ.items() if k not in unset} | IN_PROCESS_ENV
    host = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "example_host.py"), str(out), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S * len(names),
        cwd=ROOT,
    )
    results = {}
    for name in names:
        status, stdout, stderr = (
            out / f"{name}.{kind}" for kind in ("returncode", "stdout", "stderr")
        )
        ended = "" if status.is_file() else f"\nthe examples' host ended:\n{host.stderr[-3000:]}"
        results[name] = subprocess.CompletedProcess(
            name,
            int(status.read_text()) if status.is_file() else host.returncode or -1,
            stdout.read_text(errors="replace") if stdout.is_file() else "",
            (stderr.read_text(errors="replace") if stderr.is_file() else "") + ended,
        )
    return results


def _one(results: Future[dict[str, Any]], name: str) -> Future[subprocess.CompletedProcess]:
    """The future of ``name``'s result among ``results``."""
    one: Future[subprocess.CompletedProcess] = Future()

    def done(future: Future[dict[str, Any]]) -> None:
        error = future.exception()
        if error is None:
            one.set_result(future.result()[name])
        else:
            one.set_exception(error)

    results.add_done_callback(done)
    return one


def start_in_background(
    pool: ThreadPoolExecutor, items: list[pytest.Item], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    """Submit the notebooks and examples whose tests are among ``items`` to ``pool`` (the
    slowest first), by name. tests/conftest.py calls this at the session's start."""
    selected = {
        item.callspec.params.get("name") or item.callspec.params.get("script")
        for item in items
        if item.module is sys.modules[__name__]
        and item.originalname in ("test_notebook_runs", "test_example_runs")
    }
    if not selected or importlib.util.find_spec("nbclient") is None:
        return {}
    jobs: dict[str, Run] = {}
    order = sorted(["examples", *NOTEBOOKS], key=lambda n: n not in SLOWEST_FIRST)
    for name in order:
        if name in NOTEBOOKS and name in selected:
            directory = tmp_path_factory.mktemp(Path(name).stem)
            jobs[name] = Run(pool.submit(_execute_notebook, name, directory), directory)
        examples = [e for e in EXAMPLES if e in selected]
        if name == "examples" and examples:
            out = tmp_path_factory.mktemp("examples")
            results = pool.submit(_run_examples, examples, out)
            jobs.update({e: Run(_one(results, e), out) for e in examples})
    return jobs


@pytest.fixture
def runs(background: dict[str, Any]) -> dict[str, Run]:
    """The runs tests/conftest.py started (:func:`start_in_background`), by name."""
    pytest.importorskip("nbclient")
    return background[__name__]


def _output_structure(cell: Any) -> tuple[frozenset[str], list[tuple[str, tuple[str, ...]]]]:
    """A code cell's outputs without their values: the names of its streams, and the type and
    mime types of each of its other outputs, in order."""
    streams = frozenset(o["name"] for o in cell.get("outputs", []) if o["output_type"] == "stream")
    rich = [
        (o["output_type"], tuple(sorted(o.get("data", {}))))
        for o in cell.get("outputs", [])
        if o["output_type"] != "stream"
    ]
    return streams, rich


def notebook_staleness(committed: Any, fresh: Any) -> list[str]:
    """Why the ``committed`` notebook is not what executing it gives now (``fresh``).

    Returns one line per problem; an empty list means the committed notebook is fresh. Compared:
    the cells (number, type, source); for each code cell, its execution count (a notebook
    committed unexecuted, or run out of order, differs) and the structure of its outputs: which
    streams (stdout, stderr) it wrote, and the type (display_data, execute_result, ...) and mime
    types of its other outputs, in order. Error outputs on either side are problems, and so is
    a committed cell with no outputs where executing it gives some. Values are not compared:
    numbers, store ids and PNG bytes vary with floating point, time and encoders. Streams are
    compared by name only because Jupyter and nbclient split and merge their chunks
    differently.
    """
    problems = []
    for label, nb in (("committed", committed), ("fresh", fresh)):
        for i, cell in enumerate(nb["cells"]):
            for out in cell.get("outputs", []):
                if out["output_type"] == "error":
                    problems.append(f"{label} cell {i} has an error output: {out.get('ename')}")
    if len(committed["cells"]) != len(fresh["cells"]):
        problems.append(
            f"{len(committed['cells'])} cells committed, {len(fresh['cells'])} when executed"
        )
    for i, (old, new) in enumerate(zip(committed["cells"], fresh["cells"], strict=False)):
        if old["cell_type"] != new["cell_type"] or old["source"] != new["source"]:
            problems.append(
                f"cell {i}: committed {old['cell_type']} cell differs in type or source"
            )
            continue
        if new["cell_type"] != "code":
            continue
        if new.get("outputs") and not old.get("outputs"):
            problems.append(f"cell {i}: committed without outputs, executing it gives some")
        elif _output_structure(old) != _output_structure(new):
            problems.append(
                f"cell {i}: committed outputs {_output_structure(old)}, "
                f"executed {_output_structure(new)}"
            )
        if old.get("execution_count") != new.get("execution_count"):
            problems.append(
                f"cell {i}: committed execution count {old.get('execution_count')}, "
                f"executed {new.get('execution_count')}"
            )
    return problems


@pytest.mark.engine
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name: str, runs: dict[str, Run]) -> None:
    import nbformat

    result = runs[name].process.result()
    # A failing cell: the script names it, with its traceback, on stderr.
    assert result.returncode == 0, result.stderr[-5000:]
    directory = runs[name].directory
    assert directory is not None
    committed = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    fresh = nbformat.read(directory / name, as_version=4)

    problems = notebook_staleness(committed, fresh)
    assert not problems, (
        f"notebooks/{name} is not committed as it executes now; refresh it with `make notebooks`"
        " (scripts/execute_notebooks.py) and commit the outputs:\n" + "\n".join(problems)
    )
    # Figures are shown inline and also saved (under the working directory).
    shown = sum("image/png" in o.get("data", {}) for c in fresh.cells for o in c.get("outputs", []))
    saved = sorted(directory.rglob("*.png"))
    assert len(saved) >= shown, f"{shown} figures shown but only {saved} saved"
    for png in saved:
        assert png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 1000, png


def _clear_outputs(nb: Any) -> Any:
    """``nb`` as committed without outputs (as ``jupyter nbconvert --clear-output`` leaves it)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_executed(name: str) -> None:
    """Cheap checks on the committed file alone: it has outputs and no errors, and the
    staleness check catches it stripped of its outputs or with a cell added."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    assert notebook_staleness(nb, nb) == []
    assert notebook_staleness(_clear_outputs(nb), nb), f"notebooks/{name} has no outputs"
    grown = copy.deepcopy(nb)
    grown.cells.append(nbformat.v4.new_code_cell("print(1)"))
    assert notebook_staleness(nb, grown)
    # Volatile metadata stays out of the committed file (scripts/execute_notebooks.py strips it).
    assert all("execution" not in c.metadata for c in nb.cells)


def test_notebook_staleness_on_handmade_notebooks() -> None:
    nbformat = pytest.importorskip("nbformat")
    v4 = nbformat.v4

    def notebook(numbers: str, png: str, *, split_stdout: bool = False) -> Any:
        stdout = [v4.new_output("stream", name="stdout", text=f"shape (4, 7) {numbers}\n")]
        if split_stdout:
            stdout.append(v4.new_output("stream", name="stdout", text="more\n"))
        plot = v4.new_code_cell("plot()", execution_count=2)
        plot.outputs = [
            *stdout,
            v4.new_output("display_data", data={"image/png": png, "text/plain": "<Figure>"}),
        ]
        return v4.new_notebook(
            cells=[
                v4.new_markdown_cell("# title"),
                v4.new_code_cell("setup()", execution_count=1),
                plot,
            ]
        )

    fresh = notebook("[32.68, 47.85]", "iVBORw0KGgo=")
    # Other numbers, other PNG bytes, stdout in two chunks: still fresh.
    assert (
        notebook_staleness(notebook("[32.7, 47.9]", "iVBORw0KGgoA", split_stdout=True), fresh) == []
    )

    stripped = _clear_outputs(fresh)
    assert any("without outputs" in p for p in notebook_staleness(stripped, fresh))

    grown = copy.deepcopy(fresh)
    grown.cells.append(v4.new_code_cell("more()"))
    assert any("cells committed" in p for p in notebook_staleness(fresh, grown))

    edited = copy.deepcopy(fresh)
    edited.cells[2].source = "plot(log=True)"
    assert any("source" in p for p in notebook_staleness(fresh, edited))

    svg = copy.deepcopy(fresh)
    svg.cells[2].outputs[1].data = {"image/svg+xml": "<svg/>", "text/plain": "<Figure>"}
    assert any("outputs" in p for p in notebook_staleness(svg, fresh))

    noisy = copy.deepcopy(fresh)
    noisy.cells[1].outputs = [v4.new_output("stream", name="stderr", text="Loading 100%\n")]
    assert any("cell 1" in p for p in notebook_staleness(fresh, noisy))

    failing = copy.deepcopy(fresh)
    failing.cells[2].outputs.append(
        v4.new_output("error", ename="ValueError", evalue="", traceback=[])
    )
    assert any("error output" in p for p in notebook_staleness(failing, fresh))


@pytest.mark.engine
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs(script: str, runs: dict[str, Run]) -> None:
    result = runs[script].process.result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layer" in result.stdout
    # vLLM's warnings stay out of the result, and the engine shuts down cleanly.
    output = result.stdout + result.stderr
    assert "force killing" not in output.lower(), output[-3000:]
    noise = [line for line in output.splitlines() if any(n in line for n in NOISE)]
    assert not noise, noise
    if script == "quickstart.py":
        # The README's numbers, with no memory setting and 6 GiB held elsewhere.
        assert "text '46.'" in result.stdout and "layer 3: prefill rows (7, 128)" in output
        assert "probehook: on CPU, reserving" in result.stderr, result.stderr[-3000:]
    if script == "sae_features.py":
        # The bundled SAE's features of every generated token, flagged, clamped and stored.
        assert "text '46.'; features of layer 3 per generated token" in result.stdout
        assert re.search(r"token 3: l0 8 +top \[\d+:", result.stdout), result.stdout
        assert "4 tokens of features, no rows" in result.stdout
    if script == "lenses.py":
        # A J-lens fitted on the tiny model; both lenses read the answer's first token.
        assert "fitted JacobianLens(layers=[0, 1, 2], d_model=128)" in result.stdout
        assert "text '46.'; the first token '4' under each lens" in result.stdout
        assert re.search(r"logit layer 3: top \['4'", result.stdout), result.stdout
        assert re.search(r"j +layer 3: top \['4'", result.stdout), result.stdout
    if script == "collect_and_probe.py":
        # 3,000 statements on two Ray replicas into one store, then a probe trained from it.
        assert "3000 statements captured (0 already stored)" in result.stdout, result.stdout
        assert re.search(r"replica-0: \d+ statements\n  replica-1: \d+", result.stdout)
        accuracy = re.search(r"held-out accuracy (\d\.\d+)", result.stdout)
        assert accuracy is not None and float(accuracy.group(1)) >= 0.9, result.stdout[-3000:]
    if script == "demo.py":
        # The main job: the best layer's probe is right on >= 90% of held-out statements,
        # the engine flagged some statements, and the figure exists.
        accuracy = re.search(r"^accuracy (\d\.\d+)$", result.stdout, re.MULTILINE)
        assert accuracy is not None and float(accuracy.group(1)) >= 0.9, result.stdout[-3000:]
        assert re.search(r"^   \* ", result.stdout, re.MULTILINE), result.stdout[-3000:]
        png = re.search(r"Figure written to (\S+\.png)", result.stdout)
        assert png is not None and Path(png.group(1)).read_bytes()[:4] == b"\x89PNG"
