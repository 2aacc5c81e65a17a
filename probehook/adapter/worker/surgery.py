"""Model surgery at load: where a vLLM model keeps its decoder layers, the taps and the write op
(steering's additions, SAE clamps) hooked onto them (before vLLM compiles the model, so they
are traced into its graph), the logits/pooler hook that fires the step hook once per forward
pass, and the early exit of capture-only engines."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
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
from probehook.errors import UnsupportedModelError
from probehook.worker.patch_op import keep  # registers the "patch" kind too
from probehook.worker.steer_op import STEER_TENSORS  # noqa: F401 - registers "steer"
from probehook.worker.steering_bank import SteerTable, bank_tensors
from probehook.worker.tap_op import tap
from probehook.worker.write_op import write, write_spec
from probehook.worker.write_table import InstanceWriter

logger = logging.getLogger(__name__)

RECORDER_ATTR = "probehook_step_hook"

TAP_KIND_ATTR = "probehook_tap_kind"
"""Layer attribute: how to read the layer's output (see ``_tap_hook``)."""

WRITE_TERMS_ATTR = {"resid_post": "probehook_write_terms", "resid_pre": "probehook_write_pre"}
"""Layer attributes, by site: the terms its write op applies after the layer (on its output)
or before it (on its input), in order: ``(kind, the names of its buffers on the layer, the
layer attribute holding its settings or None)``."""

KEEP_ATTR = {"resid_post": "probehook_keep_post", "resid_pre": "probehook_keep_pre"}
"""Layer attributes, by site: the ``probehook::keep`` ops after its write op there (activation
patching's kept rows), ``(index buffer name, source buffer name)`` each."""

INPUT_AT_ATTR = "probehook_input_at"
"""Layer attribute: where its forward takes the stream, ``((position, "hidden_states"),
(position, "residual") or None)``, read from its signature when a ``resid_pre`` term is
installed."""


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
    parent = decoder_of(model)
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


def decoder_of(model: nn.Module) -> Any:
    """The module that holds the decoder layers (and the final norm)."""
    path, _ = locate_layers(model)
    parent: Any = model
    for part in path.split(".")[:-1]:
        parent = getattr(parent, part)
    if is_transformers_backend(model):
        parent = parent.get_decoder() if hasattr(parent, "get_decoder") else parent
    return parent


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
    steer_capacity: int = 0,
) -> Any:
    """Add a tap after each layer in ``tap_layers``, steering's buffers on each layer in
    ``steer_layers`` (its write term comes with :func:`install_steering`, after the write
    table's), and a per-step hook; return the hook.

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
        steering = _steering_buffers(layer_list, steer_layers, steer_slots, steer_capacity,
                                     max_tokens, hidden_size, param.device)  # fmt: skip
    buffers = {}
    for layer_index in tap_layers:
        layer = layer_list[layer_index]
        buf = torch.zeros((max_tokens, hidden_size), dtype=param.dtype, device=param.device)
        # A non-persistent buffer is part of the module, so torch.compile sees the mutation.
        layer.register_buffer("probehook_tap_out", buf, persistent=False)
        layer.register_forward_hook(_tap_hook)
        buffers[layer_index] = layer.probehook_tap_out
    from probehook.adapter.worker.step_hook import StepHook

    hook = StepHook(buffers, config, steering, hidden_size, param.dtype, param.device)
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


QUERY_BUFFER = "probehook_query"
"""The buffer of an attention module whose query is tapped (``[max tokens, heads x head
size]``, the step's post-RoPE query rows)."""


def install_query_taps(model: nn.Module, layers: Sequence[int], max_tokens: int) -> dict:
    """Tap the query at the input of each of ``layers``' attention op (the ``attn_q`` site:
    after RoPE and any QK norm, as the kernel reads it): a forward pre-hook on the layer's
    vLLM ``Attention`` module, traced into the compiled graph like the residual taps. Returns
    each layer's buffer. A layer whose attention probehook would not read as its kernel forms
    it is refused here, at load (``check_readable``)."""
    from probehook.adapter.worker.kv_cache import attention_of, check_readable

    _, layer_list = locate_layers(model)
    param = next(model.parameters())
    buffers = {}
    for index in layers:
        attention = attention_of(layer_list[index])
        check_readable(attention, loading=True)
        width = attention.num_heads * attention.head_size
        buffer = torch.zeros((max_tokens, width), dtype=param.dtype, device=param.device)
        attention.register_buffer(QUERY_BUFFER, buffer, persistent=False)
        attention.register_forward_pre_hook(_query_hook, with_kwargs=True)
        buffers[index] = getattr(attention, QUERY_BUFFER)
    return buffers


def _query_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    query = args[0] if args else kwargs["query"]
    tap(query.flatten(1) if query.dim() == 3 else query, None, getattr(module, QUERY_BUFFER))


def install_writes(
    model: nn.Module, writers: dict[tuple[str, str], InstanceWriter], max_tokens: int
) -> None:
    """Add each intervention instance's term to its layer's write op at its site, after the
    terms there before it (steering's, at ``resid_post``): its per-token index (allocated
    here, the writer's ``index``) and its buffers become buffers of the layer (the compiled
    graph reads them as inputs), its settings a constant of the traced graph."""
    _, layer_list = locate_layers(model)
    for number, ((option, instance), writer) in enumerate(writers.items()):
        if not 0 <= writer.layer < len(layer_list):
            raise UnsupportedModelError(
                f"{option}[{instance!r}] writes at layer {writer.layer}, but the model has "
                f"{len(layer_list)} decoder layers in this worker."
            )
        layer = layer_list[writer.layer]
        device = next(iter(writer.buffers.values()), next(model.parameters())).device
        prefix = f"probehook_w{number}_"
        named = {"index": torch.zeros(max_tokens, dtype=torch.int64, device=device),
                 **writer.buffers}  # fmt: skip
        for name, tensor in named.items():
            layer.register_buffer(prefix + name, tensor, persistent=False)
        writer.index = getattr(layer, prefix + "index")
        if hasattr(writer, "keep_index"):  # it keeps rows too: a keep op after the write op
            keeps = torch.zeros(max_tokens, dtype=torch.int64, device=device)
            layer.register_buffer(prefix + "keep_index", keeps, persistent=False)
            writer.keep_index = getattr(layer, prefix + "keep_index")
            kept = getattr(layer, KEEP_ATTR[writer.site], None)
            if kept is None:
                kept = []
                setattr(layer, KEEP_ATTR[writer.site], kept)
            kept.append((prefix + "keep_index", prefix + "source"))
        setattr(layer, prefix + "settings", writer.settings)
        _add_write_term(layer, writer.kind, [prefix + n for n in named], prefix + "settings",
                        site=writer.site)  # fmt: skip
        logger.info("probehook: %s[%r] writes at %s(%d)", option, instance, writer.site,
                    writer.layer)  # fmt: skip


def _add_write_term(
    layer: nn.Module,
    kind: str,
    buffers: Sequence[str],
    settings: str | None = None,
    site: str = "resid_post",
) -> None:
    """Append a term to the layer's write op at ``site`` (after the terms before it),
    installing the op's hook with the first term: after the layer, before every tap of it
    (taps read the written stream); before the layer, on its input."""
    attribute = WRITE_TERMS_ATTR[site]
    terms = getattr(layer, attribute, None)
    if terms is None:
        terms = []
        setattr(layer, attribute, terms)
        if site == "resid_post":
            layer.register_forward_hook(_write_hook, prepend=True)
        else:
            setattr(layer, INPUT_AT_ATTR, _input_at(layer))
            layer.register_forward_pre_hook(_write_pre_hook, with_kwargs=True)
    terms.append((kind, tuple(buffers), settings))


def _input_at(layer: nn.Module) -> tuple[tuple[int, str], tuple[int, str] | None]:
    """Where ``layer.forward`` takes the stream: its ``hidden_states`` argument and, for layers
    that defer the residual add, its ``residual`` (positions counted without ``self``)."""
    names = list(inspect.signature(layer.forward).parameters)
    if "hidden_states" not in names:
        raise UnsupportedModelError(
            f"{type(layer).__name__}.forward{tuple(names)} takes no hidden_states argument: "
            "probehook cannot write at its input (resid_pre). Write at the previous layer's "
            "output (resid_post) instead."
        )
    residual = (names.index("residual"), "residual") if "residual" in names else None
    return (names.index("hidden_states"), "hidden_states"), residual


def _argument(args: tuple, kwargs: dict, at: tuple[int, str]) -> Any:
    return args[at[0]] if len(args) > at[0] else kwargs.get(at[1])


def _op_arguments(module: nn.Module, attribute: str) -> tuple[list[torch.Tensor], str]:
    """A site's terms' buffers (the compiled graph reads them as inputs) and their spec (a
    constant of the traced graph)."""
    terms = getattr(module, attribute)
    tensors = [getattr(module, name) for _, names, _ in terms for name in names]
    spec = write_spec([(kind, len(names), getattr(module, settings) if settings else "")
                       for kind, names, settings in terms])  # fmt: skip
    return tensors, spec


def _write_hook(module: nn.Module, args: Any, output: Any) -> None:
    """The layer's write op on its output, in place (so the hook returns nothing and the
    layer's output objects stay as they are)."""
    tensors, spec = _op_arguments(module, WRITE_TERMS_ATTR["resid_post"])
    if getattr(module, TAP_KIND_ATTR, None) == "batched_stream":
        stream = output[0] if isinstance(output, tuple) else output
        hidden, residual = _tokens_first(stream), None
    else:
        hidden, residual = _split_layer_output(output)
    write(hidden, residual, tensors, spec)
    _keep(module, "resid_post", hidden, residual)


def _write_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The layer's write op on its input, in place: the stream is ``hidden_states`` (plus the
    deferred ``residual`` where the layer takes one; layer 0's is None: the embeddings)."""
    tensors, spec = _op_arguments(module, WRITE_TERMS_ATTR["resid_pre"])
    hidden_at, residual_at = getattr(module, INPUT_AT_ATTR)
    residual = _argument(args, kwargs, residual_at) if residual_at is not None else None
    hidden = _tokens_first(_argument(args, kwargs, hidden_at))
    residual = None if residual is None else _tokens_first(residual)
    write(hidden, residual, tensors, spec)
    _keep(module, "resid_pre", hidden, residual)


def _keep(module: nn.Module, site: str, hidden: torch.Tensor, residual: Any) -> None:
    """The site's ``probehook::keep`` ops (activation patching), after its write op."""
    for index, source in getattr(module, KEEP_ATTR[site], ()):
        keep(hidden, residual, getattr(module, index), getattr(module, source))


@dataclass
class SteeringBuffers:
    """The steering op's buffers in one worker: the per-token slot index (shared by every
    steered layer), each steered layer's table and bank (``(units, writes)``), and the
    layers' modules (:func:`install_steering` adds their terms)."""

    index: torch.Tensor
    tables: dict[int, SteerTable]
    banks: dict[int, tuple[torch.Tensor, torch.Tensor]]
    capacity: int
    modules: dict[int, nn.Module]


STEER_BUFFERS = ("probehook_steer_index", "probehook_steer_rows", "probehook_steer_scalars",
                 "probehook_steer_units", "probehook_steer_writes")  # fmt: skip
"""A steered layer's buffers, in the order the ``"steer"`` write kind takes them."""


def _steering_buffers(
    layer_list: Sequence[nn.Module],
    steer_layers: Sequence[int],
    slots: int,
    capacity: int,
    max_tokens: int,
    hidden_size: int,
    device: torch.device,
) -> SteeringBuffers:
    """Allocate steering's index, tables and banks as buffers of the steered layers (the
    compiled graph reads them as inputs)."""
    index = torch.zeros(max_tokens, dtype=torch.int64, device=device)
    tables, banks, modules = {}, {}, {}
    for layer_index in steer_layers:
        layer = layer_list[layer_index]
        table = SteerTable.allocate(slots, device)
        units, writes = bank_tensors(capacity, slots, hidden_size, device)
        for name, tensor in zip(STEER_BUFFERS, (index, table.rows, table.scalars, units, writes),
                                strict=True):  # fmt: skip
            layer.register_buffer(name, tensor, persistent=False)
        tables[layer_index] = table
        banks[layer_index] = (units, writes)
        modules[layer_index] = layer
    return SteeringBuffers(index, tables, banks, capacity, modules)


def install_steering(steering: SteeringBuffers | None) -> None:
    """Steering's term at each steered layer's output: after the write table's terms there (an
    SAE clamp holds its features first, then the steering ops apply), before the taps."""
    for layer in steering.modules.values() if steering is not None else ():
        _add_write_term(layer, "steer", STEER_BUFFERS)


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


def step_hook(model: nn.Module) -> Any:
    """The step hook installed on a worker's model, or a clear error if there is none."""
    hook = getattr(model, RECORDER_ATTR, None)
    if hook is None:
        raise UnsupportedModelError(
            "This worker's model has no probehook taps: the probehook vLLM plugin did not "
            "load (is VLLM_PLUGINS set without 'probehook'?)."
        )
    return hook
