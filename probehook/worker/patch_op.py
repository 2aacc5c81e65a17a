"""Activation patching in the worker (``probehook.outputs.patching``): the write kind
``"patch"``, which puts a row kept from another run back into the stream at one position
(``h <- (1 - alpha) h + alpha h_clean``), and the op ``probehook::keep``, which keeps a run's
rows at a site in the engine's source bank for later cells to read.

Each site of each layer (its input, ``resid_pre``; its output, ``resid_post``) has a writer of
its own (:class:`PatchWriter`): the per-token ``index`` (the write table's: the request's row
of the small tables, at the patched position only), ``rows`` (each request's source row) and
``alphas``, and a ``keep_index`` (each token's row of the source bank to keep it in, 0: not
kept). The source bank (``[rows + 1, hidden]`` float32, row 0 a scratch row) is one tensor
shared by every writer, allocated at load inside vLLM's memory profiling: the front end
(``probehook.frontend.patch_sweep``) decides which rows each run keeps and which each cell
reads, so the worker holds no state of its own between steps.

No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from probehook.worker.tap_op import OP_NAMESPACE
from probehook.worker.write_op import write_kind
from probehook.worker.write_table import InstanceWriter, WriterContext


@write_kind("patch")
def patch_term(
    hidden: torch.Tensor, residual: torch.Tensor | None, tensors: Sequence[torch.Tensor], _: str
) -> None:
    """``stream[t] <- (1 - alpha) stream[t] + alpha source[row]`` for the tokens whose index
    names a request's row (``alpha``: that request's; the stream is ``hidden + residual``,
    and the change goes into ``hidden``)."""
    index, rows, alphas, source = tensors
    slots = index[: hidden.shape[0]]
    if hidden.device.type == "cpu":  # skip the unpatched tokens (a GPU computes every one)
        if not bool(slots.any()):
            return
        picked = slots.nonzero().squeeze(1)
        slots = slots.index_select(0, picked)
    else:
        picked = None
    stream = hidden if picked is None else hidden.index_select(0, picked)
    stream = stream.float()
    if residual is not None:
        stream = stream + (residual if picked is None else residual.index_select(0, picked)).float()
    clean = source.index_select(0, rows.index_select(0, slots))
    alpha = alphas.index_select(0, slots).unsqueeze(1)
    # A token that patches nothing reads row 0, the keep op's scratch row (any token's
    # stream, an inf among them): select, never multiply by 0, so it adds an exact 0.
    delta = torch.where(slots.unsqueeze(1) > 0, alpha * (clean - stream), 0.0).to(hidden.dtype)
    if picked is None:
        hidden.add_(delta)
    else:
        hidden.index_add_(0, picked, delta)


PATCH_TENSORS = 4
"""The buffers a ``"patch"`` term takes: the index, rows, alphas and the source bank."""


@torch.library.custom_op(f"{OP_NAMESPACE}::keep", mutates_args=("source",))
def keep(
    hidden: torch.Tensor, residual: torch.Tensor | None, index: torch.Tensor, source: torch.Tensor
) -> None:
    """``source[index[t]] = hidden[t] + residual[t]`` (float32) for the step's tokens; tokens
    kept nowhere write row 0, a scratch row."""
    at = index[: hidden.shape[0]]
    if hidden.device.type == "cpu":
        if not bool(at.any()):
            return
        picked = at.nonzero().squeeze(1)
        rows = hidden.index_select(0, picked).float()
        if residual is not None:
            rows = rows + residual.index_select(0, picked).float()
        source.index_copy_(0, at.index_select(0, picked), rows)
        return
    rows = hidden.float() if residual is None else hidden.float() + residual.float()
    source.index_copy_(0, at, rows)


@keep.register_fake
def _(
    hidden: torch.Tensor, residual: torch.Tensor | None, index: torch.Tensor, source: torch.Tensor
) -> None:
    return None


class PatchWriter(InstanceWriter):
    """One site of one layer: a request's terms there are ``{"cell": [position, row,
    alpha]}`` (patch the row at that position from source row ``row``) or ``{"keep":
    base}`` (keep each prompt position ``p`` in source row ``base + p``), with the run's
    nonce (``"run"``, only the prefix-cache salt reads it)."""

    kind = "patch"

    def __init__(self, layer: int, site: str, source: torch.Tensor, slots: int) -> None:
        self.layer, self.site = layer, site
        device = source.device
        self.buffers = {
            "rows": torch.zeros(slots, dtype=torch.int64, device=device),
            "alphas": torch.zeros(slots, dtype=torch.float32, device=device),
            "source": source,
        }
        self.keep_index: torch.Tensor | None = None
        """``[max_num_batched_tokens]`` int64, set at load (the ``keep`` op's index)."""
        self._kept = 0  # keep_index entries [0, _kept) may be nonzero

    @property
    def capacity(self) -> int:
        return self.buffers["source"].shape[0] - 1

    def plan(self, terms: Any) -> tuple[str, int, int, float]:
        if "cell" in terms:
            position, row, alpha = terms["cell"]
            return ("cell", int(position), int(row), float(alpha))
        return ("keep", 0, int(terms["keep"]), 0.0)

    def write_row(self, row: int, plan: tuple[str, int, int, float]) -> None:
        kind, _, source_row, alpha = plan
        if kind == "cell":
            if not 1 <= source_row <= self.capacity:
                raise ValueError(
                    f"source row {source_row} is outside the bank (1..{self.capacity})"
                )
            self.buffers["rows"][row] = source_row
            self.buffers["alphas"][row] = alpha

    def write_tokens(self, slot: int, plan: Any, lo: int, hi: int, first: int) -> bool:
        """A cell's patched position alone (if this step computes it); a kept run's every
        token (``first``: the absolute position of token ``lo``)."""
        kind, position, base, _ = plan
        if kind == "cell":
            if first <= position < first + (hi - lo):
                self.index[lo + position - first] = slot
                return True
            return False
        rows = base + np.arange(first, first + hi - lo)
        if int(rows[-1]) > self.capacity:
            raise ValueError(f"kept rows up to {int(rows[-1])}, past the bank's {self.capacity}")
        self.keep_index[lo:hi] = torch.from_numpy(rows)
        self._kept = max(self._kept, hi)
        return True

    def clear(self) -> None:
        if self._kept:
            self.keep_index[: self._kept].zero_()
            self._kept = 0


def patch_writers(
    entry: Any, instances: Mapping[str, Mapping[str, Any]], context: WriterContext
) -> dict[str, PatchWriter]:
    """``Patching.worker_writer``: a writer at each site of each layer, one source bank of
    ``rows`` float32 rows (the engine option's size) shared by all."""
    rows = int(next(iter(instances.values()))["rows"])
    source = torch.zeros((rows + 1, context.hidden_size), dtype=torch.float32,
                         device=context.device)  # fmt: skip
    return {
        name: PatchWriter(int(s["layer"]), str(s["site"]), source, context.slots)
        for name, s in instances.items()
    }
