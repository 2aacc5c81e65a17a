"""Bad input fails at construction, before vLLM starts, naming the valid choices."""

from __future__ import annotations

import json
import os
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
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "Speculative decoding",
        ),
        # vLLM's shorthand arguments resolve to the same config and are refused the same way.
        ({"spec_method": "ngram", "spec_tokens": 2}, r"Speculative decoding \(method='ngram'\)"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"enable_prompt_embeds": True}, "enable_prompt_embeds"),
        ({"worker_extension_cls": "my.Ext"}, "worker_extension_cls"),
        ({"load_format": "probehook"}, "load_format"),
        ({"async_scheduling": True}, r"async_scheduling=True cannot be combined .* one more"),
    ],
)
def test_incompatible_engine_arguments(llm_cls, llama_dir: Path, kwargs, match) -> None:
    with pytest.raises(CaptureConfigError, match=match):
        llm_cls(str(llama_dir), layers=[0], **kwargs)


@pytest.mark.parametrize(
    ("value", "match"), [("1", "forces vLLM's Model Runner V2"), ("yes", "not 0 or 1")]
)
def test_forced_model_runner_v2_is_refused(
    llm_cls, llama_dir: Path, monkeypatch, value: str, match: str
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    with pytest.raises(CaptureConfigError, match=match):
        llm_cls(str(llama_dir), layers=[0])
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == value


def test_runner_setting_is_restored_when_construction_fails(llm_cls, llama_dir: Path) -> None:
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    with pytest.raises(CaptureConfigError, match="pipeline_parallel_size"):
        llm_cls(str(llama_dir), layers=[0], pipeline_parallel_size=2)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_unreadable_runner_is_a_clear_error() -> None:
    from probehook.adapter.worker.runner_v1 import check_runner

    class RunnerV2Like:
        req_states = None

    with pytest.raises(CaptureConfigError, match="RunnerV2Like.*input_batch.*V1"):
        check_runner(RunnerV2Like())


def test_bad_capture_memory_limit(llm_cls, llama_dir: Path) -> None:
    with pytest.raises(CaptureConfigError, match="max_request_capture_bytes=-1"):
        llm_cls(str(llama_dir), layers=[0], max_request_capture_bytes=-1)


def test_layer_count_comes_from_vllms_resolved_config(llm_cls, llama_dir: Path) -> None:
    """hf_overrides changes the depth vLLM builds, so it changes the valid layers too."""
    with pytest.raises(CaptureConfigError, match=r"out of range.*0\.\.1"):
        llm_cls(str(llama_dir), layers=[3], hf_overrides={"num_hidden_layers": 2})


def test_compile_cache_key_depends_on_taps(llama_dir: Path) -> None:
    """vLLM hashes additional_config into its compile-cache key, and the taps live there."""
    from vllm.engine.arg_utils import EngineArgs

    from probehook.adapter.frontend.engine_config import capture_engine_kwargs
    from probehook.capture_config import CaptureConfig

    def config_hash(kwargs: dict) -> str:
        args = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128, **kwargs)
        return args.create_engine_config().compute_hash()

    plain = config_hash({})
    one = config_hash(capture_engine_kwargs({}, CaptureConfig(layers=(1,))))
    two = config_hash(capture_engine_kwargs({}, CaptureConfig(layers=(1, 2))))
    assert len({plain, one, two}) == 3


def test_capture_and_steering_engines_run_without_async_scheduling(llama_dir: Path) -> None:
    """vLLM's async scheduling (the CUDA default; CPU has it off, so no engine test can run
    it) is turned off for any engine probehook captures from or steers (review D1): the
    engine arguments carry ``async_scheduling=False``, and vLLM's resolved config agrees."""
    from vllm.engine.arg_utils import EngineArgs

    from probehook.adapter.frontend.engine_config import capture_engine_kwargs
    from probehook.capture_config import CaptureConfig

    for kwargs in (
        capture_engine_kwargs({}, CaptureConfig(layers=(1,))),
        capture_engine_kwargs({"async_scheduling": False}, CaptureConfig(layers=()),
                              steer_layers=(1,)),
    ):  # fmt: skip
        assert kwargs["async_scheduling"] is False
        args = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128, **kwargs)
        assert args.create_engine_config().scheduler_config.async_scheduling is False


def test_bad_store_path_fails_before_engine_start(llm_cls, llama_dir: Path, tmp_path: Path):
    (tmp_path / "junk.txt").write_text("not a store")
    with pytest.raises(StoreFormatError, match="not an activation store"):
        llm_cls(str(llama_dir), layers=[0], store=tmp_path)
    with pytest.raises(CaptureConfigError, match="needs something to store"):
        llm_cls(str(llama_dir), store=tmp_path / "new")


def test_store_held_by_another_writer_fails_before_engine_start(
    llm_cls, llama_dir: Path, tmp_path: Path
) -> None:
    from probehook.errors import StoreLockedError
    from probehook.store import ActivationStore

    holder = ActivationStore.for_writing(
        tmp_path / "s", {"model": "m", "dtype": "float32", "hidden_size": 128, "layers": [0]}
    )
    try:
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            llm_cls(str(llama_dir), layers=[0], store=tmp_path / "s")
    finally:
        holder.close()


# -- probes and monitors: refused before vLLM starts -----------------------------------------


def _probe(layer: int = 1, hidden: int = 128, kind: str = "binary"):
    from probehook import LinearProbe

    outputs = 3 if kind == "multiclass" else 1
    labels = ["a", "b", "c"] if kind == "multiclass" else None
    return LinearProbe(
        torch_zeros(outputs, hidden),
        torch_zeros(outputs),
        layer=layer,
        kind=kind,
        label_names=labels,
    )


def torch_zeros(*shape: int):
    import torch

    return torch.zeros(*shape)


def test_probe_layer_out_of_range(llm_cls, llama_dir: Path) -> None:
    with pytest.raises(CaptureConfigError, match=r"reads layer 7, but the model has 4 layers"):
        llm_cls(str(llama_dir), probes={"p": _probe(layer=7)})


def test_probe_hidden_size_mismatch(llm_cls, llama_dir: Path) -> None:
    from probehook.errors import ProbeError

    with pytest.raises(ProbeError, match=r"hidden size 64.*hidden size is 128"):
        llm_cls(str(llama_dir), probes={"p": _probe(hidden=64)})


def test_monitor_names_unknown_probe(llm_cls, llama_dir: Path) -> None:
    from probehook import ProbeMonitor

    with pytest.raises(CaptureConfigError, match=r"probe 'lies'.*probes are \['truth'\]"):
        llm_cls(str(llama_dir), probes={"truth": _probe()}, monitors=[ProbeMonitor("lies", 0.5)])


def test_monitor_threshold_outside_probabilities(llm_cls, llama_dir: Path) -> None:
    from probehook import ProbeMonitor

    with pytest.raises(CaptureConfigError, match=r"threshold 1.5 is outside \[0, 1\]"):
        llm_cls(str(llama_dir), probes={"truth": _probe()}, monitors=[ProbeMonitor("truth", 1.5)])


def test_multiclass_monitor_needs_a_label(llm_cls, llama_dir: Path) -> None:
    from probehook import ProbeMonitor

    with pytest.raises(CaptureConfigError, match=r"needs label= naming one of its classes"):
        llm_cls(
            str(llama_dir),
            probes={"topic": _probe(kind="multiclass")},
            monitors=[ProbeMonitor("topic", 0.5)],
        )


def test_monitors_without_probes(llm_cls, llama_dir: Path) -> None:
    from probehook import ProbeMonitor

    with pytest.raises(CaptureConfigError, match="no probes were given"):
        llm_cls(str(llama_dir), layers=[0], monitors=[ProbeMonitor("truth", 0.5)])


def test_probe_that_is_not_a_probe(llm_cls, llama_dir: Path) -> None:
    with pytest.raises(CaptureConfigError, match=r"probes\['p'\] is a dict, not a probe"):
        llm_cls(str(llama_dir), probes={"p": {"weight": [0.0]}})


# -- steering: every bad vector or option fails before vLLM starts ----------------------------


def _vec(layer: int = 1, hidden: int = 128, name: str | None = None):  # noqa: ANN202
    import torch

    from probehook import SteeringVector

    return SteeringVector({layer: torch.ones(hidden)}, name=name)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (lambda: {"steering": {"up": _vec(hidden=64)}}, r"64.*128|128.*64"),
        (lambda: {"steering": {"up": _vec(layer=4)}}, r"layer 4.*4"),
        (lambda: {"steering": {"up": "missing.safetensors"}}, r"missing\.safetensors"),
        (lambda: {"steering": {"up": [1.0, 2.0]}}, r"probehook\.SteeringVector"),
        (lambda: {"steering": [_vec()]}, r"steering\[0\] has no name"),
        (lambda: {"steering": [_vec(name="a"), _vec(name="a")]}, r"Two steering vectors.*'a'"),
        (lambda: {"steering": "up"}, r"steering='up' must be a dict name -> steering vector"),
        (lambda: {"steering": {"up": _vec()}, "steering_capacity": 0}, r"steering_capacity=0"),
        (
            lambda: {"steering": {"a": _vec(), "b": _vec()}, "steering_capacity": 1},
            r"2 vectors, more than steering_capacity=1",
        ),
        (lambda: {"steering_layers": [9]}, r"layer 9 is out of range"),
    ],
)
def test_bad_steering_fails_before_engine_start(llm_cls, llama_dir: Path, kwargs, match) -> None:
    with pytest.raises((CaptureConfigError, FileNotFoundError), match=match):
        llm_cls(str(llama_dir), **kwargs())


def test_steer_monitor_needs_steering_and_known_vectors(llm_cls, llama_dir: Path) -> None:
    from helpers import random_probes

    from probehook import ProbeMonitor

    probes = {"truth": random_probes(128)["truth"]}
    gate = ProbeMonitor("truth", 0.5, action="steer", steer={"up": 1.0})
    with pytest.raises(CaptureConfigError, match=r"action='steer'.*no steering vectors"):
        llm_cls(str(llama_dir), probes=probes, monitors=[gate])
    with pytest.raises(CaptureConfigError, match=r"\['up'\].*its vectors are \['down'\]"):
        llm_cls(str(llama_dir), probes=probes, monitors=[gate], steering={"down": _vec()})
    with pytest.raises(CaptureConfigError, match=r"only used with action='steer'"):
        ProbeMonitor("truth", 0.5, action="stop", steer={"up": 1.0})
    with pytest.raises(CaptureConfigError, match=r"non-empty dict"):
        ProbeMonitor("truth", 0.5, action="steer")


def test_pooling_models_refuse_steering(llm_cls) -> None:
    from probehook.testing import minilm_path

    with pytest.raises(CaptureConfigError, match=r"pooling model: probehook steers generative"):
        llm_cls(str(minilm_path()), steering={"up": _vec(layer=0, hidden=384)})


def test_compile_cache_key_depends_on_steered_layers_not_vectors(llama_dir: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from probehook.adapter.frontend.engine_config import capture_engine_kwargs
    from probehook.capture_config import CaptureConfig

    def config_hash(steer_layers: tuple[int, ...]) -> str:
        kwargs = capture_engine_kwargs({}, CaptureConfig(layers=(1,)), steer_layers=steer_layers)
        args = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128, **kwargs)
        return args.create_engine_config().compute_hash()

    assert len({config_hash(()), config_hash((1,)), config_hash((1, 2))}) == 3
    # The vectors travel by RPC after start-up: nothing of theirs is in the engine arguments.
    kwargs = capture_engine_kwargs({}, CaptureConfig(layers=(1,)), steer_layers=(1,))
    assert "steer" not in json.dumps(kwargs["additional_config"]).replace("steer_layers", "")


def test_async_llm_refuses_capture_only(llama_dir: Path) -> None:
    """Capture-only engines are offline (docs/collect.md); AsyncLLM says where they are."""
    from probehook import AsyncLLM

    with pytest.raises(CaptureConfigError, match=r"capture_only=True.*probehook\.LLM"):
        AsyncLLM(str(llama_dir), layers=[1], capture_only=True)


@pytest.mark.parametrize(
    ("model", "kwargs", "match"),
    [
        ("minilm", {}, "this is a pooling model"),
        ("llama", {"lens_layers": [7]}, r"no layer 7 \(0..3\)"),
        ("llama", {"lens_top_k": 65}, r"lens_top_k=65 is not valid: pass an int in 1..64"),
        ("llama", {"lens_layers": None}, "needs lens_layers"),
    ],
)
def test_lenses_where_they_cannot_run(llm_cls, llama_dir: Path, model, kwargs, match) -> None:
    """A lens needs the model's LM head, layers the model has and a k that keeps the wire
    small."""
    from probehook.testing import minilm_path

    path = minilm_path() if model == "minilm" else llama_dir
    options = {"lenses": {"l": "logit"}, "lens_layers": [0], **kwargs}
    with pytest.raises(CaptureConfigError, match=match):
        llm_cls(str(path), **options)


def test_a_lens_file_for_another_model_is_refused(llm_cls, llama_dir: Path, tmp_path) -> None:
    from helpers import write_random_lenses

    files = write_random_lenses(tmp_path, 64, 4)
    with pytest.raises(CaptureConfigError, match=r"d_model 64.*hidden size is 128"):
        llm_cls(str(llama_dir), lenses={"j": files["j"]}, lens_layers=[1])
    with pytest.raises(CaptureConfigError, match="lens_layers=.* configures the lens readout"):
        llm_cls(str(llama_dir), layers=[0], lens_layers=[1])
