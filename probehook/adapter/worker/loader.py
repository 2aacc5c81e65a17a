"""The ``probehook`` model loader: taps go into the model after its weights load, before vLLM
compiles it, plus the once-per-forward step hook.

Extension points used (public in vLLM 0.32): ``register_model_loader`` (the ``probehook`` load
format wraps the user's own loader), the ``vllm.general_plugins`` entry point (registers it in
the processes of the engines probehook builds, :mod:`probehook.adapter.plugin`) and
``additional_config`` (carries the capture config to the workers and into
vLLM's compile-cache hash, so graphs compiled with different taps, or none, are never shared).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from probehook.capture_config import CaptureConfig
from probehook.core.architectures import (  # noqa: F401 - importable from here, as before
    KNOWN_LAYER_PATHS,
    LAYER_PATH_ATTRIBUTE,
    TESTED_ARCHITECTURES,
    TRANSFORMERS_BACKEND_CLASSES,
    declared_layer_path,
    supported_message,
)
from probehook.core.bank_file import WorkerBanks
from probehook.core.loader_keys import (
    ADDITIONAL_CONFIG_KEY,
    BANKS_KEY,
    CLAMP_KEY,
    EXIT_AFTER_KEY,
    LOAD_FORMAT,
    LOADER_EXTRA_KEY,
    SAE_BANK_KEY,
    STEER_LAYERS_KEY,
    TAP_LAYERS_KEY,
)
from probehook.core.request_options import MAX_CLAMPED
from probehook.errors import UnsupportedModelError
from probehook.worker.clamp_op import CLAMPED_SAES, ClampedSAE, clamp, clamp_key
from probehook.worker.clamp_tables import ClampBuffers
from probehook.worker.probe_bank import ProbeBank
from probehook.worker.recorder import StepRecorder
from probehook.worker.steer_op import steer
from probehook.worker.steering_bank import SteeringBank, StepSteering
from probehook.worker.tap_op import tap

logger = logging.getLogger(__name__)

RECORDER_ATTR = "probehook_step_hook"

TAP_KIND_ATTR = "probehook_tap_kind"
"""Layer attribute: how to read the layer's output (see ``_tap_hook``)."""


# --- loading: taps go in before compilation ------------------------------------------------


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
            self.sae_settings = extra.pop(SAE_BANK_KEY, None)
            self.banks = extra.pop(BANKS_KEY, None)
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
            # Each clamp op finds its SAE by a key made of what the compile-cache key holds
            # (name, layer, fingerprint): a traced graph is never replayed for another SAE.
            clamps = [(str(name), int(layer), clamp_key(str(name), int(layer), str(print_)))
                      for name, layer, print_ in settings.get(CLAMP_KEY) or ()]  # fmt: skip
            hook = install_taps(
                model,
                config,
                tuple(settings.get(TAP_LAYERS_KEY) or config.layers),
                scheduler.max_num_batched_tokens,
                model_config.get_hidden_size(),
                steer_layers=tuple(settings.get(STEER_LAYERS_KEY) or ()),
                # One table row per request the batch can hold, plus row 0 (no steering).
                steer_slots=scheduler.max_num_seqs + 1,
                clamps=clamps,
            )
            if self.sae_settings:
                # Here, inside vLLM's memory profiling: the KV cache is sized around them.
                from probehook.worker.sae_bank import load_bank

                device = next(model.parameters()).device
                hook.saes, decoders = load_bank(
                    self.sae_settings, device, keep_decoders=[name for name, _, _ in clamps]
                )
                for name, _, key in clamps:
                    clamped = ClampedSAE(hook.saes.weights_of(name), decoders[name])
                    hook.clamped.append(clamped)  # the engine holds it; the op finds it by key
                    CLAMPED_SAES[key] = clamped
            # Probes and steering vectors too, from the banks the front end encoded.
            banks = WorkerBanks.decode(self.banks) if self.banks else WorkerBanks()
            hook.allocate_banks(banks)
            exit_after = settings.get(EXIT_AFTER_KEY)
            if exit_after is not None:
                hook.cut = exit_early(model, int(exit_after))
            hook.layers_run = len(locate_layers(model)[1])
            return model

    return ProbehookModelLoader


_NOT_CAPTURE_CONFIG = (TAP_LAYERS_KEY, STEER_LAYERS_KEY, EXIT_AFTER_KEY, CLAMP_KEY)

# The final norm of each family (vLLM's attribute names): a capture-only engine skips it.
FINAL_NORM_NAMES: tuple[str, ...] = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


class _PassThrough(nn.Module):
    """Stands in for a final norm the capture-only engine does not compute: returns its input
    in the shape the norm would (``(hidden, residual)`` when called with a residual)."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return hidden if residual is None else (hidden, residual)


def exit_early(model: nn.Module, last_layer: int) -> list[str]:
    """Make ``model`` stop after decoder layer ``last_layer``: the layers after it are dropped
    from the layer list and its final norm is replaced by a pass-through; return what was cut.

    vLLM's decoder models run ``islice(self.layers, self.start_layer, self.end_layer)`` (its
    pipeline-parallel split; HF layer loops run over the list), so a shorter list and
    ``end_layer`` set to its length stop the loop there. Weights are loaded already, so the
    dropped layers' memory is freed. The rows of the layers kept, and everything before them,
    are unchanged; what reaches the pooler (and its embedding) is not the model's output, so a
    capture-only engine gives none.
    """
    path, layers = locate_layers(model)
    parent: Any = model
    for part in path.split(".")[:-1]:
        parent = getattr(parent, part)
    if is_transformers_backend(model):
        parent = parent.get_decoder() if hasattr(parent, "get_decoder") else parent
    cut = [f"{path}[{last_layer + 1}:{len(layers)}]"] if last_layer + 1 < len(layers) else []
    del layers[last_layer + 1 :]
    if isinstance(getattr(parent, "end_layer", None), int):
        parent.end_layer = min(parent.end_layer, last_layer + 1)
    for name in FINAL_NORM_NAMES:
        if isinstance(getattr(parent, name, None), nn.Module):
            setattr(parent, name, _PassThrough())
            cut.append(f"{path.rpartition('.')[0] or '(model)'}.{name}")
            break
    logger.info("probehook: capture-only engine stops after layer %d (cut %s)", last_layer, cut)
    return cut


def is_transformers_backend(model: nn.Module) -> bool:
    """Whether vLLM runs this model through its Transformers modeling backend (the Hugging
    Face model itself, with vLLM's attention and linear layers swapped in)."""
    try:
        from vllm.model_executor.models.transformers.base import Base
    except ImportError:  # a vLLM without the backend
        return False
    return isinstance(model, Base)


def locate_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the layer list of a vLLM model: where its class declares it
    (:data:`LAYER_PATH_ATTRIBUTE`), else where the tested architectures keep theirs; or say
    which architectures are tested and how to declare a path."""
    if is_transformers_backend(model):
        return _transformers_backend_layers(model)
    declared = declared_layer_path(type(model))
    if declared is not None:
        layers = _resolve(model, declared)
        if layers is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}.{LAYER_PATH_ATTRIBUTE} = {declared!r}, but that is not "
                "a non-empty nn.ModuleList of the model."
            )
        return declared, layers
    for path in KNOWN_LAYER_PATHS:
        layers = _resolve(model, path)
        if layers is not None:
            return path, layers
    raise UnsupportedModelError(
        f"Cannot find the layers of {type(model).__name__}: it declares no "
        f"{LAYER_PATH_ATTRIBUTE}, and none of {list(KNOWN_LAYER_PATHS)} is a layer list. "
        f"{supported_message()}"
    )


def _resolve(model: nn.Module, path: str) -> nn.ModuleList | None:
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.ModuleList) and len(obj) > 0 else None


def _transformers_backend_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    # The HF decoder holds exactly one layer list (vLLM's own pipeline-parallel split of this
    # backend relies on the same rule); its length is the config's layer count.
    hf_model: Any = model.model
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model
    num_layers = getattr(model.text_config, "num_hidden_layers", None)
    found = [
        (name, child)
        for name, child in decoder.named_children()
        if isinstance(child, nn.ModuleList) and len(child) == num_layers
    ]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"Cannot find the decoder layers of {type(decoder).__name__} (Transformers "
            f"backend): expected one layer list of {num_layers} layers, found "
            f"{[name for name, _ in found]}. {supported_message()}"
        )
    for layer in found[0][1]:
        setattr(layer, TAP_KIND_ATTR, "batched_stream")
    return f"model.{found[0][0]}", found[0][1]


def _split_layer_output(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Most vLLM decoder layers return (hidden, residual) with the add deferred to the next
    # norm; GPT-2/OPT/Granite-style layers return the finished stream.
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, tuple) and len(output) == 2:
        return output[0], output[1]
    raise UnsupportedModelError(
        f"Unexpected decoder-layer output {type(output).__name__}; expected a tensor or a "
        "(hidden, residual) pair."
    )


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    # The Transformers backend runs HF layers on [1, tokens, hidden] (vLLM adds a batch dim of
    # 1 and packs every request into it). ndim is static under torch.compile, and flatten is a
    # view both in eager and in the traced graph, so this adds no copy and no graph break.
    return x.flatten(0, -2) if x.dim() == 3 else x


def install_taps(
    model: nn.Module,
    config: CaptureConfig,
    tap_layers: tuple[int, ...],
    max_tokens: int,
    hidden_size: int | None = None,
    steer_layers: tuple[int, ...] = (),
    steer_slots: int = 0,
    clamps: Sequence[tuple[str, int, str]] = (),
) -> StepHook:
    """Add a tap after each layer in ``tap_layers``, a steering op after each layer in
    ``steer_layers`` (before that layer's tap: taps read the steered stream), and a per-step
    hook; return the hook.

    ``config.layers`` (possibly none) are captured as rows; the other tapped layers feed
    probes only.
    """
    _, layer_list = locate_layers(model)
    if max((*tap_layers, *steer_layers), default=-1) >= len(layer_list):
        raise UnsupportedModelError(
            f"layers {sorted({*tap_layers, *steer_layers})} asked for, but the model has "
            f"{len(layer_list)} decoder layers in this worker (pipeline parallelism is not "
            "supported)."
        )
    param = next(model.parameters())
    hidden_size = hidden_size or _hidden_size(model)
    steering = None
    if steer_layers:
        index = torch.zeros(max_tokens, dtype=torch.int64, device=param.device)
        tables = {}
        for layer_index in steer_layers:
            layer = layer_list[layer_index]
            table = torch.zeros((steer_slots, hidden_size), dtype=param.dtype, device=param.device)
            # Buffers of the module, like the tap's, so the compiled graph reads them as inputs.
            layer.register_buffer("probehook_steer_index", index, persistent=False)
            layer.register_buffer("probehook_steer_table", table, persistent=False)
            layer.register_forward_hook(_steer_hook, prepend=True)
            tables[layer_index] = layer.probehook_steer_table
        steering = SteeringBuffers(index, tables)
    clamp_buffers = {}
    for name, layer_index, key in clamps:  # after steering (prepended), before the taps
        layer = layer_list[layer_index]
        buffers_of = ClampBuffers(
            torch.zeros(max_tokens, dtype=torch.int64, device=param.device),
            torch.full((steer_slots, MAX_CLAMPED), -1, dtype=torch.int64, device=param.device),
            torch.zeros((steer_slots, MAX_CLAMPED), dtype=torch.float32, device=param.device),
        )
        for part in ("index", "features", "values"):
            layer.register_buffer(
                f"probehook_clamp{key}_{part}", getattr(buffers_of, part), persistent=False
            )
            setattr(buffers_of, part, getattr(layer, f"probehook_clamp{key}_{part}"))
        layer.register_forward_hook(_clamp_hook(key))
        clamp_buffers[name] = buffers_of
    buffers = {}
    for layer_index in tap_layers:
        layer = layer_list[layer_index]
        buf = torch.zeros((max_tokens, hidden_size), dtype=param.dtype, device=param.device)
        # A non-persistent buffer is part of the module, so torch.compile sees the mutation.
        layer.register_buffer("probehook_tap_out", buf, persistent=False)
        layer.register_forward_hook(_tap_hook)
        buffers[layer_index] = layer.probehook_tap_out
    hook = StepHook(buffers, config, steering, hidden_size, param.dtype, param.device)
    hook.clamp_buffers = clamp_buffers
    setattr(model, RECORDER_ATTR, hook)
    _install_logits_hook(model)
    logger.info(
        "probehook: tapped layers %s, steered layers %s (hidden %d, %s)",
        list(tap_layers),
        list(steer_layers),
        hidden_size,
        param.dtype,
    )
    return hook


def _steer_hook(module: nn.Module, args: Any, output: Any) -> None:
    # In place, so the hook returns nothing and the layer's output objects stay as they are.
    if getattr(module, TAP_KIND_ATTR, None) == "batched_stream":
        stream = output[0] if isinstance(output, tuple) else output
        steer(_tokens_first(stream), module.probehook_steer_index, module.probehook_steer_table)
        return
    hidden, _ = _split_layer_output(output)
    steer(hidden, module.probehook_steer_index, module.probehook_steer_table)


def _clamp_hook(key: str) -> Callable[[nn.Module, Any, Any], None]:
    """The forward hook of clamp op ``key`` (its buffers are the layer's, named by key)."""
    index_name, features_name, values_name = (
        f"probehook_clamp{key}_{part}" for part in ("index", "features", "values")
    )

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        buffers = (getattr(module, index_name), getattr(module, features_name),
                   getattr(module, values_name))  # fmt: skip
        if getattr(module, TAP_KIND_ATTR, None) == "batched_stream":
            stream = output[0] if isinstance(output, tuple) else output
            clamp(_tokens_first(stream), None, *buffers, key)
            return
        hidden, residual = _split_layer_output(output)
        clamp(hidden, residual, *buffers, key)

    return hook


@dataclass
class SteeringBuffers:
    """The steering op's buffers in one worker: the per-token slot index (shared by every
    steered layer) and each steered layer's table."""

    index: torch.Tensor
    tables: dict[int, torch.Tensor]


def _tap_hook(module: nn.Module, args: Any, output: Any) -> None:
    if getattr(module, TAP_KIND_ATTR, None) == "batched_stream":
        # An HF layer (Transformers backend) returns the finished stream after the layer,
        # alone or first in a tuple (attention weights may follow: never a residual).
        stream = output[0] if isinstance(output, tuple) else output
        tap(_tokens_first(stream), None, module.probehook_tap_out)
        return
    hidden, residual = _split_layer_output(output)
    tap(hidden, residual, module.probehook_tap_out)


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise UnsupportedModelError(f"Cannot read the hidden size of {type(model).__name__}.")


class StepHook:
    """Runs the recorder exactly once per forward pass of the runner.

    ``compute_logits`` runs eagerly right after the forward pass, outside torch.compile and
    CUDA graphs, while the runner still holds the step's batch. vLLM also calls it again in
    the same step for each request that asks for ``prompt_logprobs``, and in warm-up: so the
    runner's ``execute_model`` arms the hook and the first ``compute_logits`` after that fires
    it. Nothing fires before :meth:`install_on` (warm-up and profiling are not requests' rows).
    """

    def __init__(
        self,
        buffers: dict[int, torch.Tensor],
        config: CaptureConfig,
        steering: SteeringBuffers | None = None,
        hidden_size: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        self.buffers = buffers
        self.device = device if device is not None else torch.device("cpu")
        """The model's device (an engine may tap no layer: steering alone)."""
        self.steering = steering
        """The steering op's buffers (None: no layer is steered)."""
        self.hidden_size = hidden_size
        self.dtype = dtype
        """Tap buffer of each tapped layer: ``[max_num_batched_tokens, hidden]``."""
        self.config = config
        self.recorder: StepRecorder | None = (
            StepRecorder([buffers[layer] for layer in config.layers], config.layers)
            if config.layers
            else None
        )
        """Hidden-state rows of the captured layers (None when only probes are tapped)."""
        self.scorer: StepRecorder | None = None
        """Probe scores (None: no probes)."""
        self.clamp_buffers: dict[str, Any] = {}
        """Each clamped SAE's op buffers, by name (:class:`ClampBuffers`)."""
        self.clamped: list[Any] = []
        """The SAEs the clamp ops read (held here: the ops' registry holds them weakly)."""
        self.saes: Any = None
        """The engine's :class:`~probehook.worker.sae_bank.SAEBank`, read at load (None: no
        SAEs)."""
        self.sae_recorder: StepRecorder | None = None
        """SAE features (``"sae"``; None: no SAEs)."""
        self.steer: StepSteering | None = None
        """The steering bank and its per-step tables (None: no layer is steered)."""
        self.banks: dict[str, Any] = {}
        """What :meth:`allocate_banks` allocated at load, for the start-up report."""
        self.on_step: Callable[[], None] | None = None
        self.before_forward: Callable[[Any], None] | None = None
        self.on_schedule: Callable[[Any], None] | None = None
        self.armed = False
        self.steps = 0  # execute_model calls since install_on (for the benchmark)
        self.step_ns = 0  # their wall time
        self.forwards = 0  # of those, the ones the scheduler gave tokens: forward passes
        self.layers_run = 0  # decoder layers the model runs (set at load)
        self.cut: list[str] = []
        """What a capture-only engine does not compute (modules dropped at load)."""

    def allocate_banks(self, banks: WorkerBanks) -> None:
        """Allocate the probe and steering banks and the score and feature recorders, at model
        load (inside vLLM's memory profiling; the SAE bank is read before this)."""
        if banks.probes:
            probes = ProbeBank(banks.probes, self.device)
            self.scorer = StepRecorder(
                [self.buffers[layer] for layer in probes.layers],
                probes.layers,
                transform=probes,
                source="scores",
            )
            self.scorer.keep_step_rows = True  # monitors read this step's scores
        if self.saes is not None:
            self.sae_recorder = StepRecorder(
                [self.buffers[layer] for layer in self.saes.layers],
                self.saes.layers,
                transform=self.saes,
                source="sae",
            )
            self.sae_recorder.keep_step_rows = True  # feature monitors read this step's
        if self.steering is not None:
            tables = self.steering.tables
            bank = SteeringBank(tuple(tables), self.hidden_size, banks.steering_capacity,
                                self.steering.index.device)  # fmt: skip
            for name, vectors in banks.vectors.items():
                bank.add(name, vectors)
            self.steer = StepSteering(bank, tables, self.steering.index)
        self.banks = {
            "probe_outputs": sum(spec.weight.shape[0] for spec in banks.probes),
            "steering_capacity": self.steer.bank.capacity if self.steer is not None else 0,
            "steering_vectors": sorted(banks.vectors) if self.steer is not None else [],
            "saes": list(self.saes.slots) if self.saes is not None else [],
        }

    def recorders(self) -> list[StepRecorder]:
        """Every recorder this worker has: rows, probe scores, SAE features."""
        return [r for r in (self.recorder, self.scorer, self.sae_recorder) if r is not None]

    def install_on(
        self,
        runner: Any,
        on_step: Callable[[], None],
        before_forward: Callable[[Any], None] | None = None,
        on_schedule: Callable[[Any], None] | None = None,
    ) -> None:
        """Patch ``runner`` so that ``on_step`` records once per forward pass;
        ``before_forward`` (steering) is called with the step's scheduler output after the
        runner prepared the batch, right before the model runs; ``on_schedule`` with every
        scheduler output, forward pass or not (one with no tokens may still finish
        requests). Installed once: a second call only replaces the callbacks."""
        self.before_forward = before_forward
        self.on_schedule = on_schedule
        if self.on_step is not None:
            self.on_step = on_step
            return
        self.on_step = on_step
        original = runner.execute_model
        scheduled_now: list[Any] = [None]

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            scheduled = args[0] if args else kwargs.get("scheduler_output")
            scheduled_now[0] = scheduled
            if self.on_schedule is not None and scheduled is not None:
                self.on_schedule(scheduled)
            if getattr(scheduled, "total_num_scheduled_tokens", 0) > 0:
                self.forwards += 1
            self.armed = True
            started = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.armed = False
                scheduled_now[0] = None
                self.steps += 1
                self.step_ns += time.perf_counter_ns() - started

        runner.execute_model = execute_model
        # The V1 runner's override point for the forward call (``_model_forward``): the batch
        # order and query offsets of this step are final there, and warm-up does not pass it.
        model_forward = runner._model_forward

        def _model_forward(*args: Any, **kwargs: Any) -> Any:
            if self.before_forward is not None and scheduled_now[0] is not None:
                self.before_forward(scheduled_now[0])
            return model_forward(*args, **kwargs)

        runner._model_forward = _model_forward

    def fire(self) -> None:
        """Called by the model's ``compute_logits``, or by its pooler for pooling models."""
        if self.armed and self.on_step is not None:
            self.armed = False
            self.on_step()


def _install_logits_hook(model: nn.Module) -> None:
    pooler = getattr(model, "pooler", None)
    if getattr(model, "is_pooling_model", False) and isinstance(pooler, nn.Module):
        # Pooling models never call compute_logits: the runner hands the step's hidden states
        # to the pooler instead (eagerly, outside the compiled graph), once per forward.
        pooler.register_forward_pre_hook(lambda module, args: getattr(model, RECORDER_ATTR).fire())
        return
    original = model.compute_logits

    def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        getattr(model, RECORDER_ATTR).fire()
        return original(hidden_states, *args, **kwargs)

    model.compute_logits = compute_logits


def step_hook(model: nn.Module) -> StepHook:
    """The step hook installed on a worker's model, or a clear error if there is none."""
    hook = getattr(model, RECORDER_ATTR, None)
    if hook is None:
        raise UnsupportedModelError(
            "This worker's model has no probehook taps: the probehook vLLM plugin did not "
            "load (is VLLM_PLUGINS set without 'probehook'?)."
        )
    return hook
