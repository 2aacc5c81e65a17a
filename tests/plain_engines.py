"""The plain engines of the suite, one after another in ONE subprocess.

A plain engine is one probehook captures nothing from: vLLM's own ``vllm.LLM`` in an
environment where probehook is installed (tests/test_plugins.py: probehook stays inert), and
``probehook.LLM`` without capture, on a generating model (tests/test_capture_options.py) and on
the one-pass segmenter (tests/test_segmentation.py): vLLM's engine, with probehook's output
attributes present and empty. What these tests check happens in the user's process, so the
subprocess runs each engine core inside it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a few
seconds a start, where an engine in its own processes costs two process spawns and two vLLM
imports (about a minute on two cores). The plain ``vllm.LLM`` is the exception: it runs first,
in the user's layout (the topology set), so that probehook's plugin is loaded in fresh engine
processes.

The subprocess prints one JSON report; :func:`run` returns it and tests/conftest.py shares it
(the ``plain_engines`` fixture). Run as a script, this file is that subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_layout import IN_PROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]
SEGMENTER_IMAGE = (8, 16, 6)
"""Height, width and seed of the image the plain segmenter masks (see :func:`image`)."""


def image(height: int, width: int, seed: int = 0, channels: int = 3) -> Any:
    """A random RGB image, uint8 (tests/test_segmentation.py makes its images with it)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.random((height, width, channels)) * 255).astype(np.uint8)


def _probehook_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "probehook" or m.startswith("probehook."))


def _plain_vllm(model: str) -> dict[str, Any]:
    """A plain ``vllm.LLM`` (no probehook call anywhere), then what it left in this process."""
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    llm = LLM(model, enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0)
    (out,) = llm.generate(["12+34="], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    report = {
        "text": out.outputs[0].text,
        "modules": _probehook_modules(),
        "load_formats": sorted(_LOAD_FORMAT_TO_MODEL_LOADER),
        "archs": sorted(a for a in ModelRegistry.get_supported_archs() if "Probehook" in a),
    }
    llm.llm_engine.engine_core.shutdown(timeout=1.0)  # not vLLM's 5 s grace: it is idle
    # What probehook's engine setup does around a capture engine's start
    # (engine_config.capture_engine_start)
    from probehook.adapter import plugin

    with plugin.active():
        report["active_env"] = os.environ.get(plugin.ACTIVE_ENV)
        # In the user's layout the model loads in the engine's own processes: the user's
        # process neither registers the loader nor imports the worker's code.
        report["active_registers_here"] = "probehook" in _LOAD_FORMAT_TO_MODEL_LOADER
        report["worker_code_here"] = [m for m in _probehook_modules() if ".worker" in m]
    report["restored"] = plugin.ACTIVE_ENV not in os.environ
    return report


def _activate_in_process() -> bool:
    """Whether probehook's engine setup registers the loader in this process when the engine
    core runs here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which this subprocess sets)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    from probehook.adapter import plugin

    with plugin.active():
        return "probehook" in _LOAD_FORMAT_TO_MODEL_LOADER


def _plain_probehook_llm(model: str) -> dict[str, Any]:
    """``probehook.LLM`` with ``layers=None``: what its generated output carries."""
    from probehook import LLM, SamplingParams

    llm = LLM(model, enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0)
    try:
        out = llm.generate(["1+1="], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        return {
            "session": llm.session is not None,
            "tokens": len(out.outputs[0].token_ids),
            "hidden_states": repr(out.hidden_states),
            "prefill_hidden_states": repr(out.prefill_hidden_states),
            "completion_hidden_states": repr(out.outputs[0].hidden_states),
        }
    finally:
        llm.shutdown()


def _plain_segmenter() -> dict[str, Any]:
    """``probehook.LLM`` without capture on the segmenter: its mask of :data:`SEGMENTER_IMAGE`
    and what its patch outputs carry."""
    from probehook import LLM
    from probehook.models.segmenter import ENGINE_KWARGS, segmenter_path

    pixels = image(*SEGMENTER_IMAGE)
    with LLM(str(segmenter_path()), gpu_memory_utilization=0.1, **ENGINE_KWARGS) as llm:
        (out,) = llm.encode({"data": {"image": pixels}}, pooling_task="plugin", use_tqdm=False)
        result = out.outputs
        return {
            "session": llm.session is not None,
            "mask": result.mask.tolist(),
            "patches": len(result.patches),
            "patch_captures": [
                [repr(p.hidden_states), repr(p.probe_scores), p.store_id] for p in result.patches
            ],
        }


def clean_env() -> dict[str, str]:
    """This process's environment for a child whose engines run in it, with probehook's
    loader switch unset (as in a user's process)."""
    from probehook.adapter.plugin import ACTIVE_ENV

    env = {k: v for k, v in os.environ.items() if k != ACTIVE_ENV}
    env.update(IN_PROCESS_ENV)  # engine core and worker in the one process
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def run(timeout: float = 600) -> dict[str, Any]:
    """Run this file as the subprocess; its report, by engine."""
    from probehook.models import tiny_model_path

    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_model_path())],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


if __name__ == "__main__":
    tiny = sys.argv[1]  # from the parent: this process imports nothing of probehook's yet
    # First, while nothing of probehook's is loaded here, and in the user's layout (the
    # topology set, tests/README.md): probehook's plugin loads in the spawned engine core and
    # worker, as in a user's plain vLLM, and must leave them plain.
    from engine_layout import inspect_models_in_process, users_layout  # nothing of probehook's

    with users_layout():  # the rest in-process (clean_env)
        report = {"vllm": _plain_vllm(tiny)}
    inspect_models_in_process()
    report["vllm"]["active_registers_in_process"] = _activate_in_process()
    report["probehook_llm"] = _plain_probehook_llm(tiny)
    report["segmenter"] = _plain_segmenter()
    print("REPORT " + json.dumps(report), flush=True)
