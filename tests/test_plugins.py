"""probehook's entry points: a plain vLLM in the same environment stays plain, and the bundled
models plug in only through the entry points a third party's package would use (issue 22).

- ``vllm.general_plugins``: ``probehook`` (the model loader; inert unless probehook builds the
  engine) and ``probehook_models`` (the tiny segmenter's model class, by name);
- ``probehook.output_processors``: ``segmentation_image``.

Run as a script, this file is the plain-vLLM subprocess: ``python test_plugins.py MODEL``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _probehook_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "probehook" or m.startswith("probehook."))


def _plain_vllm(model: str) -> None:
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
    # What probehook's engine setup does around a capture engine's start
    # (engine_config.capture_engine_start)
    from probehook.adapter import plugin

    with plugin.active():
        report["active_env"] = os.environ.get(plugin.ACTIVE_ENV)
        report["active_registers"] = "probehook" in _LOAD_FORMAT_TO_MODEL_LOADER
    report["restored"] = plugin.ACTIVE_ENV not in os.environ
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    _plain_vllm(sys.argv[1])
    sys.exit(0)


def _entry_point_modules() -> set[str]:
    """probehook's modules named by its vLLM general plugins, with their parent packages."""
    names = set()
    for entry in entry_points(group="vllm.general_plugins"):
        module = entry.value.partition(":")[0]
        if module.split(".")[0] == "probehook":
            parts = module.split(".")
            names |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    return names


def _run(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _clean_env() -> dict[str, str]:
    from probehook.adapter.plugin import ACTIVE_ENV

    env = {k: v for k, v in os.environ.items() if k != ACTIVE_ENV}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in the one process
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def test_entry_points_are_declared() -> None:
    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert general["probehook"] == "probehook.adapter.plugin:register"
    assert general["probehook_models"] == "probehook.models.plugin:register"
    processors = {e.name: e.value for e in entry_points(group="probehook.output_processors")}
    assert processors["segmentation_image"] == (
        "probehook.models.segmenter.processor:SegmentationImage"
    )


def test_entry_point_modules_import_nothing_else() -> None:
    """vLLM imports them in every process: they, their packages and the light ``probehook``
    facade only (no torch-heavy module of probehook's)."""
    code = (
        "import json, sys\n"
        "import probehook.adapter.plugin, probehook.models.plugin\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'probehook')))\n"
    )
    loaded = set(json.loads(_run(code, _clean_env())))
    facade = {"probehook._version", "probehook.errors"}  # what ``import probehook`` runs
    assert loaded - facade == _entry_point_modules()


def test_output_processor_arrives_by_entry_point() -> None:
    """``probehook.outputs`` registers no bundled model's processor itself; the registry loads
    ``segmentation_image`` from the entry point on first lookup."""
    code = (
        "import sys\n"
        "from probehook.outputs import OUTPUT_PROCESSORS\n"
        "assert not any(m.startswith('probehook.models.segmenter') for m in sys.modules)\n"
        "processor = OUTPUT_PROCESSORS['segmentation_image']\n"
        "print(type(processor).__module__)\n"
    )
    assert _run(code).strip() == "probehook.models.segmenter.processor"


@pytest.mark.engine
def test_plain_vllm_engine_stays_plain() -> None:
    """A plain vLLM engine on the bundled tiny model, everything in one process: vLLM ran
    probehook's general plugins there, and they imported nothing of probehook's beyond the
    entry-point modules and registered no load format; the segmenter is known by name only."""
    from probehook.models import tiny_model_path

    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_model_path())],
        env=_clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report["text"], report
    allowed = _entry_point_modules() | {"probehook._version", "probehook.errors"}
    assert set(report["modules"]) <= allowed, sorted(set(report["modules"]) - allowed)
    assert "probehook" not in report["load_formats"]
    assert report["archs"] == ["ProbehookTinySegmenter"]  # the models plugin ran, lazily
    # ... and probehook's own engine setup does activate the loader, for its block only
    assert report["active_env"] == "1" and report["active_registers"], report
    assert report["restored"], report
