"""Bad input fails at construction, before vLLM starts, naming the valid choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from probehook.errors import CaptureConfigError, StoreFormatError, UnsupportedModelError


@pytest.fixture(scope="module")
def llm_cls():
    from probehook import LLM

    return LLM


def test_layer_out_of_range(llm_cls, llama_dir: Path) -> None:
    with pytest.raises(CaptureConfigError, match=r"layer 4 is out of range.*0\.\.3"):
        llm_cls(str(llama_dir), layers=[4])


def test_no_phase_selected(llm_cls, llama_dir: Path) -> None:
    with pytest.raises(CaptureConfigError, match="include_prefill and include_decode"):
        llm_cls(str(llama_dir), layers=[0], include_prefill=False, include_decode=False)


def test_capture_options_without_layers(llm_cls, llama_dir: Path) -> None:
    with pytest.raises(CaptureConfigError, match="layers=None"):
        llm_cls(str(llama_dir), include_prefill=True)


def test_unsupported_architecture_lists_supported(llm_cls, tmp_path: Path) -> None:
    config = {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "num_hidden_layers": 2,
        "hidden_size": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        llm_cls(str(tmp_path), layers=[0])
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM"):
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"speculative_config": {"method": "ngram"}}, "speculative_config"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"worker_extension_cls": "my.Ext"}, "worker_extension_cls"),
        ({"load_format": "probehook"}, "load_format"),
    ],
)
def test_incompatible_engine_arguments(llm_cls, llama_dir: Path, kwargs, match) -> None:
    with pytest.raises(CaptureConfigError, match=match):
        llm_cls(str(llama_dir), layers=[0], **kwargs)


def test_compile_cache_key_depends_on_taps(llama_dir: Path) -> None:
    """vLLM hashes additional_config into its compile-cache key, and the taps live there."""
    from vllm.engine.arg_utils import EngineArgs

    from probehook.capture_config import CaptureConfig
    from probehook.engine_args import capture_engine_kwargs

    def config_hash(kwargs: dict) -> str:
        args = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128, **kwargs)
        return args.create_engine_config().compute_hash()

    plain = config_hash({})
    one = config_hash(capture_engine_kwargs({}, CaptureConfig(layers=(1,))))
    two = config_hash(capture_engine_kwargs({}, CaptureConfig(layers=(1, 2))))
    assert len({plain, one, two}) == 3


def test_bad_store_path_fails_before_engine_start(llm_cls, llama_dir: Path, tmp_path: Path):
    (tmp_path / "junk.txt").write_text("not a store")
    with pytest.raises(StoreFormatError, match="not an activation store"):
        llm_cls(str(llama_dir), layers=[0], store=tmp_path)
    with pytest.raises(CaptureConfigError, match="needs something to store"):
        llm_cls(str(llama_dir), store=tmp_path / "new")
