"""Hugging Face references for steering tests: teacher-forced logprobs and residual streams
with vectors added to the residual stream after chosen decoder layers.

No vLLM import here. One HF model per (model_dir, dtype) is loaded once and reused
(``probehook.testing._hf_model``'s cache), so a test can call these for many requests.

A steering term is ``(layer, vector, scale, start, stop)``: ``scale * vector`` is added to
the output hidden states of decoder layer ``layer`` (the residual stream after it, what
probehook captures as entry ``layer``) at absolute positions ``start <= p < stop``; ``stop``
``None`` means to the end of the sequence. A sixth element ``(op, params, to)`` applies
another op instead (:func:`apply_op`, the formulas of ``docs/steering.md`` written out in
float64); a layer's terms apply in order, each to the row the previous one left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from probehook.testing import _hf_model

SteeringTerm = tuple[int, torch.Tensor, float, int, int | None]
"""``(layer, vector [hidden], scale, start, stop)``."""


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The decoder-layer list of an HF causal LM (Llama-type ``model.model.layers``, GPT-2's
    ``transformer.h``, GPT-NeoX's ``gpt_neox.layers``, OPT's ``model.decoder.layers``)."""
    base = model.base_model
    for path in ("layers", "h", "decoder.layers"):
        module: Any = base
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"no decoder layers found on {type(base).__name__}")


def apply_op(
    h: torch.Tensor,
    op: str,
    params: Mapping[str, Any],
    v: torch.Tensor,
    scale: float,
    to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``h`` ``[..., hidden]`` after one op, in float64, straight from the table of
    ``docs/steering.md`` (``u = v / |v|``, ``s`` the scale)."""
    h, v, s = h.double(), v.double(), float(scale)
    if op == "add":
        return h + s * v
    u = v / v.norm()
    along = (h * u).sum(-1, keepdim=True)
    if op == "ablate":
        return h - s * along * u
    if op == "cap":
        lo = -torch.inf if params.get("min") is None else params["min"]
        hi = torch.inf if params.get("max") is None else params["max"]
        return h + s * (along.clamp(lo, hi) - along) * u
    if op == "orthogonal":
        return h + (s - 1) * along * u
    if op == "norm_scaled":
        return h + s * h.norm(dim=-1, keepdim=True) * u
    if op == "swap":
        u_to = to.double() / to.double().norm()
        return h + s * along * (u_to - u)
    raise ValueError(f"unknown op {op!r}")


def _steer_hook(terms: list[tuple[Any, ...]]):  # noqa: ANN202
    """A forward hook applying every ``(delta, start, stop[, (op, params, to, vector,
    scale)])`` in order to the layer's output hidden states (``output[0]`` when the layer
    returns a tuple, else the output itself)."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        length = hidden.shape[1]
        for delta, start, stop, *op in terms:
            end = length if stop is None else min(stop, length)
            if start >= end:
                continue
            if op:
                name, params, to, vector, scale = op[0]
                rows = hidden[:, start:end]
                hidden[:, start:end] = apply_op(rows, name, params, vector, scale, to).to(
                    hidden.dtype
                )
            else:
                hidden[:, start:end] += delta.to(hidden.dtype)
        if isinstance(output, tuple):
            return (hidden, *output[1:])
        return hidden

    return hook


def _normalise(steering: Sequence[SteeringTerm]) -> dict[int, list]:
    by_layer: dict[int, list] = {}
    for term in steering:
        layer, vector, scale, start, stop, *op = term
        vector = torch.as_tensor(vector, dtype=torch.float32).reshape(-1)
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"bad steering positions start={start} stop={stop}")
        entry: tuple[Any, ...] = (float(scale) * vector, int(start), stop)
        if op and op[0][0] != "add":
            name, params, to = op[0]
            entry = (*entry, (name, params, to, vector, float(scale)))
        by_layer.setdefault(int(layer), []).append(entry)
    return by_layer


def _steered_forward(
    model_dir: str | Path,
    token_ids: Sequence[int],
    steering: Sequence[SteeringTerm],
    dtype: torch.dtype,
    tap_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logits ``[T, vocab]`` of one teacher-forced forward with the steering hooks on, and the
    (steered) residual stream after every layer in ``tap_layers`` ``{layer: [T, H]}``."""
    model = _hf_model(str(model_dir), dtype)
    layers = _decoder_layers(model)
    handles = []
    taps: dict[int, torch.Tensor] = {}
    try:
        for layer, terms in _normalise(steering).items():
            if not 0 <= layer < len(layers):
                raise ValueError(f"layer {layer} is not in 0..{len(layers) - 1}")
            handles.append(layers[layer].register_forward_hook(_steer_hook(terms)))
        for layer in tap_layers:
            # registered after the steering hook, so it sees the steered output

            def tap(_m: Any, _a: Any, output: Any, layer: int = layer) -> None:
                hidden = output[0] if isinstance(output, tuple) else output
                taps[layer] = hidden[0].detach().float().clone()

            handles.append(layers[layer].register_forward_hook(tap))
        with torch.no_grad():
            out = model(torch.tensor([list(token_ids)]))
    finally:
        for handle in handles:
            handle.remove()
    return out.logits[0].float(), taps


def hf_steered_logprobs(
    model_dir: str | Path,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    steering: Sequence[SteeringTerm] = (),
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Teacher-forced HF logprobs of ``output_ids`` after ``prompt_ids``, under ``steering``.

    The forward runs over ``prompt_ids + output_ids[:-1]`` (the tokens vLLM fed the model);
    entry ``i`` is the log-softmax of the logits at position ``len(prompt_ids) - 1 + i``,
    taken at ``output_ids[i]`` (vLLM's raw logprob of a sampled token).
    """
    prompt, output = list(prompt_ids), list(output_ids)
    if not prompt or not output:
        raise ValueError("need a non-empty prompt and at least one output token")
    logits, _ = _steered_forward(model_dir, prompt + output[:-1], steering, dtype)
    logprobs = torch.log_softmax(logits[len(prompt) - 1 :].double(), dim=-1)
    return [float(logprobs[i, token]) for i, token in enumerate(output)]


def hf_steered_stream(
    model_dir: str | Path,
    token_ids: Sequence[int],
    steering: Sequence[SteeringTerm] = (),
    layers: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[int, torch.Tensor]:
    """The residual stream ``{layer: [T, H]}`` after each layer in ``layers`` (default: every
    steered layer), steering included, for the tokens ``token_ids``."""
    if layers is None:
        layers = sorted({int(term[0]) for term in steering})
    _, taps = _steered_forward(model_dir, token_ids, steering, dtype, tap_layers=layers)
    return taps


def steering_terms(
    vectors: Mapping[str, Mapping[int, torch.Tensor]],
    steer: Mapping[str, float],
    start: int,
    stop: int | None = None,
) -> list[SteeringTerm]:
    """Terms for a request steered with ``steer`` ``{name: scale}`` (in that order) from
    position ``start`` to ``stop``, where ``vectors`` is ``{name: {layer: vector}}`` (the
    engine's named steering vectors, as plain dicts) or ``{name: SteeringVector}`` (its op
    too)."""
    terms: list[SteeringTerm] = []
    for name, scale in steer.items():
        vector = vectors[name]
        if hasattr(vector, "op"):  # a SteeringVector
            to = vector.swap_to
            for layer, direction in vector.vectors.items():
                op = (vector.op, vector.op_params, to.get(layer))
                terms.append((int(layer), direction, float(scale), start, stop, op))  # type: ignore[arg-type]
            continue
        for layer, direction in vector.items():
            terms.append((int(layer), direction, float(scale), start, stop))
    return terms


def phase_span(phase: str, prompt_len: int) -> tuple[int, int | None]:
    """Absolute positions ``(start, stop)`` a ``steer_phase`` covers for a prompt of
    ``prompt_len`` tokens: prefill = the prompt, decode = generated tokens fed back, both."""
    if phase == "prefill":
        return 0, prompt_len
    if phase == "decode":
        return prompt_len, None
    if phase == "both":
        return 0, None
    raise ValueError(f"steer_phase {phase!r} is not prefill, decode or both")
