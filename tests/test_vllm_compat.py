"""vLLM versions: the static compat checker (scripts/check_vllm_compat.py) on the installed
vLLM's sources, the untested-version warning, and the front end's view of the runner."""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compat() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_vllm_compat", REPO / "scripts" / "check_vllm_compat.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(compat: ModuleType) -> Path:
    return compat.installed_root()


def overlay(tmp_path: Path, site: Path, relative: str, old: str, new: str) -> Path:
    """A root holding one module of the installed vLLM, with ``old`` replaced by ``new``."""
    source = (site / relative).read_text()
    assert old in source, f"{old!r} not in {relative}: update this test"
    target = tmp_path / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source.replace(old, new))
    return tmp_path


def test_installed_vllm_has_everything_the_adapter_uses(compat: ModuleType, site: Path) -> None:
    uses = compat.probehook_imports()
    # parsed from probehook's source, not a hand-written list
    assert any(u.module == "vllm.v1.engine.async_llm" and u.name == "AsyncLLM" for u in uses)
    assert any(u.module == "vllm.envs" and u.name is None for u in uses)
    report = compat.check(compat.Sources([site]), uses)
    assert report.ok(), report.missing
    assert report.moved == []  # 0.32 holds every moved name at its old home
    assert any("absent  ServingTokenEmbedding (optional" in line for line in report.lines)


@pytest.mark.parametrize(
    ("relative", "old", "new", "missing"),
    [
        # an attribute runner_v1.py reads
        (
            "vllm/v1/worker/gpu_input_batch.py",
            "self.num_computed_tokens_cpu =",
            "self.renamed_computed_tokens =",
            "InputBatch.num_computed_tokens_cpu",
        ),
        # a name probehook imports
        (
            "vllm/entrypoints/openai/completion/serving.py",
            "class OpenAIServingCompletion(",
            "class RenamedServingCompletion(",
            "vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion",
        ),
        # a name of the moved-names table, gone from its only 0.32 home
        (
            "vllm/entrypoints/serve/utils/api_utils.py",
            "def cli_env_setup(",
            "def renamed_env_setup(",
            "cli_env_setup (looked in",
        ),
    ],
)
def test_a_name_removed_from_vllm_is_reported(
    compat: ModuleType, site: Path, tmp_path: Path, relative: str, old: str, new: str, missing: str
) -> None:
    root = overlay(tmp_path, site, relative, old, new)
    report = compat.check(compat.Sources([root, site]))
    assert not report.ok()
    assert any(missing in line for line in report.missing), report.missing


def test_a_moved_name_is_reported_where_it_went(
    compat: ModuleType, site: Path, tmp_path: Path
) -> None:
    """0.33's layout in miniature: cli_env_setup gone from api_utils, defined in
    vllm.entrypoints.common.startup."""
    root = overlay(
        tmp_path, site, "vllm/entrypoints/serve/utils/api_utils.py", "def cli_env_setup(", "def x("
    )
    startup = root / "vllm" / "entrypoints" / "common" / "startup.py"
    startup.parent.mkdir(parents=True, exist_ok=True)
    startup.write_text("def cli_env_setup():\n    pass\n")
    report = compat.check(compat.Sources([root, site]))
    assert report.ok(), report.missing
    assert report.moved == [
        "cli_env_setup: vllm.entrypoints.serve.utils.api_utils -> vllm.entrypoints.common.startup"
    ]


def test_untested_vllm_version_warns_once_at_construction(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    from probehook.adapter import vllm_names
    from probehook.adapter.frontend import engine_config

    monkeypatch.setattr(vllm_names, "_warned_version", None)
    monkeypatch.delenv(engine_config.RUNNER_ENV, raising=False)
    caplog.set_level(logging.WARNING, logger="probehook")
    for version in ("0.32.0", "0.33.2+cu130"):  # tested lines: silent
        monkeypatch.setattr(vllm, "__version__", version)
        with engine_config.capture_engine_start():
            pass
    assert not caplog.records
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    for _ in range(2):  # the construction path of every capturing LLM / AsyncLLM
        with engine_config.capture_engine_start():
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "tested with vLLM 0.32 and 0.33; this is vLLM 0.34.0" in warnings[0]
    assert "make compat VLLM=0.34.0" in warnings[0]


def test_pinned_config_keeps_the_v1_answer_and_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property vLLM's front end consults is live (it reads the variable on every call);
    a pinned config answers V1 whatever the process's variable says later."""
    from vllm.config import VllmConfig

    from probehook.adapter.frontend import engine_config

    config, plain = VllmConfig(), VllmConfig()
    engine_config.pin_v1_runner(config)
    monkeypatch.setenv(engine_config.RUNNER_ENV, "1")
    assert plain.use_v2_model_runner is True  # what an unpinned front end would believe
    assert config.use_v2_model_runner is False
    engine_config.pin_v1_runner(config)  # idempotent
    again = pickle.loads(pickle.dumps(config))
    assert type(again) is type(config) and again.use_v2_model_runner is False
    assert isinstance(config, VllmConfig)


@pytest.mark.engine
def test_capturing_llm_front_end_believes_v1_for_its_life(
    eager_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline engine's front end: V1, like its workers, while the process's variable is
    back to what the user had (unset) for other engines."""
    from probehook.adapter.frontend.engine_config import RUNNER_ENV

    config = eager_llm.llm_engine.vllm_config
    assert RUNNER_ENV not in os.environ  # restored after construction
    assert eager_llm.llm_engine.input_processor.vllm_config is config  # request-time checks
    monkeypatch.setenv(RUNNER_ENV, "1")  # on a GPU, Triton makes an unset variable mean V2
    assert config.use_v2_model_runner is False
