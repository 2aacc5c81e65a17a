"""Every benchmark ``make bench`` runs still runs: each with ``--smoke`` (benchmarks/smoke.py:
one round, a tiny model, eager engines, nothing written), so that a benchmark broken by a
change fails here instead of at the next ``make bench``.

ONE subprocess (this file run as a script) runs them one after another, as
tests/example_host.py runs the examples: each as its main module (``runpy``, ``sys.argv`` =
``[path, "--smoke"]``), its output in ``OUT/NAME.stdout`` and ``.stderr``, its exit status in
``OUT/NAME.returncode``, its wall time and CPU time (this process's and its children's:
engine cores, servers) in ``OUT/NAME.seconds``. Its offline engines run
in-process (tests/engine_layout.py), so they share the subprocess's one vLLM import. What
cannot run in-process adds processes to the suite's census: the AsyncLLMs of
async_streams.py (an engine core each: plain vLLM's, rows + probe, the SAE stream) and the
two servers of serve_load.py (a server and an engine core each): 8 with the subprocess.
collect.py's smoke run collects on one replica only (no Ray cluster; tests/test_collect.py
runs the Ray replicas).

Each test checks one benchmark: exit status 0, a line of its final figures (printed only
once its measuring finished) and smoke mode's last line.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = {
    "overhead.py": "All-layer capture into the store vs the same capture without it",
    "store_throughput.py": "One layer across 20 one-request shards after `compact`",
    "async_streams.py": "Late / early: ",
    "serve_load.py": "| probehook serve, 1 probe + 1 layer rows |",
    "pooling.py": "| segment | probehook, 1 layer rows + 1 probe |",
    "steering.py": "Added step time, steered vs not (same engine)",
    "saes.py": "| prefill | requests ask for the four in turn |",
    "lenses.py": "| J-lens, 1 layer, every prompt row |",
    "attention.py": "| attention, 1 layer, every prompt row |",
    "patching.py": "| a sweep over every layer and position: cells/s |",
    "collect.py": "| 1 replica |",
    "store_lanes.py": "Median of the per-round store ratios",
}
"""Each benchmark ``make bench`` runs, and a line of the figures it prints at the end."""
RUN_TIMEOUT_S = 1500
"""The whole smoke run (about 5 minutes on two idle cores; beside the rest of the suite it
shares them)."""


def test_every_benchmark_of_make_bench_is_smoke_tested() -> None:
    """``make bench``'s benchmarks are this file's, and ``make bench-smoke``'s, in order."""
    makefile = (ROOT / "Makefile").read_text()
    bench = re.search(r"^bench:.*\n((?:\t.*\n)+)", makefile, re.M)
    smoke = re.search(r"^bench-smoke:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert bench is not None and smoke is not None
    assert re.findall(r"benchmarks/(\w+\.py)", bench.group(1)) == list(BENCHMARKS)
    loop = re.search(r"for b in ([\w\s\\]+?); do", smoke.group(1))
    assert loop is not None
    assert [f"{b}.py" for b in loop.group(1).replace("\\", " ").split()] == list(BENCHMARKS)


def start_in_background(
    pool: ThreadPoolExecutor, items: list[pytest.Item], tmp_path_factory: pytest.TempPathFactory
) -> Future[Path] | None:
    """Submit the smoke subprocess to ``pool`` (tests/conftest.py's background modules: it
    runs beside the rest of the suite); None when no benchmark's test is selected."""
    if not any(
        item.module is sys.modules[__name__]
        and getattr(item, "originalname", None) == "test_benchmark_runs"
        for item in items
    ):
        return None
    out = tmp_path_factory.mktemp("benchmarks")
    return pool.submit(_run_smoke, out)


def _run_smoke(out: Path) -> Path:
    from engine_layout import IN_PROCESS_ENV

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS_ENV}
    subprocess.run(
        [sys.executable, __file__, str(out), *BENCHMARKS],
        env=env,
        cwd=ROOT,
        timeout=RUN_TIMEOUT_S,
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def smoke_run(background: dict[str, Any]) -> Path:
    """Every benchmark's smoke run, in one subprocess started at the session's start; the
    folder of their outputs."""
    return background[__name__].result()


@pytest.mark.engine
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_runs(smoke_run: Path, name: str) -> None:
    stdout = (smoke_run / f"{name}.stdout").read_text(errors="replace")
    stderr = (smoke_run / f"{name}.stderr").read_text(errors="replace")
    status = int((smoke_run / f"{name}.returncode").read_text())
    tail = f"\n--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-5000:]}"
    assert status == 0, f"benchmarks/{name} --smoke exited with {status}:{tail}"
    assert BENCHMARKS[name] in stdout, f"benchmarks/{name} printed no figures:{tail}"
    done = runpy.run_path(str(ROOT / "benchmarks" / "smoke.py"))["SMOKE_DONE"]
    assert stdout.rstrip().endswith(done), (
        f"benchmarks/{name} did not end as smoke mode does:{tail}"
    )


# -- the subprocess ----------------------------------------------------------------------------


def run_benchmark(name: str) -> int:
    """Run benchmarks/NAME --smoke as the main module; the exit status a shell would see."""
    path = ROOT / "benchmarks" / name
    sys.argv = [str(path), "--smoke"]
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


def cpu_seconds() -> float:
    """User and system time of this process and of its children that have ended."""
    import resource

    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usages)


def main(out_dir: Path, names: list[str]) -> None:
    import gc

    from engine_layout import in_process_by_default, inspect_for_children
    from example_host import output_to

    in_process_by_default()
    inspect_for_children()  # the AsyncLLMs' and servers' engine cores find vLLM's cache warm
    for name in names:
        start, cpu = time.perf_counter(), cpu_seconds()
        with output_to(out_dir, name):
            status = run_benchmark(name)
        gc.collect()  # what the benchmark left (its engines are shut down) goes now
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        (out_dir / f"{name}.returncode").write_text(str(status))
        (out_dir / f"{name}.seconds").write_text(f"{seconds:.1f} wall, {cpu:.1f} CPU")
        summary = f"exit {status}, {seconds:.1f} s ({cpu:.1f} CPU-s)"
        print(f"benchmarks/{name} --smoke: {summary}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
