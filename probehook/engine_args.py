"""Construction-time checks and the engine arguments that switch capture on.

Everything here runs before vLLM starts, so bad input fails in milliseconds, not after a
minute of compilation.
"""

from __future__ import annotations

import os
from typing import Any

from probehook import _vllm_adapter as adapter
from probehook.capture_config import CaptureConfig
from probehook.errors import CaptureConfigError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    "GPTNeoXForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
)
WORKER_EXTENSION = "probehook.worker_extension.ProbehookWorkerExtension"


def read_model_config(model: str, trust_remote_code: bool = False) -> Any:
    """The model's Hugging Face config (local directories only need config.json)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(
            f"Cannot read the config of model {model!r}: {e}. Pass a local model directory "
            "that holds a config.json."
        ) from e
    return config


def check_architecture(config: Any) -> int:
    """Return the number of decoder layers, or fail naming the supported architectures."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in architectures):
        raise UnsupportedModelError(
            f"probehook cannot tap architecture {architectures or '(none listed)'}: its "
            f"decoder layers are not known. Supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise UnsupportedModelError(f"The model config has no num_hidden_layers ({num_layers}).")
    return num_layers


def capture_engine_kwargs(kwargs: dict[str, Any], capture: CaptureConfig) -> dict[str, Any]:
    """Return ``kwargs`` for ``vllm.LLM`` with probehook's loader, extension and config."""
    kwargs = dict(kwargs)
    if kwargs.get("worker_extension_cls") not in (None, "", WORKER_EXTENSION):
        raise CaptureConfigError(
            f"worker_extension_cls={kwargs['worker_extension_cls']!r} cannot be combined with "
            f"capture: probehook installs its own ({WORKER_EXTENSION}). Pass layers=None to "
            "use your extension without capture."
        )
    if kwargs.get("speculative_config"):
        raise CaptureConfigError(
            "speculative_config is not supported with capture: draft tokens that are rejected "
            "would leave rows for tokens that were never returned. Remove speculative_config "
            "or pass layers=None."
        )
    if kwargs.get("runner") == "pooling" or kwargs.get("convert") not in (None, "auto", "none"):
        raise CaptureConfigError(
            f"runner={kwargs.get('runner')!r} / convert={kwargs.get('convert')!r}: capture of "
            "pooling models (encode/embed/classify/score) is not supported yet. Pass "
            "layers=None to use them as in vLLM."
        )
    if int(kwargs.get("pipeline_parallel_size", 1)) > 1:
        raise CaptureConfigError(
            f"pipeline_parallel_size={kwargs['pipeline_parallel_size']} is not supported with "
            "capture (each stage holds only some layers); use tensor_parallel_size instead."
        )
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "probehook" not in plugins.split(","):
        raise CaptureConfigError(
            f"VLLM_PLUGINS={plugins!r} does not include 'probehook', so vLLM's workers would "
            "load the model without taps. Add 'probehook' to VLLM_PLUGINS or unset it."
        )
    inner_format = kwargs.get("load_format", "auto")
    if inner_format == adapter.LOAD_FORMAT:
        raise CaptureConfigError(
            f"load_format={inner_format!r} is set by probehook itself; pass the format of your "
            "weights (default 'auto')."
        )
    extra = kwargs.get("model_loader_extra_config") or {}
    if not isinstance(extra, dict):
        raise CaptureConfigError(
            f"model_loader_extra_config of type {type(extra).__name__} is not supported with "
            "capture; pass a dict."
        )
    kwargs["load_format"] = adapter.LOAD_FORMAT
    kwargs["model_loader_extra_config"] = {**extra, adapter.LOADER_EXTRA_KEY: inner_format}
    additional = dict(kwargs.get("additional_config") or {})
    # additional_config is part of vLLM's compile-cache hash: taps never share a cache entry
    # with a different tap set or with an untapped engine.
    additional[adapter.ADDITIONAL_CONFIG_KEY] = capture.to_dict()
    kwargs["additional_config"] = additional
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs
