"""The examples, one after another in ONE process, each as ``python examples/NAME.py`` runs it.

tests/test_notebooks_and_examples.py runs this file as a subprocess (in the background, see
tests/conftest.py): ``python example_host.py OUT_DIR NAME...``. Each example runs as the main
module (``runpy``, ``__name__ == "__main__"``, its own ``sys.argv`` and ``sys.path[0]``) with
this process's file descriptors 1 and 2 pointed at ``OUT_DIR/NAME.stdout`` and ``.stderr``:
what it prints, what vLLM logs and what the engine processes it spawns print all land there,
as they would in a terminal. ``OUT_DIR/NAME.returncode`` is the exit status a shell would
see. The engines run in-process (the suite's environment), so the examples share one vLLM
import instead of one each.

quickstart.py runs first (it shows the KV-cache notice that probehook logs once per process)
while another process holds memory (:data:`BUSY_MACHINE_GIB`); collect_and_probe.py, which
starts Ray, runs last.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY_MACHINE_GIB = 6
"""quickstart.py (the README's first example) runs while another process holds this much."""
FIRST, LAST = "quickstart.py", "collect_and_probe.py"


def order(names: list[str]) -> list[str]:
    """quickstart.py first, collect_and_probe.py last, the rest as given."""
    return sorted(names, key=lambda n: (n != FIRST, n == LAST))


@contextlib.contextmanager
def memory_held(gib: int) -> Iterator[None]:
    """Another process holds ``gib`` GiB of touched memory meanwhile (a busy laptop)."""
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys, time\nb = bytearray({gib} << 30)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('held', flush=True)\ntime.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        yield
    finally:
        hog.kill()
        hog.wait()


@contextlib.contextmanager
def output_to(out_dir: Path, name: str) -> Iterator[None]:
    """File descriptors 1 and 2 (and so sys.stdout, sys.stderr) write to NAME's files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with (
        open(out_dir / f"{name}.stdout", "wb") as out,
        open(out_dir / f"{name}.stderr", "wb") as err,
    ):
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_example(name: str) -> int:
    """Run examples/NAME as the main module; the exit status a shell would see."""
    path = ROOT / "examples" / name
    sys.argv = [str(path)]
    sys.path[0] = str(path.parent)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as Python would, status 1
        traceback.print_exc()
        return 1
    return 0


def main(out_dir: Path, names: list[str]) -> None:
    for name in order(names):
        with output_to(out_dir, name):
            held = memory_held(BUSY_MACHINE_GIB) if name == FIRST else contextlib.nullcontext()
            with held:
                status = run_example(name)
        (out_dir / f"{name}.returncode").write_text(str(status))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
