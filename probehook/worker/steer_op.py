"""Steering's write kind ``"steer"``: each steered token's terms, in order, on a layer's
residual stream, in place, inside the write op (``probehook.worker.write_op``).

Every op (``probehook.core.steering_ops``: add, ablate, cap, orthogonal, norm_scaled, swap) is
one form, ``h += (a + b (h.u) + c clamp(h.u, lo, hi) + d |h|) w``, so one kernel sequence
applies them all, term after term, each to the row the previous one left. It reads fixed
buffers the worker writes (``probehook.worker.steering_bank``): ``index`` (each token's table
row this step, 0 for "not steered"), the table's ``rows`` (each term's bank row) and
``scalars`` (``[slots, terms, 6]``: ``a, b, c, d, lo, hi``), and the bank's ``units`` and
``writes`` (``u`` and ``w`` by bank row, float32); row 0 and unused terms are zeros (they add
0). Neither the vectors nor the requests are part of the graph, so changing them never
recompiles, and CUDA-graph replay applies whatever the buffers hold at replay time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probehook.worker.write_op import write_kind


def steer(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    rows: torch.Tensor,
    scalars: torch.Tensor,
    units: torch.Tensor,
    writes: torch.Tensor,
) -> None:
    """Apply each token's terms to ``hidden`` (``[tokens, hidden]``, the layer's output; the
    stream is ``hidden + residual`` for vLLM layers that defer the residual add, and adding to
    ``hidden`` adds to it)."""
    slots = index[: hidden.shape[0]]
    terms = rows.shape[1]
    picked = None
    if hidden.device.type == "cpu":
        # On a CPU these checks are microseconds and skip the unsteered tokens and unused
        # terms. On a GPU they would sync the host, and a CUDA graph would freeze the branch
        # taken at capture: there every token runs every term (row 0's add 0).
        if not bool(slots.any()):
            return
        picked = slots.nonzero().squeeze(1)
        slots = slots.index_select(0, picked)
        used = (scalars.index_select(0, slots)[:, :, :4] != 0).any(dim=2).any(dim=0)
        terms = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
    for term in range(terms):
        s = scalars[:, term].index_select(0, slots)  # [n, 6]
        at = rows[:, term].index_select(0, slots)  # [n]: each token's bank row
        w = writes.index_select(0, at)
        if _adds_only(s, hidden):
            delta = s[:, :1] * w
        else:
            stream = _stream(hidden, residual, picked)
            u = units.index_select(0, at)
            along = torch.linalg.vecdot(stream, u).unsqueeze(1)
            capped = torch.minimum(torch.maximum(along, s[:, 4:5]), s[:, 5:6])
            norm = torch.linalg.vector_norm(stream, dim=1, keepdim=True)
            coef = s[:, 0:1] + s[:, 1:2] * along + s[:, 2:3] * capped + s[:, 3:4] * norm
            delta = coef * w
        if picked is None:
            hidden.add_(delta.to(hidden.dtype))
        else:
            hidden.index_add_(0, picked, delta.to(hidden.dtype))


def _adds_only(scalars: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether every row's term is an addition (no projection or norm to compute): checked on
    a CPU only (a GPU computes them regardless, see :func:`steer`)."""
    return hidden.device.type == "cpu" and not bool(scalars[:, 1:4].any())


def _stream(
    hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor | None
) -> torch.Tensor:
    """The stream's rows (all, or ``rows``) in float32."""
    if rows is not None:
        hidden = hidden.index_select(0, rows)
        residual = None if residual is None else residual.index_select(0, rows)
    return hidden.float() if residual is None else hidden.float() + residual.float()


STEER_TENSORS = 5
"""The buffers a ``"steer"`` term takes: the index, the table's rows and scalars, the bank's
units and writes."""


@write_kind("steer")
def steer_term(
    hidden: torch.Tensor, residual: torch.Tensor | None, tensors: Sequence[torch.Tensor], _: str
) -> None:
    steer(hidden, residual, *tensors)
