"""probehook's entry points: a plain vLLM in the same environment stays plain, and the bundled
models plug in only through the entry points a third party's package would use (issue 22).

- ``vllm.general_plugins``: ``probehook`` (the model loader; inert unless probehook builds the
  engine) and ``probehook_models`` (the tiny segmenter's model class, by name);
- ``probehook.output_processors``: ``segmentation_image``.

The plain vLLM engine runs in the suite's plain-engines subprocess (tests/plain_engines.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from plain_engines import clean_env

ROOT = Path(__file__).resolve().parents[1]


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
    loaded = set(json.loads(_run(code, clean_env())))
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
@pytest.mark.topology
def test_plain_vllm_engine_stays_plain(plain_engines: dict) -> None:
    """A plain vLLM engine on the bundled tiny model, in the user's layout (the topology set):
    vLLM ran probehook's general plugins in its own process and in the engine core and worker
    it spawned, and they imported nothing of probehook's here beyond the entry-point modules,
    registered no load format and left the engine generating; the segmenter is known by name
    only."""
    report = plain_engines["vllm"]
    assert report["text"], report
    allowed = _entry_point_modules() | {"probehook._version", "probehook.errors"}
    assert set(report["modules"]) <= allowed, sorted(set(report["modules"]) - allowed)
    assert "probehook" not in report["load_formats"]
    assert report["archs"] == ["ProbehookTinySegmenter"]  # the models plugin ran, lazily
    # ... and probehook's own engine setup does activate the loader, for its block only: in
    # the engine's processes (the environment they inherit), and in this one only where the
    # engine core runs in it (issue 37, item 6: the worker's code stays out of the user's)
    assert report["active_env"] == "1", report
    assert not report["active_registers_here"] and report["worker_code_here"] == [], report
    assert report["active_registers_in_process"], report
    assert report["restored"], report
