"""Hugging Face references for steering tests: teacher-forced logprobs and residual streams
with vectors added to the residual stream after chosen decoder layers.

No vLLM import here. One HF model per (model_dir, dtype) is loaded once and reused
(``probehook.testing._hf_model``'s cache), so a test can call these for many requests.

A steering term is ``(layer, vector, scale, start, stop)``: ``scale * vector`` is added to
the output hidden states of decoder layer ``layer`` (the residual stream after it, what
probehook captures as entry ``layer``) at absolute positions ``start <= p < stop``; ``stop``
``None`` means to the end of the sequence.
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


def _steer_hook(terms: list[tuple[torch.Tensor, int, int | None]]):  # noqa: ANN202
    """A forward hook adding every ``(delta, start, stop)`` to the layer's output hidden
    states (``output[0]`` when the layer returns a tuple, else the output itself)."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        length = hidden.shape[1]
        for delta, start, stop in terms:
            end = length if stop is None else min(stop, length)
            if start < end:
                hidden[:, start:end] += delta.to(hidden.dtype)
        if isinstance(output, tuple):
            return (hidden, *output[1:])
        return hidden

    return hook


def _normalise(steering: Sequence[SteeringTerm]) -> dict[int, list]:
    by_layer: dict[int, list] = {}
    for term in steering:
        layer, vector, scale, start, stop = term
        vector = torch.as_tensor(vector, dtype=torch.float32).reshape(-1)
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"bad steering positions start={start} stop={stop}")
        by_layer.setdefault(int(layer), []).append((float(scale) * vector, int(start), stop))
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
    """Terms for a request steered with ``steer`` ``{name: scale}`` from position ``start``
    to ``stop``, where ``vectors`` is ``{name: {layer: vector}}`` (the engine's named
    steering vectors, as plain dicts)."""
    terms: list[SteeringTerm] = []
    for name, scale in steer.items():
        for layer, vector in vectors[name].items():
            terms.append((int(layer), vector, float(scale), start, stop))
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
