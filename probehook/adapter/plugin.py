"""Entry point ``probehook`` in vLLM's ``vllm.general_plugins`` group; vLLM calls it in every
process (front end, engine core, workers) of every engine, probehook's or not.

It is inert unless probehook builds the engine: installing probehook must not change a plain
``vllm serve`` or ``vllm.LLM``. probehook's engine setup
(``engine_config.capture_engine_start``, the block in which a capture engine starts) calls
:func:`active`, which sets :data:`ACTIVE_ENV` while the engine's processes start (they inherit
it at spawn) and, when the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
where vLLM has run its plugins already), registers the loader here too; otherwise the user's
process never loads the worker's code. Only then does
:func:`register` register the ``probehook`` load format; otherwise it imports nothing.

The workers of a probehook engine also register the loader when vLLM imports probehook's
worker extension class (``adapter/worker/rpc.py``), which needs no inherited variable: vLLM's Ray
executor passes its workers only ``VLLM_`` variables.

The bundled models register through their own entry point (``probehook_models``,
:mod:`probehook.models.plugin`), as a third party's would.

This module imports nothing of probehook's: vLLM imports it in every process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ACTIVE_ENV = "PROBEHOOK_ENGINE"
"""Set to "1" in the processes of an engine probehook builds: the plugin registers its loader."""
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch: "0" runs ``LLM``'s engine core (and a single worker) in the user's process."""


def register() -> None:
    """vLLM's call: register probehook's model loader in a probehook engine's process only."""
    if os.environ.get(ACTIVE_ENV) != "1":
        return
    from probehook.adapter.worker.loader import register_loader

    register_loader()


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Start an engine inside this block to make its processes load probehook's plugin; the
    process's own setting is restored afterwards (a plain engine started later is plain)."""
    before = os.environ.get(ACTIVE_ENV)
    os.environ[ACTIVE_ENV] = "1"
    try:
        if os.environ.get(IN_PROCESS_ENV, "1") == "0":
            register()  # the model loads here: the worker's loader and ops are needed here
        yield
    finally:
        if before is None:
            os.environ.pop(ACTIVE_ENV, None)
        else:
            os.environ[ACTIVE_ENV] = before
