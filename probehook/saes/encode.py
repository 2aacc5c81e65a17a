"""The encode equations of SAELens's inference architectures and the top-k readout, in torch
only: what :meth:`probehook.SAE.encode` computes offline and what the worker's SAE bank
computes on each step's rows (one code path, so the two cannot drift apart).

Equations (SAELens 6.x, ``sae_lens/saes/*.py``; x is one row after the layer):

- preprocessing: x cast to the SAE's dtype; ``constant_norm_rescale``: x * sqrt(d_in) / |x|;
  ``layer_norm``: (x - mean) / (unbiased std + 1e-5); then x - b_dec if
  ``apply_b_dec_to_input``;
- ``p = x @ W_enc + b_enc`` (one GEMM), then per architecture:
  standard ReLU(p); jumprelu ReLU(p) * [p > threshold]; gated [x W_enc + b_gate > 0] *
  ReLU(x W_enc * exp(r_mag) + b_mag) (the same GEMM); topk: p scaled by the decoder norms
  when ``rescale_acts_by_decoder_norm``, its k_sae largest entries kept and ReLU'd;
  abstopk: the k_sae entries of largest |p|, signed.

The readout (:func:`read_top_k`): per row the ``k`` largest activations (by |value| for
abstopk), zeros left out (index -1, value 0), in descending order, ties toward the lower
index; and ``l0``, the non-zero count before the cut. Rows are encoded in tiles so that the
dense ``[rows, d_sae]`` pre-activations of a long prompt never exist at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probehook.outputs.top_k import carry_indices, pad_indices

ARCHITECTURES = ("standard", "gated", "jumprelu", "topk", "abstopk")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
TILE_ROWS = 256
"""Rows encoded at once: ``TILE_ROWS * d_sae`` float32 of pre-activations (16 MiB at 16,384
features)."""


@dataclass
class SAEWeights:
    """One SAE's encoder as tensors on one device (``W_enc [d_in, d_sae]``; the decoder only
    where something needs it: its row norms for a rescaling topk, the rows for clamping)."""

    architecture: str
    W_enc: torch.Tensor
    b_enc: torch.Tensor | None
    b_dec: torch.Tensor
    apply_b_dec_to_input: bool
    normalize_activations: str
    threshold: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_mag: torch.Tensor | None = None
    r_mag_exp: torch.Tensor | None = None
    decoder_norms: torch.Tensor | None = None
    """Scales topk pre-activations (``rescale_acts_by_decoder_norm``); None: no rescale."""
    k: int | None = None
    """topk / abstopk: the SAE's own k."""

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The encoder GEMM's input dtype (the weights')."""
        return self.W_enc.dtype

    @property
    def epilogue_dtype(self) -> torch.dtype:
        """Normalisation, biases, activation and top-k: float32 (float64 SAEs keep theirs)."""
        return torch.float64 if self.W_enc.dtype == torch.float64 else torch.float32

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SAEWeights:
        """On ``device``; with ``dtype``, the encoder in ``dtype`` (the GEMM's operands: a
        bfloat16 encoder halves the bytes a decode step reads), the rest in float32."""
        moved = {}
        for name, value in self.__dict__.items():
            if isinstance(value, torch.Tensor):
                if dtype is not None:
                    value = value.to(dtype if name == "W_enc" else torch.float32)
                value = value.to(device)
            moved[name] = value
        return SAEWeights(**moved)


def preprocess(weights: SAEWeights, x: torch.Tensor) -> torch.Tensor:
    """The row as the encoder GEMM reads it (normalised, ``b_dec`` subtracted), in the
    epilogue dtype."""
    x = x.to(weights.epilogue_dtype)
    if weights.normalize_activations == "constant_norm_rescale":
        x = x * (weights.d_in**0.5) / x.norm(dim=-1, keepdim=True)
    elif weights.normalize_activations == "layer_norm":
        x = x - x.mean(dim=-1, keepdim=True)
        x = x / (x.std(dim=-1, keepdim=True) + 1e-5)
    if weights.apply_b_dec_to_input:
        x = x - weights.b_dec
    return x


def pre_activations(weights: SAEWeights, x: torch.Tensor) -> torch.Tensor:
    """``[rows, d_sae]`` pre-activations (SAELens's ``hook_sae_acts_pre``; gated: the gate)."""
    z = _encoder_gemm(weights, x)
    if weights.architecture == "gated":
        return z + weights.b_gate
    p = z + weights.b_enc
    if weights.decoder_norms is not None:
        p = p * weights.decoder_norms
    return p


def _encoder_gemm(weights: SAEWeights, x: torch.Tensor) -> torch.Tensor:
    """``preprocess(x) @ W_enc``: operands in the encoder's dtype, the result in the epilogue
    dtype (the same as the plain product for a float32 SAE)."""
    z = preprocess(weights, x)
    return (z.to(weights.dtype) @ weights.W_enc).to(weights.epilogue_dtype)


def encode_dense(weights: SAEWeights, x: torch.Tensor) -> torch.Tensor:
    """Dense ``[rows, d_sae]`` activations, as SAELens's ``SAE.encode``."""
    arch = weights.architecture
    if arch == "gated":
        z = _encoder_gemm(weights, x)
        magnitude = torch.relu(z * weights.r_mag_exp + weights.b_mag)
        return (z + weights.b_gate > 0).to(magnitude.dtype) * magnitude
    p = pre_activations(weights, x)  # a tensor of its own: the epilogue may work in place
    if arch == "standard":
        return p.relu_()
    if arch == "jumprelu":
        return torch.relu(p) * (p > weights.threshold).to(p.dtype)
    assert weights.k is not None
    k = min(weights.k, weights.d_sae)
    if arch == "topk":
        values, index = p.topk(k, dim=-1, sorted=False)
        return torch.zeros_like(p).scatter_(-1, index, torch.relu(values))
    values, index = p.abs().topk(k, dim=-1, sorted=False)
    return torch.zeros_like(p).scatter_(-1, index, p.gather(-1, index))


def activations_at(weights: SAEWeights, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``encode_dense(weights, x)[:, features]`` (``features``: 1-D feature ids), computing
    only those features' columns where the architecture allows: every one but topk/abstopk,
    whose features are ranked against all the others."""
    arch = weights.architecture
    if arch in ("topk", "abstopk"):
        return encode_dense(weights, x).index_select(1, features)
    z = preprocess(weights, x).to(weights.dtype) @ weights.W_enc.index_select(1, features)
    z = z.to(weights.epilogue_dtype)
    if arch == "gated":
        assert weights.r_mag_exp is not None and weights.b_mag is not None
        assert weights.b_gate is not None
        magnitude = torch.relu(z * weights.r_mag_exp[features] + weights.b_mag[features])
        return (z + weights.b_gate[features] > 0).to(magnitude.dtype) * magnitude
    assert weights.b_enc is not None
    p = z + weights.b_enc[features]
    if arch == "standard":
        return p.relu_()
    assert weights.threshold is not None
    return torch.relu(p) * (p > weights.threshold[features]).to(p.dtype)


def activations_per_token(weights: SAEWeights, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``encode_dense(weights, x).gather(1, ids)``: row ``t``'s activations of its own
    features ``ids[t]`` (``[rows, m]`` feature ids >= 0), reading only those features' encoder
    columns where the architecture allows (topk/abstopk rank every feature: a dense encode).
    Every shape follows ``ids``'s, whatever the ids are: what a CUDA graph replays."""
    arch = weights.architecture
    if arch in ("topk", "abstopk"):
        return encode_dense(weights, x).gather(1, ids)
    flat = ids.reshape(-1)
    columns = weights.W_enc.t().index_select(0, flat).view(*ids.shape, weights.d_in)
    z = preprocess(weights, x).to(weights.dtype).unsqueeze(2)  # [rows, d_in, 1]
    z = torch.bmm(columns, z).squeeze(2).to(weights.epilogue_dtype)  # [rows, m]

    def at(vector: torch.Tensor | None) -> torch.Tensor:
        assert vector is not None
        return vector.index_select(0, flat).view(ids.shape)

    if arch == "gated":
        magnitude = torch.relu(z * at(weights.r_mag_exp) + at(weights.b_mag))
        return (z + at(weights.b_gate) > 0).to(magnitude.dtype) * magnitude
    p = z + at(weights.b_enc)
    if arch == "standard":
        return p.relu_()
    return torch.relu(p) * (p > at(weights.threshold)).to(p.dtype)


def read_top_k(
    weights: SAEWeights, x: torch.Tensor, k: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The readout of every row of ``x`` (``[rows, d_in]``, any float dtype), packed as
    ``[rows, 2k + 1]`` float32: ``k`` feature indices (-1: none), their ``k`` values (0: none),
    and ``l0``; the indices and ``l0`` as int32 bits (``probehook.outputs.top_k.carry_indices``:
    exact).
    Encoded in tiles of
    :data:`TILE_ROWS` rows; written into ``out`` when given."""
    rows = x.shape[0]
    if out is None:
        out = torch.empty((rows, 2 * k + 1), dtype=torch.float32, device=x.device)
    for lo in range(0, rows, TILE_ROWS):
        hi = min(lo + TILE_ROWS, rows)
        _read_tile(weights, x[lo:hi], k, out[lo:hi])
    return out


def _read_tile(weights: SAEWeights, x: torch.Tensor, k: int, out: torch.Tensor) -> None:
    take = min(k, weights.d_sae)
    if weights.architecture in ("topk", "abstopk"):
        # The SAE keeps its own k_sae features: read them straight from its top-k, without
        # the dense tensor encode_dense scatters them into.
        score, index, values, l0 = _own_top_k(weights, x)
        if take < score.shape[1]:
            score, picked = score.topk(take, dim=-1, sorted=False)
            index, values = index.gather(-1, picked), values.gather(-1, picked)
    else:
        dense = encode_dense(weights, x)
        score, index = dense.topk(take, dim=-1, sorted=False)
        values = score
        # > 0 counts the non-zero (non-negative) activations, several times faster than
        # != 0 on a CPU.
        l0 = (dense > 0).sum(dim=-1, dtype=torch.int32)
    # Sorted by lower index first, then a stable descending sort by value: ties keep the
    # lower index first (torch.topk alone promises no order among equal values).
    index, order = index.sort(dim=-1)
    score, values = score.gather(-1, order), values.gather(-1, order)
    score, order = score.sort(dim=-1, descending=True, stable=True)
    index, values = index.gather(-1, order), values.gather(-1, order)
    on = score > 0
    width = index.shape[1]  # under k: an SAE with fewer features (or a smaller k_sae) than k
    out[:, :width] = carry_indices(torch.where(on, index, -1))
    out[:, k : k + width] = torch.where(on, values, 0).to(torch.float32)
    pad_indices(out[:, width:k])
    out[:, k + width : 2 * k] = 0
    out[:, 2 * k] = carry_indices(l0)  # an integer column: its int32 bits, as the indices


def _own_top_k(
    weights: SAEWeights, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A topk / abstopk SAE's own ``k_sae`` features of each row: their rank (the value, or
    |value| for abstopk; 0: off), indices, values and the row's l0, as :func:`encode_dense`
    would give them."""
    assert weights.k is not None
    p = pre_activations(weights, x)
    kept = min(weights.k, weights.d_sae)
    if weights.architecture == "topk":
        values, index = p.topk(kept, dim=-1, sorted=False)
        values = values.relu_()
        score = values
    else:
        score, index = p.abs().topk(kept, dim=-1, sorted=False)
        values = p.gather(-1, index)
    return score, index, values, (score > 0).sum(dim=-1, dtype=torch.int32)
