"""Shared fixtures, the test tiers and the guard that keeps them honest.

Tiers:

- ``make test-fast`` (``pytest -m "not engine and not slow"``): the unit tests, no vLLM
  engine, about a minute on two cores (``slow``: the few unit tests over 10 s).
- ``make test`` (what CI runs): lint and every test, engines included.

A test that starts a vLLM engine (``LLM``, ``AsyncLLM``, a ``probehook serve`` process, an
example or child process that builds one) carries ``@pytest.mark.engine`` (or a module-level
``pytestmark``). The guard below fails an unmarked test that starts one in this process or
through ``ServerProcess``; engines started by other child processes are marked by hand.

The session also fails when an asyncio task is destroyed while pending (a test closed its
event loop over a live task, whose finaliser would otherwise run inside a later test).

Reference engines shared by several modules are session-scoped here, one per configuration
(a compiled start-up costs about a minute); modules keep their own engine only when its
configuration is theirs alone. The plain engines (probehook captures nothing; what their tests
check happens in the user's process) run one after another in one subprocess with the engine
core inside it, a few seconds a start (``plain_engines``, tests/plain_engines.py).

Where engines run (tests/engine_layout.py, tests/README.md): in-process, in the pytest process
or in the child that builds them, except in the ``topology`` set, which keeps the user's
layout (engine core and workers in their own processes) and proves what crosses those
boundaries. The guard below fails a test outside the set that builds an engine in the user's
layout. A new capability adds its engine tests to the shared in-process engines unless it
tests the topology.

The budget: every Python process of the run that imports vLLM is counted
(tests/census/sitecustomize.py, through ``PYTHONPATH``), and so is every engine start; the
summary prints both, and a full run fails over :data:`VLLM_PROCESS_BUDGET`.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

# The CPU backend would otherwise size the KV cache from most of RAM and fail at start-up.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Many short-lived engines in one process: keep their logs readable.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

VLLM_PROCESS_BUDGET = 57
"""Processes that import vLLM in a full run (pytest and every child, engines' included);
a full run over it fails (docs/benchmarks.md keeps the suite's figures). 57: issue 52's
notebook 10 (patching), a kernel of its own, 1 more than 56: issue 51's
notebook 09 (attention), a kernel of its own, 1 more than 55 (measured in a full run): the
toy readout served by tests/test_server.py's server instead of a server of its
own, 2 fewer, and tests/test_store_engine.py's two engine children one process, 1 fewer, than
58: issue 44's
notebook 08 (lenses), a kernel of its own, 1 more (58 measured in a full run) than 57: issue 43's
one-option AsyncLLMs (an engine core each) and servers (a server and an engine core each),
6 more, the toy readout's AsyncLLM and server, 3 more (50 measured in a full run), and the
benchmarks' smoke run, 7 more (its host, 4 AsyncLLM/server engine cores, a server, a plain
vLLM server; measured alone), than the 41 of issue 38."""
_CENSUS_PATH = Path(__file__).parent / "census"


def _start_census() -> Any:
    """Children count themselves (their ``sitecustomize`` is tests/census's); this process is
    counted here. Returns the census module."""
    spec = importlib.util.spec_from_file_location("census", _CENSUS_PATH / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    census = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(census)
    os.environ[census.CENSUS_ENV] = tempfile.mkdtemp(prefix="probehook-census-")
    atexit.register(shutil.rmtree, os.environ[census.CENSUS_ENV], True)  # read by then
    paths = [str(_CENSUS_PATH), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    import vllm.v1.engine.core

    census.record("import vllm")
    census.count_engine_cores(vllm.v1.engine.core)
    return census


_census = _start_census()


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

from engine_layout import (  # noqa: E402
    MULTIPROCESSING_ENV,
    in_process_by_default,
    in_users_layout,
)

in_process_by_default()

_ENGINE_ALLOWED = False
"""True while an ``engine``-marked test is set up, run or torn down (see the guard below)."""
_TOPOLOGY_ALLOWED = False
"""True while a ``topology``-marked test is set up, run or torn down."""
_ENGINES_STARTED = [0]
"""Engines (and ``ServerProcess`` servers) this process started: the summary prints it."""


def _engine_guard() -> None:
    """Every vLLM engine, offline or async, makes its engine-core client through one of two
    factories, and every server in the tests is a ``ServerProcess``: wrapped here to fail the
    test when it lacks the ``engine`` marker, so the fast tier never starts an engine."""
    from vllm.v1.engine.core_client import EngineCoreClient

    from probehook.testing import ServerProcess

    def guarded(original, users_layout):  # noqa: ANN001, ANN202
        def start(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            _ENGINES_STARTED[0] += 1
            if not _ENGINE_ALLOWED:
                pytest.fail(
                    "this test starts a vLLM engine but is not marked @pytest.mark.engine "
                    "(tests/conftest.py: the fast tier runs no engine)",
                    pytrace=True,
                )
            if users_layout(*args, **kwargs) and not _TOPOLOGY_ALLOWED:
                pytest.fail(
                    "this test starts a vLLM engine in the user's layout (engine core and "
                    "workers in their own processes) but is not in the topology set: build it "
                    "in-process, or mark the test @pytest.mark.topology and say in "
                    "tests/README.md what it proves that an in-process engine cannot",
                    pytrace=True,
                )
            return original(*args, **kwargs)

        return start

    def offline(*args, **kwargs) -> bool:  # noqa: ANN002, ANN003
        return kwargs.get("multiprocess_mode", args[0] if args else False)

    def asynchronous(*args, **kwargs) -> bool:  # noqa: ANN002, ANN003
        return in_users_layout()  # its engine core has its own process in either layout

    def server(self, argv, log, env=None, program="probehook") -> bool:  # noqa: ANN001
        return (env or {}).get(MULTIPROCESSING_ENV, "0") != "0"

    EngineCoreClient.make_client = staticmethod(guarded(EngineCoreClient.make_client, offline))
    EngineCoreClient.make_async_mp_client = staticmethod(
        guarded(EngineCoreClient.make_async_mp_client, asynchronous)
    )
    ServerProcess.__init__ = guarded(ServerProcess.__init__, server)


_engine_guard()


class _PendingTaskWatch(logging.Filter):
    """Counts asyncio tasks destroyed while still pending: a test that closed its event loop
    over a live task (an AsyncLLM's output handler, say). Its finaliser runs at whatever
    garbage collection comes next, inside another test (it once broke an import there)."""

    destroyed: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "Task was destroyed but it is pending" in record.getMessage():
            self.destroyed.append(record.getMessage().splitlines()[-1][:300])
        return True


logging.getLogger("asyncio").addFilter(_PendingTaskWatch())


def census() -> dict[str, Any]:
    """The run so far: processes that imported vLLM (by kind) and engine starts."""
    processes: dict[int, dict[str, Any]] = {}
    for path in Path(os.environ[_census.CENSUS_ENV]).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            seen = processes.setdefault(event["pid"], {"engines": 0, "command": ""})
            if event["event"] == "import vllm":
                seen["command"] = event["command"]
            else:
                seen["engines"] += 1
    kinds: dict[str, list[int]] = {}
    for pid, seen in processes.items():
        counts = kinds.setdefault(_process_kind(pid, seen["command"], seen["engines"]), [0, 0])
        counts[0] += 1
        counts[1] += seen["engines"]
    return {
        "vllm_processes": len(processes),
        "engine_starts": sum(p["engines"] for p in processes.values()),
        "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1][0])),
    }


def _process_kind(pid: int, command: str, engines: int) -> str:
    if pid == os.getpid():
        return "pytest"
    if "spawn_main" in command:
        return "engine core" if engines else "worker"
    if "ipykernel" in command:
        return "notebook kernel"
    if command.startswith("ray::"):
        return "Ray actor"
    if " serve " in command:
        return "server"
    if " capture " in command:
        return "probehook capture"
    scripts = [Path(word).name for word in command.split() if word.endswith(".py")]
    return scripts[0] if scripts else command[:40]


def _full_run(session: pytest.Session) -> bool:
    config = session.config
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and not config.option.markexpr
        and session.testscollected > 0
        and session.testsfailed == 0
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.collect()  # the finalisers of loops the tests dropped run now, not at exit
    if _PendingTaskWatch.destroyed and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _full_run(session):
        counted = census()["vllm_processes"]
        if counted > VLLM_PROCESS_BUDGET:
            _OVER_BUDGET.append(counted)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


_OVER_BUDGET: list[int] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counted = census()
    terminalreporter.write_line(
        f"vLLM in this run: {counted['vllm_processes']} processes imported it (budget "
        f"{VLLM_PROCESS_BUDGET}), {counted['engine_starts']} engines started "
        f"({_ENGINES_STARTED[0]} engines and servers by pytest's own process)"
    )
    terminalreporter.write_line(
        "  processes (engines started in them): "
        + ", ".join(f"{kind} {n} ({e})" for kind, (n, e) in counted["by_kind"].items())
    )
    for over in _OVER_BUDGET:
        terminalreporter.write_line(
            f"FAILED: {over} processes imported vLLM, over the suite's budget of "
            f"{VLLM_PROCESS_BUDGET} (tests/conftest.py): run new engine tests on the shared "
            "in-process engines (tests/engine_layout.py)",
            red=True,
        )
    for task in _PendingTaskWatch.destroyed:
        terminalreporter.write_line(
            f"FAILED: an asyncio task was destroyed while pending (a test closed its event "
            f"loop over it; end the loop as asyncio.run does): {task}",
            red=True,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    """Engines may start only inside an ``engine``-marked test (its fixtures included)."""
    global _ENGINE_ALLOWED, _TOPOLOGY_ALLOWED
    _ENGINE_ALLOWED = item.get_closest_marker("engine") is not None
    _TOPOLOGY_ALLOWED = item.get_closest_marker("topology") is not None
    try:
        yield
    finally:
        _ENGINE_ALLOWED = _TOPOLOGY_ALLOWED = False


ENGINE_DEFAULTS = dict(dtype="float32", max_model_len=256, gpu_memory_utilization=0.1, seed=0)


BACKGROUND_MODULES = ("test_benchmarks_smoke", "test_notebooks_and_examples", "test_architectures")
"""Modules whose engines run in subprocesses started at the session's first test, in this
order, beside the rest of the suite (:func:`background`). Each defines
``start_in_background(pool, items, tmp_path_factory)``; its tests run last, after the rest,
and wait for what it started."""
BACKGROUND_PROCESSES = 2
"""Background subprocesses at a time. The suite's own engine tests left about a quarter of
the two cores idle (spawns, handshakes, shutdowns, waits; 77% busy on average), and the
notebooks, examples and architecture engines, run apart after the rest, took about eight
minutes of its 22. Beside the rest, on a fresh clone: pytest 1414 s -> 1145 s. The benchmarks'
smoke run (about five minutes alone) joined them first, as the longest."""
LATE_MODULES = ("test_collect",)
"""Modules that run after the rest, when the background subprocesses are likely done: the
collection test starts a Ray cluster with two replicas of its own, and beside two background
subprocesses it took 287 s instead of 112 s."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def position(item: pytest.Item) -> int:
        name = item.module.__name__  # type: ignore[attr-defined]
        if name in BACKGROUND_MODULES:
            return BACKGROUND_MODULES.index(name) + 2
        return 1 if name in LATE_MODULES else 0

    items.sort(key=position)  # stable: the order within each group is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """What each of :data:`BACKGROUND_MODULES` started, by module name (started at the
    session's first test; a module none of whose engine tests is selected starts nothing)."""
    items = request.session.items
    modules = {item.module.__name__: item.module for item in items}  # type: ignore[attr-defined]
    if any(
        i.module.__name__ in BACKGROUND_MODULES and i.get_closest_marker("engine") for i in items
    ):  # type: ignore[attr-defined]
        from engine_layout import inspect_for_children

        inspect_for_children()
    pool = ThreadPoolExecutor(BACKGROUND_PROCESSES, thread_name_prefix="background")
    started = {
        name: modules[name].start_in_background(pool, items, tmp_path_factory)
        for name in BACKGROUND_MODULES
        if name in modules
    }
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def entry_point_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution that declares the toy readouts' and the toy intervention's entry points
    (tests/toy_readout.py, tests/toy_intervention.py), as a package of one would in its
    pyproject."""
    root = tmp_path_factory.mktemp("entry_point")
    info = root / "toy_readout-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-readout\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[probehook.output_processors]\nrow_norms = toy_readout:RowNorm\n"
        "chunk_peaks = toy_readout:ChunkPeaks\nrow_scale = toy_intervention:RowScale\n"
    )
    return root


@pytest.fixture(scope="session")
def entry_point_path(entry_point_root: Path) -> str:
    """PYTHONPATH for a server's processes: tests/ (the toy readout's module) and the
    distribution that declares its entry point."""
    here = str(Path(__file__).parent)
    return os.pathsep.join([here, str(entry_point_root), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="session")
def engine_defaults() -> dict:
    return dict(ENGINE_DEFAULTS)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)


@pytest.fixture(scope="session")
def llama_lenses(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The lenses ``compiled_llm`` reads: the logit lens, a random J-lens file and a random
    tuned-lens folder for ``llama_dir``'s shape (``helpers.write_random_lenses``)."""
    from helpers import write_random_lenses

    files = write_random_lenses(tmp_path_factory.mktemp("lenses"), 128, 4)
    return {"logit": "logit", **files}


@pytest.fixture(scope="session")
def compiled_llm(llama_dir: Path, llama_lenses: dict[str, str]) -> Iterator[object]:
    """vLLM's default compiled mode, under pressure: small prefill chunks, a KV cache small
    enough to force preemption, prefix caching on; rows of every layer, probes, three
    lenses on two layers and attention per head of two layers (top 4)."""
    from helpers import ATTENTION_LAYERS, COMPILED_LENS_LAYERS, random_probes

    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        layers="all",
        include_prefill=True,
        probes=random_probes(128),
        lenses=llama_lenses,
        lens_layers=COMPILED_LENS_LAYERS,
        lens_top_k=4,
        attention_layers=ATTENTION_LAYERS,
        attention_top_k=4,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        num_gpu_blocks_override=12,
        block_size=32,
        disable_log_stats=False,
        **ENGINE_DEFAULTS,
    )
    yield _shared("compiled_llm", llm)
    _release("compiled_llm")


@pytest.fixture(scope="session")
def eager_llm(llama_dir: Path) -> Iterator[object]:
    from probehook import LLM

    llm = LLM(
        str(llama_dir), layers=[0, 2], include_prefill=True, enforce_eager=True, **ENGINE_DEFAULTS
    )
    yield _shared("eager_llm", llm)
    _release("eager_llm")


@pytest.fixture(scope="session")
def reference_llm(llama_dir: Path) -> Iterator[object]:
    """The offline reference of the AsyncLLM and server tests (one engine for both modules):
    layers 0 and 3 with prompt rows, eager, ``random_probes(128)`` and the steering vector
    ``reference_steering()`` named "up" (the server's own --probe and --steer files)."""
    from helpers import random_probes, reference_steering

    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        layers=[0, 3],
        include_prefill=True,
        enforce_eager=True,
        probes=random_probes(128),
        steering={"up": reference_steering()},
        **ENGINE_DEFAULTS,
    )
    yield _shared("reference_llm", llm)
    _release("reference_llm")


@pytest.fixture(scope="session")
def plain_engines() -> dict[str, Any]:
    """The report of the suite's plain engines (vLLM's, and probehook's without capture), run
    together in one subprocess (tests/plain_engines.py)."""
    from plain_engines import run

    return run()


# -- shared engines are shut down once no test still to run needs them ----------------------

_SHARED: dict[str, object] = {}
"""Live shared engines, by fixture name."""
_LAST_USE: dict[str, int] = {}
_POSITION: dict[str, int] = {}


def _shared(name: str, llm: object) -> object:
    _SHARED[name] = llm
    return llm


def _release(name: str) -> None:
    llm = _SHARED.pop(name, None)
    if llm is not None:
        llm.shutdown()  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    """A session-scoped engine stays up until the last test that uses it (directly or through
    a fixture) has run, not to the end of the session: fewer engines share the machine."""
    yield
    if not _SHARED:
        return
    if not _POSITION:
        for i, each in enumerate(item.session.items):
            _POSITION[each.nodeid] = i
            for name in each.fixturenames:  # type: ignore[attr-defined]
                _LAST_USE[name] = i
    here = _POSITION.get(item.nodeid, -1)
    for name in list(_SHARED):
        if _LAST_USE.get(name, -1) <= here:
            _release(name)
