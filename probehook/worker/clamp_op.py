"""SAE clamping's write kind ``"clamp"``: holds SAE features of the clamped requests' tokens
at given values.

On every token ``t`` of a clamped request, at the SAE's layer, the stream ``x`` becomes
``x + sum_f (v_f - a_f(x)) * W_dec[f]`` over the request's clamped features ``f``, where
``a_f(x)`` is the feature's activation there (SAELens's encode, 0 where it is off): clamping
to 0 removes a feature, to a large value holds it on. It runs inside the write op
(``probehook.worker.write_op``: one opaque call in vLLM's compiled graph, after steering's
additions) and reads fixed buffers the worker writes before each forward pass: ``index``
(each token's row in the tables, 0: not clamped), ``features`` (``[rows, MAX_CLAMPED]``
feature ids, -1 unused; row 0 all -1) and ``values``. The SAE's own tensors are buffers of
the layer too (:func:`sae_tensors`; its architecture and settings are the term's settings,
:func:`sae_spec`), so a compiled graph and a captured CUDA graph read this engine's SAE, never
another's.

On a CPU only the clamped tokens are encoded, and for every architecture but topk/abstopk only
the distinct clamped features' encoder columns (a step without any clamped token is skipped
after one check). Elsewhere (CUDA graphs replay fixed shapes) every token of the step is taken,
in tiles of :data:`~probehook.saes.encode.TILE_ROWS` rows, and each token's own clamped
features alone are encoded (``activations_per_token``: its ``MAX_CLAMPED`` encoder columns;
a dense encode of the tile for topk/abstopk), so the op's memory is bounded by the tile, not
the step, and an unclamped token adds 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from probehook.saes.clamp import MAX_CLAMPED
from probehook.saes.encode import TILE_ROWS, SAEWeights, activations_at, activations_per_token
from probehook.worker.write_op import write_kind
from probehook.worker.write_table import InstanceWriter, WriterContext

TENSORS = ("W_enc", "b_enc", "b_dec", "threshold", "b_gate", "b_mag", "r_mag_exp",
           "decoder_norms")  # fmt: skip
"""The :class:`SAEWeights` tensors the op takes, in order (an empty tensor stands for None)."""


def sae_tensors(weights: SAEWeights) -> list[torch.Tensor]:
    """``weights``'s tensors as the op takes them."""
    empty = weights.W_enc.new_empty(0)
    return [t if t is not None else empty for t in (getattr(weights, n) for n in TENSORS)]


def sae_spec(weights: SAEWeights) -> str:
    """What else of ``weights`` the op needs (a constant of the traced graph)."""
    return f"{weights.architecture}|{int(weights.apply_b_dec_to_input)}|" \
           f"{weights.normalize_activations}|{weights.k or 0}"  # fmt: skip


def weights_of(tensors: list[torch.Tensor], spec: str) -> SAEWeights:
    """The :class:`SAEWeights` the op's arguments describe."""
    architecture, apply_b_dec, normalization, k = spec.split("|")
    named = {n: (t if t.numel() else None) for n, t in zip(TENSORS, tensors, strict=True)}
    return SAEWeights(architecture=architecture, apply_b_dec_to_input=apply_b_dec == "1",
                      normalize_activations=normalization, k=int(k) or None,
                      **named)  # type: ignore[arg-type]  # fmt: skip


CLAMP_TENSORS = 3 + len(TENSORS) + 1
"""The buffers a ``"clamp"`` term of the write op takes: the index, features and values
tables, the SAE's :data:`TENSORS` and its decoder rows."""


@write_kind("clamp")
def clamp_term(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    tensors: Sequence[torch.Tensor],
    spec: str,
) -> None:
    """The write op's ``"clamp"`` kind: :func:`clamp` with its buffers in order and the SAE's
    :func:`sae_spec` as the term's settings."""
    index, features, values = tensors[:3]
    clamp(hidden, residual, index, features, values, list(tensors[3:-1]), tensors[-1], spec)


def clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    features: torch.Tensor,
    values: torch.Tensor,
    sae: list[torch.Tensor],
    W_dec: torch.Tensor,
    spec: str,
) -> None:
    """``hidden[t] += sum_f (values - a_f(hidden[t] + residual[t])) * W_dec[f]`` for the
    step's tokens with ``index[t] > 0`` (``hidden``: ``[tokens, d_in]``; ``residual``: the
    deferred residual of vLLM layers that return ``(hidden, residual)``, or None; ``sae``,
    ``spec``: :func:`sae_tensors`, :func:`sae_spec`; ``W_dec``: ``[d_sae, d_in]``)."""
    slots = index[: hidden.shape[0]]
    on_cpu = hidden.device.type == "cpu"
    if on_cpu:
        if not bool(slots.any()):
            return
        rows = slots.nonzero().squeeze(1)
    else:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
    weights = weights_of(sae, spec)
    for lo in range(0, rows.shape[0], TILE_ROWS):
        tile = rows[lo : lo + TILE_ROWS]
        _clamp_rows(weights, W_dec, hidden, residual, tile, slots, features, values, on_cpu)


def _clamp_rows(
    weights: SAEWeights,
    W_dec: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor,
    features: torch.Tensor,
    values: torch.Tensor,
    distinct_columns: bool,
) -> None:
    """The clamp of ``rows`` (one tile). ``distinct_columns``: encode the distinct clamped
    features' columns for every row (few features, data-dependent shapes: a CPU); else each
    row's own ``MAX_CLAMPED`` columns (fixed shapes)."""
    stream = hidden.index_select(0, rows)
    if residual is not None:
        stream = stream + residual.index_select(0, rows)
    slot = slots.index_select(0, rows)
    chosen = features.index_select(0, slot)  # [n, MAX_CLAMPED]
    on = chosen >= 0
    ids = chosen.clamp(min=0)
    if distinct_columns:
        wanted, where = torch.unique(ids, return_inverse=True)
        held = activations_at(weights, stream, wanted).gather(1, where)
    else:
        held = activations_per_token(weights, stream, ids)
    target = values.index_select(0, slot).to(held.dtype)
    coefficient = torch.where(on, target - held, 0.0)  # [n, MAX_CLAMPED]
    directions = W_dec.index_select(0, ids.reshape(-1)).view(*ids.shape, -1).to(held.dtype)
    delta = torch.bmm(coefficient.unsqueeze(1), directions).squeeze(1)  # [n, d_in]
    hidden.index_add_(0, rows, delta.to(hidden.dtype))


class ClampWriter(InstanceWriter):
    """One clamped SAE's term after its layer: its ``features`` and ``values`` tables (one row
    per request of the step), its SAE's tensors and decoder rows."""

    kind = "clamp"
    site = "resid_post"

    def __init__(self, layer: int, weights: SAEWeights, W_dec: torch.Tensor, slots: int) -> None:
        self.layer = layer
        self.settings = sae_spec(weights)
        device = W_dec.device
        self.buffers = {
            "features": torch.full((slots, MAX_CLAMPED), -1, dtype=torch.int64, device=device),
            "values": torch.zeros((slots, MAX_CLAMPED), dtype=torch.float32, device=device),
            **dict(zip(TENSORS, sae_tensors(weights), strict=True)),
            "W_dec": W_dec,
        }

    def plan(self, terms: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``[[feature, value], ...]`` as the rows' tensors."""
        return (
            torch.tensor([int(f) for f, _ in terms], dtype=torch.int64),
            torch.tensor([float(v) for _, v in terms], dtype=torch.float32),
        )

    def write_row(self, row: int, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        features, values = plan
        n = len(features)
        self.buffers["features"][row].fill_(-1)  # the whole row: a previous request's may be longer
        self.buffers["features"][row, :n] = features
        self.buffers["values"][row, :n] = values


def clamp_writers(
    entry: Any, instances: Mapping[str, Mapping[str, Any]], context: WriterContext
) -> dict[str, ClampWriter]:
    """``SAEClamp.worker_writer``: each clamped SAE's writer, with the weights its readout's
    bank read (``context.banks[source]``)."""
    out = {}
    for name, settings in instances.items():
        bank = context.banks[settings["source"]]
        out[name] = ClampWriter(
            int(settings["layer"]), bank.weights_of(name), bank.decoder_of(name), context.slots
        )
    return out
