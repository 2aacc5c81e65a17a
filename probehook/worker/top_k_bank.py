"""The worker's generic bank of a top-k readout (:class:`~probehook.outputs.top_k_readout.
TopKReadout`): its named instances, each read on the rows of the requests that asked for it
(a selective recorder transform, as the SAE bank), packed ``[indices, values, l0]``.

No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


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
            if asked is None or len(asked) == rows:
                out[slot] = self.readout.read(staged[layer_slot], settings, self.k)
                continue
            out[slot, :, : self.k] = -1  # rows nobody asked this instance for: no entries
            out[slot, :, self.k :] = 0
            if len(asked):
                where = torch.from_numpy(asked).to(device, non_blocking=True)
                picked = staged[layer_slot].index_select(0, where)
                out[slot].index_copy_(0, where, self.readout.read(picked, settings, self.k))
        return out
