"""Construction-time checks and the engine arguments that switch capture on.

Everything here runs before vLLM starts its engine, so bad input fails in milliseconds, not
after a minute of compilation. Checks run on the ``VllmConfig`` vLLM itself resolves from the
arguments (``EngineArgs.create_engine_config``), not on the raw keyword arguments: so
``spec_method=...`` is caught like ``speculative_config=...``, and the layer count honours
``revision``, ``hf_overrides`` and everything else vLLM honours.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from probehook.adapter import plugin
from probehook.capture_config import CaptureConfig
from probehook.core import architectures as known
from probehook.core import loader_keys
from probehook.errors import CaptureConfigError, UnsupportedModelError

logger = logging.getLogger(__name__)


def check_architecture(model_config: Any) -> None:
    """Refuse, before the engine starts, a model whose layers probehook cannot find: one that
    is neither tested (``known.TESTED_ARCHITECTURES``) nor declares its layer path."""
    architectures = list(model_config.architectures or [])
    using_backend = getattr(model_config, "using_transformers_backend", lambda: False)()
    if using_backend:
        # Which backend class vLLM will build (multimodal / pooling ones are not tested).
        backend_cls = model_config._get_transformers_backend_cls()
        if backend_cls in known.TRANSFORMERS_BACKEND_CLASSES:
            return
        raise UnsupportedModelError(
            f"probehook cannot tap {architectures or '(none listed)'} through vLLM's "
            f"Transformers backend class {backend_cls}: only "
            f"{' / '.join(known.TRANSFORMERS_BACKEND_CLASSES)} are tested. "
            f"{known.supported_message()}"
        )
    if any(arch in known.TESTED_ARCHITECTURES for arch in architectures):
        return
    model_cls = _model_class(model_config)
    declared = known.declared_layer_path(model_cls) if model_cls is not None else None
    if declared is not None:
        logger.info(
            "probehook: %s declares its layer path %r (%s = ...); not among the tested "
            "architectures.",
            model_cls.__name__,  # type: ignore[union-attr]
            declared,
            known.LAYER_PATH_ATTRIBUTE,
        )
        return
    raise UnsupportedModelError(
        f"probehook cannot tap architecture {architectures or '(none listed)'}: its layers are "
        f"not known and its model class does not declare them. {known.supported_message()}"
    )


def _model_class(model_config: Any) -> type | None:
    """The vLLM model class the engine will build (None: vLLM cannot resolve it, and will say
    so itself when the engine starts)."""
    registry = getattr(model_config, "registry", None)
    if registry is None:
        return None
    try:
        model_cls, _ = registry.resolve_model_cls(
            list(model_config.architectures or []), model_config=model_config
        )
    except (ValueError, ImportError):  # an unknown architecture, a model that fails to import
        return None
    return model_cls


WORKER_EXTENSION = "probehook.adapter.worker.rpc.ProbehookWorkerExtension"
MONITOR_PROCESSOR = "probehook.adapter.worker.monitor_processor:ProbeStopProcessor"


RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_logged_runner_choice = False


@contextlib.contextmanager
def capture_engine_start() -> Iterator[None]:
    """Build a capture engine inside this block: its processes start with vLLM's V1 model
    runner, which probehook reads, and with probehook's vLLM plugin active
    (:func:`probehook.adapter.plugin.active`: the engine's processes register probehook's
    model loader, a plain engine's do not). Both are environment variables the engine's
    processes inherit at spawn, set for the block only.
    """
    with _runner_env(), plugin.active():
        yield


@contextlib.contextmanager
def _runner_env() -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER=0`` for the block.

    vLLM decides the runner from ``VLLM_USE_V2_MODEL_RUNNER`` while it resolves the config and
    when its engine-core and worker processes start (they inherit the environment at spawn
    and cache it). So the variable is set to 0 for the block only, and restored afterwards: a
    plain ``vllm.LLM`` built later in this process chooses its runner as usual. The front end
    keeps the right answer for the engine's life through :func:`pin_v1_runner`. A forced V2
    (``=1``) is refused, since probehook cannot read it yet. An untested vLLM version gets
    one warning per process here.
    """
    global _logged_runner_choice
    from probehook.adapter import vllm_names

    vllm_names.warn_if_untested()
    value = os.environ.get(RUNNER_ENV)
    if value is not None:
        try:
            forced_v2 = bool(int(value))
        except ValueError:
            raise CaptureConfigError(
                f"{RUNNER_ENV}={value!r} is not 0 or 1 (vLLM reads it as an int). Unset it, or "
                "set it to 0, to capture."
            ) from None
        if forced_v2:
            raise CaptureConfigError(
                f"{RUNNER_ENV}={value!r} forces vLLM's Model Runner V2, which probehook cannot "
                "read yet (it has no input_batch / requests / query_start_loc). Unset it, or "
                "set it to 0, to capture; or pass layers=None to run V2 without capture."
            )
        yield  # the user chose V1 already
        return
    if not _logged_runner_choice:
        logger.info(
            "probehook: capture reads vLLM's V1 model runner; this engine is built with "
            "%s=0 (the process's setting is restored afterwards).",
            RUNNER_ENV,
        )
        _logged_runner_choice = True
    os.environ[RUNNER_ENV] = "0"
    try:
        yield
    finally:
        os.environ.pop(RUNNER_ENV, None)


def pin_v1_runner(vllm_config: Any) -> None:
    """Make the front end's ``vllm_config.use_v2_model_runner`` say False for the engine's life.

    vLLM's property is live: it reads ``VLLM_USE_V2_MODEL_RUNNER`` (and, unset, Triton and the
    features in use) on every call. :func:`capture_engine_start` restores the variable once the
    engine's processes have started with V1, so on a GPU the front end would then believe V2
    while the workers run V1, and vLLM's request-time checks that trust it (beam search
    allow-lists, ``prompt_logprob_token_ids``) would let V2-only requests through. Pinning
    this engine's config object (the one its input processor and the server's handlers hold)
    keeps the answer true without leaving the variable set for other engines of the process.
    Swapping the class is the only way: an instance attribute cannot shadow a property.
    """
    base = type(vllm_config)
    if getattr(base, "_probehook_v1_pinned", False):
        return
    vllm_config.__class__ = _pinned_class(base)


_PINNED: dict[type, type] = {}


def _pinned_class(base: type) -> type:
    """``base`` with ``use_v2_model_runner`` fixed to False; one class per base, reachable as
    a module attribute so that a pinned config still pickles."""
    pinned = _PINNED.get(base)
    if pinned is None:
        name = f"V1Runner{base.__name__}"
        pinned = type(
            name,
            (base,),
            {
                "use_v2_model_runner": property(lambda self: False),
                "_probehook_v1_pinned": True,
                "__module__": __name__,
                "__qualname__": name,
            },
        )
        _PINNED[base] = pinned
    return pinned


def __getattr__(name: str) -> Any:
    # Unpickling a pinned VllmConfig in another process looks its class up here.
    if name == "V1RunnerVllmConfig":
        from vllm.config import VllmConfig

        return _pinned_class(VllmConfig)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_vllm_config(model: str, kwargs: dict[str, Any]) -> Any:
    """The ``VllmConfig`` that ``vllm.LLM(model, **kwargs)`` will run with, without starting it.

    vLLM's own errors for bad arguments propagate unchanged.
    """
    from vllm.usage.usage_lib import UsageContext

    return engine_args(model, kwargs).create_engine_config(UsageContext.LLM_CLASS)


def engine_args(model: str, kwargs: dict[str, Any], asynchronous: bool = False) -> Any:
    """``EngineArgs`` (or, ``asynchronous``, ``AsyncEngineArgs``) from keyword arguments as
    ``vllm.LLM`` takes them: mirrors the argument conversions of ``vllm.LLM.__init__`` (0.32)
    that matter for config resolution (dicts for config objects, an int compilation mode)."""
    from vllm.config import (
        AttentionConfig,
        CompilationConfig,
        ProfilerConfig,
        StructuredOutputsConfig,
    )
    from vllm.config.compilation import CompilationMode
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    args = dict(kwargs)
    if not asynchronous:
        args.setdefault("disable_log_stats", True)  # vllm.LLM's default
    args["hf_overrides"] = args.get("hf_overrides") or {}
    args["offload_params"] = args.get("offload_params") or set()
    args.pop("worker_cls", None)  # only decides which class runs; not resolved here
    compilation = args.get("compilation_config")
    if isinstance(compilation, int):
        args["compilation_config"] = CompilationConfig(mode=CompilationMode(compilation))
    for name, cls in (
        ("compilation_config", CompilationConfig),
        ("structured_outputs_config", StructuredOutputsConfig),
        ("profiler_config", ProfilerConfig),
        ("attention_config", AttentionConfig),
    ):
        value = args.get(name)
        if value is None:
            args[name] = cls()
        elif isinstance(value, dict):
            args[name] = cls(**value)
    if isinstance(args.get("kv_transfer_config"), dict):
        from vllm.config.kv_transfer import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    return (AsyncEngineArgs if asynchronous else EngineArgs)(model=model, **args)


def check_engine(vllm_config: Any) -> int:
    """Refuse engine features capture cannot serve; return the number of decoder layers."""
    model_config = vllm_config.model_config
    if vllm_config.speculative_config is not None:
        method = getattr(vllm_config.speculative_config, "method", None)
        raise CaptureConfigError(
            f"Speculative decoding (method={method!r}) is not supported with capture or "
            "probes: the target computes rows for draft tokens that may be rejected, a draft "
            "model would be tapped too, and vLLM refuses the custom logits processor that "
            "probe monitors use. Remove speculative_config / spec_method / spec_model / "
            "spec_tokens, or pass layers=None and no probes."
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise CaptureConfigError(
            f"pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size} is "
            "not supported with capture (each stage holds only some layers); use "
            "tensor_parallel_size instead."
        )
    if getattr(model_config, "enable_prompt_embeds", False) and not is_pooling(vllm_config):
        raise CaptureConfigError(
            "enable_prompt_embeds=True is not supported with capture: rows of prompts given as "
            "embeddings cannot be checked against token ids yet. Pass token or text prompts, "
            "or layers=None."
        )
    if vllm_config.use_v2_model_runner:
        raise CaptureConfigError(
            "This engine configuration makes vLLM use Model Runner V2 (for example "
            "watermarking or HiSparse attention), which probehook cannot read yet. Remove "
            "that option or pass layers=None."
        )
    check_architecture(model_config)
    num_layers = getattr(model_config.hf_text_config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise UnsupportedModelError(f"The model config has no num_hidden_layers ({num_layers}).")
    return num_layers


def is_pooling(vllm_config: Any) -> bool:
    """Whether the engine runs a pooling model (one pass per request, no sampling)."""
    return vllm_config.model_config.runner_type == "pooling"


ASYNC_SCHEDULING_REASON = (
    "under it the scheduler plans step N+1 before step N's tokens are known, so a request "
    "that ends on EOS gets one more forward pass (a row past its last token, which can replace "
    "the last_decode_token row) and sampling may not follow its forward pass (post-sample "
    "readouts such as lenses)"
)


def _no_async_scheduling(asked: Any) -> bool:
    """vLLM's async scheduling (its default on CUDA; CPU turns it off) is off for an engine
    probehook captures from or steers: asked for explicitly, it is refused with the reason."""
    if asked:
        raise CaptureConfigError(
            f"async_scheduling={asked!r} cannot be combined with probehook's capture or "
            f"steering: {ASYNC_SCHEDULING_REASON}. Drop async_scheduling (probehook turns it "
            "off), or build the engine without capture."
        )
    if asked is None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():  # vLLM's CPU platform has it off already
            logger.info("probehook: vLLM's async scheduling is off for this engine: %s "
                        "(docs/capture.md).", ASYNC_SCHEDULING_REASON)  # fmt: skip
    return False


def capture_engine_kwargs(
    kwargs: dict[str, Any],
    capture: CaptureConfig,
    probe_layers: tuple[int, ...] = (),
    pooling: bool = False,
    steer_layers: tuple[int, ...] = (),
    exit_after: int | None = None,
    monitored: bool | None = None,
    writes: Mapping[str, Any] | None = None,
    banks: str | None = None,
    query_layers: Sequence[int] = (),
    readouts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return ``kwargs`` for ``vllm.LLM`` with probehook's loader, extension and config;
    ``probe_layers`` (the layers probes and readouts read) are tapped too; with probes
    (``monitored``; None: whenever ``probe_layers`` are given) the monitor logits processor is
    added; with ``steer_layers``, those layers get the steering op; with ``exit_after`` (a
    capture-only engine), the model stops after that layer; ``writes``: the write table's
    instances, by request option; ``query_layers``: the layers whose attention query is
    tapped; ``banks``: the probes and first
    steering vectors, encoded (``WorkerBanks.encode``);
    ``readouts``: each top-k readout's loader settings, by source."""
    kwargs = dict(kwargs)
    if kwargs.get("worker_extension_cls") not in (None, "", WORKER_EXTENSION):
        raise CaptureConfigError(
            f"worker_extension_cls={kwargs['worker_extension_cls']!r} cannot be combined with "
            f"capture: probehook installs its own ({WORKER_EXTENSION}). Pass layers=None to "
            "use your extension without capture."
        )
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "probehook" not in plugins.split(","):
        raise CaptureConfigError(
            f"VLLM_PLUGINS={plugins!r} does not include 'probehook', so vLLM's workers would "
            "load the model without taps. Add 'probehook' to VLLM_PLUGINS or unset it."
        )
    kwargs["async_scheduling"] = _no_async_scheduling(kwargs.get("async_scheduling"))
    inner_format = kwargs.get("load_format", "auto")
    if inner_format == loader_keys.LOAD_FORMAT:
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
    kwargs["load_format"] = loader_keys.LOAD_FORMAT
    kwargs["model_loader_extra_config"] = {**extra, loader_keys.LOADER_EXTRA_KEY: inner_format}
    if readouts:
        kwargs["model_loader_extra_config"][loader_keys.READOUTS_KEY] = readouts
    if banks:
        kwargs["model_loader_extra_config"][loader_keys.BANKS_KEY] = banks
    additional = dict(kwargs.get("additional_config") or {})
    # additional_config is part of vLLM's compile-cache hash: taps never share a cache entry
    # with a different tap set or with an untapped engine.
    tap_layers = sorted({*capture.layers, *probe_layers})
    additional[loader_keys.ADDITIONAL_CONFIG_KEY] = {
        **capture.to_dict(),
        loader_keys.TAP_LAYERS_KEY: tap_layers,
        loader_keys.STEER_LAYERS_KEY: sorted(steer_layers),
        loader_keys.QUERY_LAYERS_KEY: sorted(query_layers),
        loader_keys.EXIT_AFTER_KEY: exit_after,
    }
    if writes:  # their terms are part of the graph: in the compile-cache key
        additional[loader_keys.ADDITIONAL_CONFIG_KEY][loader_keys.WRITES_KEY] = dict(writes)
    kwargs["additional_config"] = additional
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    if monitored is None:
        monitored = bool(probe_layers)
    if monitored and not pooling:  # pooling models sample nothing, so nothing to stop
        # Per engine, never the global entry-point group (it would touch every engine).
        processors = list(kwargs.get("logits_processors") or [])
        if MONITOR_PROCESSOR not in processors:
            processors.append(MONITOR_PROCESSOR)
        kwargs["logits_processors"] = processors
    return kwargs
