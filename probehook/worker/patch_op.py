"""Activation patching in the worker (``probehook.outputs.patching``): the write kind
``"patch"``, which puts a row kept from another run back into the stream at one position
(``h <- (1 - alpha) h + alpha h_clean``), and the op ``probehook::keep``, which keeps a run's
rows at a site in the engine's source bank for later cells to read.

Each site of each layer (its input, ``resid_pre``; its output, ``resid_post``) has a writer of
its own (:class:`PatchWriter`), every buffer per token: the ``index`` (the write table's; here
the kept row a token is patched toward, 0: none) and its ``alphas``, ``adds`` (a bank row
added to the token: corruption by noise) and ``keep_index`` (the row of the source bank to
keep the token in, 0: not kept). The source bank (``[rows + 1, hidden]`` float32, row 0 a
scratch row) is one tensor shared by every writer, allocated at load inside vLLM's memory
profiling: the front end (``probehook.frontend.patch_sweep``) decides which rows each run
keeps and which each cell reads, so the worker holds no state of its own between steps.

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
    """Per token: first ``stream += source[adds[t]]`` (a noise row: corruption), then
    ``stream <- (1 - alphas[t]) stream + alphas[t] source[index[t]]`` (a kept row: a cell);
    0 in ``adds`` or ``index``: nothing. The stream is ``hidden + residual``; the change goes
    into ``hidden``."""
    index, alphas, adds, source = tensors
    n = hidden.shape[0]
    rows, added = index[:n], adds[:n]
    picked = None
    if hidden.device.type == "cpu":  # skip the untouched tokens (a GPU computes every one)
        touched = (rows > 0) | (added > 0)
        if not bool(touched.any()):
            return
        picked = touched.nonzero().squeeze(1)
        rows, added = rows.index_select(0, picked), added.index_select(0, picked)
    stream = hidden if picked is None else hidden.index_select(0, picked)
    stream = stream.float()
    if residual is not None:
        stream = stream + (residual if picked is None else residual.index_select(0, picked)).float()
    # Tokens that read nothing read row 0, the keep op's scratch row (any token's stream, an
    # inf among them): select, never multiply by 0, so they get an exact 0.
    noise = torch.where((added > 0).unsqueeze(1), source.index_select(0, added), 0.0)
    noised = stream + noise
    alpha = alphas[:n] if picked is None else alphas.index_select(0, picked)
    lerp = alpha.unsqueeze(1) * (source.index_select(0, rows) - noised)
    delta = (noise + torch.where((rows > 0).unsqueeze(1), lerp, 0.0)).to(hidden.dtype)
    if picked is None:
        hidden.add_(delta)
    else:
        hidden.index_add_(0, picked, delta)


PATCH_TENSORS = 4
"""The buffers a ``"patch"`` term takes: the index (each token's kept row), its alphas, its
added rows and the source bank."""


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
    """One site of one layer. A request's terms there: ``{"cells": [[position, row, alpha],
    ...], "adds": [[position, row], ...]}`` (put kept row ``row`` back at ``position``; add
    bank row ``row``, a noise row, at ``position``) or ``{"keep": base}`` (keep each prompt
    position ``p`` in source row ``base + p``), with the run's nonce (``"run"``: only the
    prefix-cache salt reads it). Every buffer is per token, so one request may patch and add
    at several positions of one site."""

    kind = "patch"

    def __init__(self, layer: int, site: str, source: torch.Tensor, max_tokens: int) -> None:
        self.layer, self.site = layer, site
        device = source.device
        self.buffers = {
            "alphas": torch.zeros(max_tokens, dtype=torch.float32, device=device),
            "adds": torch.zeros(max_tokens, dtype=torch.int64, device=device),
            "source": source,
        }
        self.keep_index: torch.Tensor | None = None
        """``[max_num_batched_tokens]`` int64, set at load (the ``keep`` op's index)."""
        self._written = 0  # adds and keep_index entries [0, _written) may be nonzero

    @property
    def capacity(self) -> int:
        return self.buffers["source"].shape[0] - 1

    def plan(self, terms: Any) -> Any:
        if "keep" in terms:
            return ("keep", int(terms["keep"]))
        cells = {int(p): (int(r), float(a)) for p, r, a in terms.get("cells", ())}
        adds = {int(p): int(r) for p, r in terms.get("adds", ())}
        for row in [r for r, _ in cells.values()] + list(adds.values()):
            if not 1 <= row <= self.capacity:
                raise ValueError(f"source row {row} is outside the bank (1..{self.capacity})")
        return ("patch", cells, adds)

    def write_row(self, row: int, plan: Any) -> None:
        """Nothing per request: every buffer is per token (:meth:`write_tokens`)."""

    def write_tokens(self, slot: int, plan: Any, lo: int, hi: int, first: int) -> bool:
        """A cell's and a corruption's positions that this step computes; a kept run's every
        token (``first``: the absolute position of token ``lo``)."""
        if plan[0] == "keep":
            rows = plan[1] + np.arange(first, first + hi - lo)
            if int(rows[-1]) > self.capacity:
                raise ValueError(
                    f"kept rows up to {int(rows[-1])}, past the bank's {self.capacity}"
                )
            self.keep_index[lo:hi] = torch.from_numpy(rows)
            self._written = max(self._written, hi)
            return True
        _, cells, adds = plan
        wrote = False
        for position, (row, alpha) in cells.items():
            if first <= position < first + hi - lo:
                self.index[lo + position - first] = row
                self.buffers["alphas"][lo + position - first] = alpha
                wrote = True
        for position, row in adds.items():
            if first <= position < first + hi - lo:
                self.buffers["adds"][lo + position - first] = row
                self._written = max(self._written, lo + position - first + 1)
                wrote = True
        return wrote

    def clear(self) -> None:
        if self._written:
            self.keep_index[: self._written].zero_()
            self.buffers["adds"][: self._written].zero_()
            self._written = 0


def patch_writers(
    entry: Any, instances: Mapping[str, Mapping[str, Any]], context: WriterContext
) -> dict[str, PatchWriter]:
    """``Patching.worker_writer``: a writer at each site of each layer, one source bank of
    ``rows`` float32 rows (the engine option's size) shared by all."""
    rows = int(next(iter(instances.values()))["rows"])
    source = torch.zeros((rows + 1, context.hidden_size), dtype=torch.float32,
                         device=context.device)  # fmt: skip
    return {
        name: PatchWriter(int(s["layer"]), str(s["site"]), source, context.max_tokens)
        for name, s in instances.items()
    }
