"""The ``probehook`` model loader: the user's own loader loads the weights, then the model
surgery (:mod:`~probehook.adapter.worker.surgery`) adds the taps and ops before vLLM compiles
it, and the banks are allocated (:meth:`StepHook.allocate_banks`), inside vLLM's memory
profiling.

Extension points used (public in vLLM 0.32): ``register_model_loader`` (the ``probehook`` load
format wraps the user's own loader), the ``vllm.general_plugins`` entry point (registers it in
the processes of the engines probehook builds, :mod:`probehook.adapter.plugin`) and
``additional_config`` (carries the capture config to the workers and into
vLLM's compile-cache hash, so graphs compiled with different taps, or none, are never shared).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from probehook.adapter.worker.head import ModelParts, model_parts, tensor_group
from probehook.adapter.worker.surgery import (
    exit_early,
    install_query_taps,
    install_steering,
    install_taps,
    install_writes,
    locate_layers,
)
from probehook.capture_config import CaptureConfig
from probehook.core.bank_file import WorkerBanks
from probehook.core.loader_keys import (
    ADDITIONAL_CONFIG_KEY,
    BANKS_KEY,
    EXIT_AFTER_KEY,
    LOAD_FORMAT,
    LOADER_EXTRA_KEY,
    QUERY_LAYERS_KEY,
    READOUTS_KEY,
    STEER_LAYERS_KEY,
    TAP_LAYERS_KEY,
    WRITES_KEY,
)
from probehook.errors import UnsupportedModelError
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.intervention import interventions
from probehook.outputs.top_k_readout import top_k_readouts
from probehook.worker.readouts import top_k_bank
from probehook.worker.write_table import WriterContext, build_writers


def register_loader() -> None:
    """Register the ``probehook`` load format (idempotent; called in each process of an engine
    probehook builds)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not None:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_make_loader_class())


def _make_loader_class() -> type:
    from vllm.model_executor.model_loader import BaseModelLoader, get_model_loader

    class ProbehookModelLoader(BaseModelLoader):
        """Loads with the user's loader, then installs capture taps on the decoder layers."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            inner_format = extra.pop(LOADER_EXTRA_KEY, None)
            self.banks = extra.pop(BANKS_KEY, None)
            self.readouts = extra.pop(READOUTS_KEY, None)
            if inner_format is None:
                raise UnsupportedModelError(
                    f"load_format={LOAD_FORMAT!r} is reserved for probehook.LLM; pass your "
                    "own load_format to probehook.LLM instead."
                )
            self.inner = get_model_loader(
                replace(load_config, load_format=inner_format, model_loader_extra_config=extra)
            )

        def download_model(self, model_config: Any) -> None:
            self.inner.download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            self.inner.load_weights(model, model_config)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            model = self.inner.load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
            settings = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
            if settings is None:
                raise UnsupportedModelError(
                    "The probehook loader ran without a capture config; build the engine "
                    "with probehook.LLM."
                )
            settings = dict(settings)
            config = CaptureConfig.from_dict(
                {k: v for k, v in settings.items() if k not in _NOT_CAPTURE_CONFIG}
            )
            scheduler = vllm_config.scheduler_config
            banks = WorkerBanks.decode(self.banks) if self.banks else WorkerBanks()
            hook = install_taps(
                model,
                config,
                tuple(settings.get(TAP_LAYERS_KEY) or config.layers),
                scheduler.max_num_batched_tokens,
                model_config.get_hidden_size(),
                steer_layers=tuple(settings.get(STEER_LAYERS_KEY) or ()),
                # One table row per request the batch can hold, plus row 0 (no steering).
                steer_slots=scheduler.max_num_seqs + 1,
                steer_capacity=banks.steering_capacity,
            )
            # The query taps of readouts read at the attention op's input (attn_q).
            query_layers = [int(layer) for layer in settings.get(QUERY_LAYERS_KEY) or ()]
            if query_layers:
                hook.query_buffers = install_query_taps(
                    model, query_layers, scheduler.max_num_batched_tokens
                )
            # The readouts' banks, here, inside vLLM's memory profiling: the KV cache is sized
            # around what they hold (an SAE's encoder).
            for source, entry in (self.readouts or {}).items():
                # Each top-k readout's instances (its class is registered in this process
                # too: an output processor, or its entry point).
                readout = top_k_readouts(OUTPUT_PROCESSORS).get(source)
                if readout is None:
                    raise UnsupportedModelError(
                        f"The engine reads top-k readout {source!r}, which is not registered "
                        "in this worker's process: register it through the entry-point group "
                        "'probehook.output_processors' so every process knows it."
                    )
                parts = (
                    model_parts(model, lambda: _unembedding(self.inner, model_config))
                    if readout.reads_head
                    else ModelParts(next(model.parameters()).device, None)
                )
                parts = replace(parts, group=tensor_group())
                hook.top_k_banks[source] = top_k_bank(
                    readout, entry["instances"], entry["k"], parts
                )
                hook.top_k_ranks[source] = readout.ranks
            # The write table's terms, after the banks (an SAE clamp writes with its SAE's
            # weights) and before steering's terms at each layer.
            hook.writers = _writers(settings.get(WRITES_KEY) or {}, model, hook, model_config,
                                    scheduler)  # fmt: skip
            install_writes(model, hook.writers, scheduler.max_num_batched_tokens)
            install_steering(hook.steering)  # after the write table's terms at each layer
            # Probes and steering vectors too, from the banks the front end encoded.
            hook.allocate_banks(banks)
            exit_after = settings.get(EXIT_AFTER_KEY)
            if exit_after is not None:
                hook.cut = exit_early(model, int(exit_after))
            hook.layers_run = len(locate_layers(model)[1])
            return model

    return ProbehookModelLoader


def _writers(
    writes: dict[str, Any], model: nn.Module, hook: Any, model_config: Any, scheduler: Any
) -> dict[tuple[str, str], Any]:
    """Each write-table instance's writer, by ``(request option, instance)``, from its
    intervention (registered in this process too, as a top-k readout is)."""
    registered = interventions(OUTPUT_PROCESSORS)
    param = next(model.parameters())
    context = WriterContext(param.device, param.dtype, model_config.get_hidden_size(),
                            scheduler.max_num_seqs + 1, hook.top_k_banks,
                            scheduler.max_num_batched_tokens)  # fmt: skip
    writers = {}
    for option, instances in writes.items():
        entry = registered.get(option)
        if entry is None:
            raise UnsupportedModelError(
                f"The engine writes with intervention {option!r}, which is not registered in "
                "this worker's process: register it through the entry-point group "
                "'probehook.output_processors' so every process knows it."
            )
        for instance, writer in build_writers(entry, instances, context).items():
            writers[(option, instance)] = writer
    return writers


def _unembedding(loader: Any, model_config: Any) -> Any:
    """The checkpoint's ``lm_head.weight`` (``[vocab, hidden]``), which vLLM does not load into
    a generative model it runs as a pooling model; read alone from the safetensors file that
    holds it. None when the loader or the checkpoint has no such file."""
    from safetensors import safe_open

    prepare = getattr(loader, "_prepare_weights", None)
    if prepare is None:
        return None
    _, files, use_safetensors, _ = prepare(model_config.model, None, model_config.revision,
                                           True, None)  # fmt: skip
    if not use_safetensors:
        return None
    for file in files:
        with safe_open(file, "pt") as f:
            keys = [k for k in f.keys() if k == "lm_head.weight" or k.endswith(".lm_head.weight")]  # noqa: SIM118
            if keys:
                return f.get_tensor(keys[0])
    return None


_NOT_CAPTURE_CONFIG = (
    TAP_LAYERS_KEY,
    STEER_LAYERS_KEY,
    EXIT_AFTER_KEY,
    WRITES_KEY,
    QUERY_LAYERS_KEY,
)

# The final norm of each family (vLLM's attribute names): a capture-only engine skips it.
