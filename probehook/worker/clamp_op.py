"""The clamp op: holds SAE features of the clamped requests' tokens at given values.

On every token ``t`` of a clamped request, at the SAE's layer, the stream ``x`` becomes
``x + sum_f (v_f - a_f(x)) * W_dec[f]`` over the request's clamped features ``f``, where
``a_f(x)`` is the feature's activation there (SAELens's encode, 0 where it is off): clamping
to 0 removes a feature, to a large value holds it on. Like the steering op it is a
``torch.library.custom_op`` that stays one opaque call in vLLM's compiled graph and reads
fixed buffers the worker writes before each forward pass: ``index`` (each token's row in the
tables, 0: not clamped), ``features`` (``[rows, MAX_CLAMPED]`` feature ids, -1 unused; row 0
all -1) and ``values``. The SAE itself is found by ``key`` in :data:`CLAMPED_SAES` (the
loader puts it there at load, before the first forward pass).

On a CPU only the clamped tokens are encoded, and for every architecture but topk/abstopk only
the clamped features' encoder columns (a step without any clamped token is skipped after one
check); elsewhere every token of the step is encoded in full and the unclamped ones add 0, so
that a CUDA graph replays the same kernels whatever the buffers hold (unverified on a GPU
yet).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from probehook.saes.encode import SAEWeights, activations_at, encode_dense
from probehook.worker.tap_op import OP_NAMESPACE


@dataclass(eq=False)
class ClampedSAE:
    """An SAE a clamp op reads: its encoder and decoder rows ``W_dec [d_sae, d_in]``."""

    weights: SAEWeights
    W_dec: torch.Tensor


CLAMPED_SAES: weakref.WeakValueDictionary[int, ClampedSAE] = weakref.WeakValueDictionary()
"""key -> the SAE of each clamp op in this process; held by its engine's step hook, so it
goes with the engine."""


@torch.library.custom_op(f"{OP_NAMESPACE}::clamp", mutates_args=("hidden",))
def clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    features: torch.Tensor,
    values: torch.Tensor,
    key: int,
) -> None:
    """``hidden[t] += sum_f (values - a_f(hidden[t] + residual[t])) * W_dec[f]`` for the
    step's tokens with ``index[t] > 0`` (``hidden``: ``[tokens, d_in]``; ``residual``: the
    deferred residual of vLLM layers that return ``(hidden, residual)``, or None)."""
    slots = index[: hidden.shape[0]]
    if hidden.device.type == "cpu":
        if not bool(slots.any()):
            return
        rows = slots.nonzero().squeeze(1)
    else:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
    sae = CLAMPED_SAES[key]
    weights, W_dec = sae.weights, sae.W_dec
    stream = hidden.index_select(0, rows)
    if residual is not None:
        stream = stream + residual.index_select(0, rows)
    chosen = features.index_select(0, slots.index_select(0, rows))  # [n, MAX_CLAMPED]
    on = chosen >= 0
    ids = chosen.clamp(min=0)
    if hidden.device.type == "cpu":  # only the clamped features' encoder columns
        wanted, where = torch.unique(ids, return_inverse=True)
        held = activations_at(weights, stream, wanted).gather(1, where)
    else:
        held = encode_dense(weights, stream).gather(1, ids)
    target = values.index_select(0, slots.index_select(0, rows)).to(held.dtype)
    coefficient = torch.where(on, target - held, 0.0)
    delta = torch.einsum("nm,nmd->nd", coefficient, W_dec[ids].to(held.dtype))
    hidden.index_add_(0, rows, delta.to(hidden.dtype))


@clamp.register_fake
def _(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    features: torch.Tensor,
    values: torch.Tensor,
    key: int,
) -> None:
    return None
