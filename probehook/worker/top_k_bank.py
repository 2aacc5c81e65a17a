"""The worker's generic bank of a top-k readout (:class:`~probehook.outputs.top_k_readout.
TopKReadout`): its named instances, each read on the rows of the requests that asked for it
(a selective recorder transform, as the SAE bank), packed ``[indices, values, l0]``.

No vLLM imports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch


def read_selected(
    out: torch.Tensor,
    k: int,
    rows: torch.Tensor,
    asked: np.ndarray | None,
    read: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """``out`` (``[n, 2k + 1]``) = ``read`` of the rows ``asked`` (None: of every row);
    the other rows are padding (no entry: -1, 0, l0 0), which no request reads."""
    if asked is None or len(asked) == rows.shape[0]:
        out.copy_(read(rows))
        return
    out[:, :k] = -1
    out[:, k:] = 0
    if len(asked):
        where = torch.from_numpy(asked).to(rows.device, non_blocking=True)
        out.index_copy_(0, where, read(rows.index_select(0, where)))


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
        self.width = 2 * self.k + 1
        self.layers = tuple(sorted({int(s["layer"]) for s in instances.values()}))
        self._instances = [(self.layers.index(int(s["layer"])), s) for s in instances.values()]

    def __call__(
        self,
        staged: torch.Tensor | Sequence[torch.Tensor],
        slot_rows: Sequence[np.ndarray] | None = None,
    ) -> torch.Tensor:
        rows = staged[0].shape[0]
        device = staged[0].device
        out = torch.empty((len(self.slots), rows, self.width), dtype=self.dtype, device=device)
        for slot, (layer_slot, settings) in enumerate(self._instances):
            asked = None if slot_rows is None else slot_rows[slot]
            read = functools.partial(self.readout.read, settings=settings, k=self.k)
            read_selected(out[slot], self.k, staged[layer_slot], asked, read)
        return out
