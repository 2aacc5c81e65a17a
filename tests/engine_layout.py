"""Where the suite's engines run: in the test's own process, or in the user's layout.

**In-process (the suite's default).** tests/conftest.py sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for the pytest process and, through the environment,
for its children (examples, notebook kernels, servers, CLI runs): an offline ``LLM`` builds
its engine core and worker inside the process that made it, a few seconds a start instead of
two process spawns and two vLLM imports (about 20 CPU-seconds each here). An ``AsyncLLM``
(and so a server) always runs its engine core in a process of its own; in-process mode keeps
its worker inside that engine core.

**The user's layout (the topology set).** vLLM's defaults: the engine core and its workers
in processes of their own. Only the tests of the ``topology`` marker build engines this way
(:func:`users_layout` around an engine built here, :data:`USERS_LAYOUT_ENV` for a child);
tests/conftest.py fails any other test that does. tests/README.md lists the set and what
each of its tests proves that an in-process engine cannot.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
USERS_LAYOUT_ENV = {MULTIPROCESSING_ENV: "1"}
"""Environment entries for a child process whose engines run in the user's layout."""
IN_PROCESS_ENV = {MULTIPROCESSING_ENV: "0"}
"""Environment entries for a child started beside the tests (the background ones): it must
not inherit :func:`users_layout`'s setting from a topology test running meanwhile."""


def in_process_by_default() -> None:
    """Engines built in this process and its children run in-process from now on.

    What an in-process ``EngineCore`` does to the process that hosts it is undone where that
    process goes on to build other engines: vLLM caches every ``vllm.envs`` value once an
    engine core is up (later engines, and :func:`users_layout`, would read the first
    engine's environment); it freezes the garbage collector's heap (everything alive then
    would never be collected, and the session's pending-task check collects); and its
    shutdown tears down the process's parallel groups (:func:`_share_parallel_groups`).
    Model classes are inspected in-process (:func:`inspect_models_in_process`)."""
    import vllm.v1.engine.core as core

    os.environ[MULTIPROCESSING_ENV] = "0"
    core.enable_envs_cache = lambda: None
    core.freeze_gc_heap = lambda: None
    _share_parallel_groups(core)
    inspect_models_in_process()


def _share_parallel_groups(core: Any) -> None:
    """An engine core's shutdown tears down vLLM's distributed state (the process-wide
    world and parallel groups) for its process. In-process, other engines may still be
    running on that state (the session's shared engines live side by side): it is torn down
    when the last live engine core of the process shuts down. A new engine reuses groups
    already up (vLLM checks that their sizes agree)."""
    live: weakref.WeakSet = weakref.WeakSet()
    init, shutdown = core.EngineCore.__init__, core.EngineCore.shutdown
    cleanup = core.cleanup_dist_env_and_memory

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        live.add(self)
        init(self, *args, **kwargs)

    def counted_shutdown(self: Any) -> None:
        live.discard(self)
        shutdown(self)

    def cleanup_after_the_last(*args: Any, **kwargs: Any) -> None:
        if not live:
            cleanup(*args, **kwargs)

    core.EngineCore.__init__ = counted_init
    core.EngineCore.shutdown = counted_shutdown
    core.cleanup_dist_env_and_memory = cleanup_after_the_last


def inspect_models_in_process() -> None:
    """vLLM inspects a model class it has not inspected before (its cache is
    ~/.cache/vllm/modelinfos) in a new Python process, to keep CUDA uninitialised in the
    front end: a vLLM import per class, 19 of them in a run on a fresh machine. On this CPU
    machine, in a process that hosts its engines anyway, the inspection runs in-process
    (what it computes is the same; only where differs)."""
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda inspect: inspect()


CHILD_ARCHITECTURES = ("LlamaForCausalLM", "ProbehookTinySegmenter", "BertModel")
"""The architectures the examples and notebooks run (the bundled tiny model, the segmenter,
MiniLM): :func:`inspect_for_children` inspects them before those children start."""


def inspect_for_children() -> None:
    """Fill vLLM's model-info cache for :data:`CHILD_ARCHITECTURES`, so that the examples and
    notebook kernels (users' processes, left as they are) find it warm, as they would on a
    user's machine after the first run, instead of each starting an inspecting process."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the segmenter is registered by probehook's models plugin
    for architecture in CHILD_ARCHITECTURES:
        ModelRegistry.models[architecture].inspect_model_cls()


def in_users_layout() -> bool:
    """Whether an engine built now would run in the user's layout."""
    return os.environ.get(MULTIPROCESSING_ENV, "1") != "0"


@contextlib.contextmanager
def users_layout() -> Iterator[None]:
    """Engines built inside run in the user's layout (a topology test's engine)."""
    previous = os.environ.get(MULTIPROCESSING_ENV)
    os.environ[MULTIPROCESSING_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(MULTIPROCESSING_ENV, None)
        else:
            os.environ[MULTIPROCESSING_ENV] = previous
