"""Keeping vLLM's start-up noise out of a script's output.

vLLM and its subprocesses print warnings and loading bars around a short result: Triton's CPU
notice (logged before vLLM configures its logging, so ``VLLM_LOGGING_LEVEL`` misses it), a
``FutureWarning`` from torch with its source lines, PyTorch's C++ NUMA-binding notice and the
checkpoint-loading bar. :func:`quiet_vllm` silences them in this process and in the engine
processes vLLM spawns, and leaves errors alone. The examples and ``make demo`` call it unless
run with ``-v``.

Call it at the top of a script, outside ``if __name__ == "__main__":``: vLLM's processes start
with the spawn method, which runs the main module's top level before vLLM's own imports, so
the call applies there too.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

QUIET_ENV = {
    # vLLM's log level once it configures logging, here and in its processes.
    "VLLM_LOGGING_LEVEL": "ERROR",
    # PyTorch's C++ warnings (the NUMA binding notice of vLLM's CPU worker).
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}
QUIET_ENGINE_ARGS = {"use_tqdm_on_load": False}
"""Engine arguments of a quiet engine: no checkpoint-loading bar."""


def quiet_vllm(verbose: bool | None = None) -> dict[str, object]:
    """Silence vLLM's warnings and loading bars; return the engine arguments to pass too.

    Args:
        verbose: leave everything as it is (None: whether ``-v`` is among ``sys.argv``).

    Returns:
        Keyword arguments for ``LLM``/``AsyncLLM`` (empty when verbose): merge them into the
        engine's arguments, ``LLM(model, **quiet_vllm(), ...)``.
    """
    if verbose is None:
        verbose = "-v" in sys.argv[1:]
    if verbose:
        return {}
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    # Before vLLM configures its logger, its warnings reach the root logger's last resort.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    return dict(QUIET_ENGINE_ARGS)
