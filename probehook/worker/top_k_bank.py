"""The worker's generic bank of a top-k readout (:class:`~probehook.outputs.top_k_readout.
TopKReadout`): its named instances, each read on the rows of the requests that asked for it
(a selective recorder transform, as the SAE bank), packed by its column schema
(``[indices, values, l0]`` and any further columns).

No vLLM imports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from probehook.worker.on_device import on_device


def read_selected(
    out: torch.Tensor,
    pad: Callable[[torch.Tensor], None],
    rows: torch.Tensor,
    asked: np.ndarray | None,
    read: Callable[..., torch.Tensor],
    next_tokens: torch.Tensor | None = None,
) -> None:
    r"""``out`` (``[n, width]``) = ``read`` of the rows ``asked`` (None: of every row); the
    other rows are ``pad``\ ded (no entry: -1, 0, l0 0), which no request reads. A reading
    narrower than ``out`` (an instance with fewer heads than another) fills its first
    columns. ``next_tokens`` (``[n]``, a readout that ``reads_next_token``): each row's next
    token, handed to ``read`` with the rows it belongs to."""
    if asked is None or len(asked) == rows.shape[0]:
        got = read(rows) if next_tokens is None else read(rows, next_tokens=next_tokens)
        if got.shape[1] < out.shape[1]:
            out[:, got.shape[1] :] = 0
        out[:, : got.shape[1]].copy_(got)
        return
    pad(out)
    if len(asked):
        where = on_device(asked, rows.device)
        picked = rows.index_select(0, where)
        if next_tokens is None:
            got = read(picked)
        else:
            got = read(
                picked, next_tokens=next_tokens.index_select(0, where.to(next_tokens.device))
            )
        out[:, : got.shape[1]].index_copy_(0, where, got)


class TopKBank:
    """One readout's instances in one worker, callable on a recorder's staged rows (in
    :attr:`layers` order): returns ``[len(slots), rows, 2k + 1]`` float32."""

    dtype = torch.float32
    selective = True
    """The recorder hands it each instance's rows (``slot_rows``)."""

    def __init__(self, readout: Any, instances: Mapping[str, Mapping[str, Any]], k: int) -> None:
        if not instances:
            raise ValueError("a TopKBank needs at least one instance")
        self.readout = readout
        self.slots = tuple(instances)
        """The instance names, in the order of the output's first dimension."""
        self.k = int(k)
        self.width = max(readout.packed_width(s, self.k) for s in instances.values())
        """The packed rows' width: the widest instance's (the column schema's)."""
        self.layers = tuple(sorted({int(s["layer"]) for s in instances.values()}))
        self._instances = [(self.layers.index(int(s["layer"])), s) for s in instances.values()]
        self._entries = [readout.entries(s, self.k) for s in instances.values()]
        self._pending: tuple[np.ndarray, list[torch.Tensor], Any] | None = None
        self.reads_next_token = bool(readout.reads_next_token)
        """Its rows complete after the step's sampling, with each row's next token (the
        recorder defers them; :meth:`__call__` gets ``next_tokens``)."""

    def entries(self, slot: int) -> int:
        """How many entries (indices, then as many values) lead slot ``slot``'s packed rows:
        ``k`` times its lead axes' sizes (what the stop processor reads)."""
        return self._entries[slot]

    def __call__(
        self,
        staged: torch.Tensor | Sequence[torch.Tensor],
        slot_rows: Sequence[np.ndarray] | None = None,
        next_tokens: torch.Tensor | None = None,
        unknown: np.ndarray | None = None,
    ) -> torch.Tensor:
        """``unknown``: where in the rows the next token waits for this step's sampling (the
        step context's, on the host; None: read from ``next_tokens`` on the device)."""
        rows = staged[0].shape[0]
        device = staged[0].device
        out = torch.empty((len(self.slots), rows, self.width), dtype=self.dtype, device=device)
        for slot, (layer_slot, settings) in enumerate(self._instances):
            asked = None if slot_rows is None else slot_rows[slot]
            read = functools.partial(self.readout.read, settings=settings, k=self.k)
            pad = functools.partial(self.readout.pad_packed, settings=settings, k=self.k)
            read_selected(out[slot], pad, staged[layer_slot], asked, read, next_tokens)
        self._pending = None
        if next_tokens is not None:
            if unknown is None:  # no step context: asked of the device (one sync)
                unknown = (next_tokens < 0).nonzero().squeeze(1).cpu().numpy()
            self._hold_unknown(staged, slot_rows, unknown)
        return out

    def _hold_unknown(
        self,
        staged: torch.Tensor | Sequence[torch.Tensor],
        slot_rows: Sequence[np.ndarray] | None,
        unknown: np.ndarray,
    ) -> None:
        """Keep (copies of) the rows read before their next token was drawn (``unknown``: a
        request's newest position), for :meth:`complete` to read again once sampling drew
        it."""
        if not len(unknown):
            return
        where = on_device(unknown, staged[0].device)
        rows = [layer.index_select(0, where) for layer in staged]
        self._pending = (unknown, rows, slot_rows)

    def complete(
        self, out: torch.Tensor, next_tokens: Callable[[np.ndarray], torch.Tensor] | None
    ) -> None:
        """Read again, with their next tokens, the rows :meth:`__call__` read without them
        (``out``: what it returned; ``next_tokens``: rows of the step's block -> their tokens,
        -1 where none came; None: none known, the rows stay as read)."""
        pending, self._pending = self._pending, None
        if pending is None or next_tokens is None:
            return
        unknown, rows, slot_rows = pending
        tokens = next_tokens(unknown)
        for slot, (layer_slot, settings) in enumerate(self._instances):
            mine = np.arange(len(unknown))
            if slot_rows is not None:  # the unknown rows this instance was asked for
                mine = np.flatnonzero(np.isin(unknown, slot_rows[slot]))
            if not len(mine):
                continue
            at = on_device(mine, rows[layer_slot].device)
            read = self.readout.read(
                rows[layer_slot].index_select(0, at), settings, self.k,
                next_tokens=tokens.index_select(0, at.to(tokens.device)),
            )  # fmt: skip
            where = on_device(unknown[mine], out.device)
            out[slot, :, : read.shape[1]].index_copy_(0, where, read)


def generic_bank(
    readout: Any, instances: Mapping[str, Mapping[str, Any]], k: int, model: Any
) -> TopKBank:
    """The default ``TopKReadout.worker_bank``: each instance's ``read`` on the rows of the
    requests that asked for it."""
    return TopKBank(readout, instances, k)
