"""Re-execute the notebooks in ``notebooks/`` and write them back with their outputs.

The notebooks are committed executed, so that Jupyter and GitHub show their plots, and
``tests/test_notebooks_and_examples.py`` fails when a committed notebook's outputs no longer
match what it produces. Refresh them after changing a notebook (or what it shows)::

    make notebooks                                   # every notebooks/*.ipynb
    .venv/bin/python scripts/execute_notebooks.py notebooks/02_store.ipynb   # some of them

Each notebook runs in its own temporary directory as working directory, so its scratch files
never land in the repository: notebooks write them to relative paths (``stores/``,
``figures/``). A notebook that shows a figure inline also saves it there as a PNG; the test
checks that it did. Volatile metadata (execution timestamps,
the kernel's Python version) is left out, so that a refresh's diff shows only what changed in
the outputs. A notebook that raises is not written back, and the script exits non-zero.
The test executes notebooks with ``--into DIR``, through the same ``execute()``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
# Per cell. Starting a vLLM engine takes about a minute on a 2-core CPU machine.
CELL_TIMEOUT_S = 600


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def execute(nb: nbformat.NotebookNode, cwd: Path) -> nbformat.NotebookNode:
    """Run every cell of ``nb`` in place, with ``cwd`` as the kernel's working directory.

    Stops at the first error (``nbclient.exceptions.CellExecutionError``). Consecutive stream
    outputs are merged as Jupyter shows them, so how the kernel happened to chunk stdout does
    not change the notebook.

    Only what the kernel's own Python code writes becomes an output. Output written straight to
    file descriptors 1 and 2, which is everything vLLM's engine processes print while starting
    (Triton and NUMA notices, deprecation warnings, weight-loading bars), goes to this process's
    terminal instead: it differs between machines and would make the committed outputs depend
    on where they were made. A live Jupyter session still shows it.
    """
    NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        extra_arguments=["--IPKernelApp.capture_fd_output=False"],
        resources={"metadata": {"path": str(cwd)}},
        record_timing=False,
        coalesce_streams=True,
    ).execute()
    return nb


def strip_volatile(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop the metadata that changes on every run or machine, in place."""
    for cell in nb.cells:
        # nbclient's (and JupyterLab's) per-cell timestamps and run times.
        for key in ("execution", "ExecuteTime"):
            cell.metadata.pop(key, None)
    nb.metadata.get("language_info", {}).pop("version", None)
    return nb


def refresh(path: Path) -> float:
    """Execute the notebook at ``path`` and write it back; return the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"probehook-{path.stem}-") as cwd:
        execute(nb, Path(cwd))
    elapsed = time.perf_counter() - start
    strip_volatile(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return elapsed


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def execute_into(path: Path, directory: Path) -> Path:
    """Execute the notebook at ``path`` with ``directory`` as working directory and write the
    executed copy there (the committed file is left alone); return the copy's path. The tests
    run notebooks this way, in a subprocess, two at a time."""
    nb = nbformat.read(path, as_version=4)
    directory.mkdir(parents=True, exist_ok=True)
    execute(nb, directory)
    copy = directory / path.name
    nbformat.write(strip_volatile(nb), copy)
    return copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    parser.add_argument(
        "--into",
        type=Path,
        metavar="DIR",
        help="execute in DIR and write the executed copies there, not back in place",
    )
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or notebook_paths()
    for path in paths:
        print(f"executing {_shown(path)} ...", flush=True)
        try:
            if args.into is not None:
                done = f"wrote {execute_into(path, args.into)}"
            else:
                done = f"wrote {_shown(path)} ({refresh(path):.0f} s)"
        except Exception as exc:  # a failing cell: report it and leave the file as it was
            print(f"{_shown(path)} failed, left unchanged:\n{exc}", file=sys.stderr)
            return 1
        print(done, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
