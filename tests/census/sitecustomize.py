"""The suite's census: which processes import vLLM and where engines start.

tests/conftest.py puts this folder on ``PYTHONPATH`` with ``PROBEHOOK_CENSUS_DIR`` set, so
every Python child of the test run (engine cores, workers, examples, notebook kernels,
servers, CLI runs, Ray workers) imports this file at start-up. It does nothing else until
the process imports ``vllm``; then it appends one line to ``<dir>/<pid>.jsonl``, and one more
each time the process builds a vLLM ``EngineCore`` (every engine has exactly one, in its own
process or in-process). Lines are written at once: engine processes often end by SIGKILL.

Without ``PROBEHOOK_CENSUS_DIR`` it is inert. Outside the tests nothing imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

CENSUS_ENV = "PROBEHOOK_CENSUS_DIR"


def record(event: str) -> None:
    """Append ``event`` for this process (one JSON line, written and closed at once)."""
    directory = os.environ.get(CENSUS_ENV)
    if not directory:
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        command = " ".join(sys.argv)[:200]
    line = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "event": event,
        "t": time.time(),
        "command": command,
    }
    try:
        with open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass  # a census must never break the process it counts


def count_engine_cores(core_module) -> None:  # noqa: ANN001
    """Record an event each time ``core_module.EngineCore`` (vllm.v1.engine.core) is built."""
    init = core_module.EngineCore.__init__

    def counted_init(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        record("engine core")
        init(self, *args, **kwargs)

    core_module.EngineCore.__init__ = counted_init


class _Watch(importlib.abc.MetaPathFinder):
    """Notes the first import of ``vllm`` and wraps ``EngineCore.__init__`` when
    ``vllm.v1.engine.core`` is loaded."""

    def __init__(self) -> None:
        self.seen_vllm = False

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name == "vllm" and not self.seen_vllm:
            self.seen_vllm = True
            record("import vllm")
        if name != "vllm.v1.engine.core":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):  # noqa: ANN001, ANN202
            exec_module(module)
            count_engine_cores(module)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


if os.environ.get(CENSUS_ENV):
    sys.meta_path.insert(0, _Watch())
