"""The worker's bank of the attention readout (``probehook.outputs.attention``): for each
layer the readout reads, the rows of the requests that asked, their query (the ``attn_q`` tap)
against the keys each sees in the layer's paged cache, per head
(:func:`~probehook.worker.attention_rows.head_readings`), packed by the readout's column
schema. The keys and the kernel's terms come from the step's context
(``StepContext.parts["attention"]``, the adapter's reader), so nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from probehook.worker.attention_rows import head_readings
from probehook.worker.top_k_bank import TopKBank


class AttentionBank(TopKBank):
    """One layer an instance; callable on a recorder's staged query rows with the step's
    context (``reads_step``): returns ``[len(slots), rows, width]`` float32."""

    site = "attn_q"
    reads_step = True

    def __call__(
        self,
        staged: torch.Tensor | Sequence[torch.Tensor],
        slot_rows: Sequence[np.ndarray] | None = None,
        context: Any = None,
        step_rows: np.ndarray | None = None,
    ) -> torch.Tensor:
        if context is None or step_rows is None:
            raise ValueError("the attention bank reads the step's context: none was given")
        rows = staged[0].shape[0]
        device = staged[0].device
        out = torch.empty((len(self.slots), rows, self.width), dtype=self.dtype, device=device)
        reader = context.parts["attention"]
        for slot, (layer_slot, settings) in enumerate(self._instances):
            self.readout.pad_packed(out[slot], settings, self.k)
            asked = np.arange(rows) if slot_rows is None else slot_rows[slot]
            if len(asked):
                self._read(out[slot], staged[layer_slot], asked, settings, context, step_rows,
                           reader)  # fmt: skip
        return out

    def _read(
        self,
        out: torch.Tensor,
        queries: torch.Tensor,
        asked: np.ndarray,
        settings: Mapping[str, Any],
        context: Any,
        step_rows: np.ndarray,
        reader: Any,
    ) -> None:
        """Each asking request's rows of one layer, against its keys (read once a request)."""
        layer, heads = int(settings["layer"]), int(settings["heads"])
        slots, min_p = int(settings["spans"]), float(settings.get("min_p", 0.0))
        flat = step_rows[asked]
        requests = context.request_of(flat)
        positions = context.position_of(flat)
        terms = reader.terms(layer)
        device = queries.device
        for request in np.unique(requests).tolist():
            mine = np.flatnonzero(requests == request)
            seen = int(positions[mine].max()) + 1  # every key up to its newest row
            first = 0  # keys before the oldest row's window are never read (vLLM may free them)
            if terms.window is not None:
                first = max(0, int(positions[mine].min()) - terms.window + 1)
            key_positions = torch.arange(first, seen, device=device)
            keys = reader.keys(layer, request, key_positions)
            where = torch.from_numpy(asked[mine]).to(device)
            q = queries.index_select(0, where).float().view(len(mine), heads, -1)
            spans = request_spans(context.request_terms(request, self.readout.source), device)
            got = head_readings(q, torch.from_numpy(positions[mine]).to(device), keys.float(),
                                key_positions, terms, self.k, min_p, spans)  # fmt: skip
            mass = torch.nn.functional.pad(got.spans, (0, slots - got.spans.shape[-1]))
            packed = self.readout.pack(got.positions, got.probs, got.entropy, span_mass=mass)
            out[:, : packed.shape[1]].index_copy_(0, where, packed)


def request_spans(terms: Mapping[str, Any] | None, device: torch.device) -> torch.Tensor:
    """A request's ``[[name, start, end], ...]`` spans (its readout terms) as int64
    ``[spans, 2]``."""
    spans = (terms or {}).get("spans") or []
    return torch.tensor([[start, end] for _, start, end in spans], dtype=torch.int64,
                        device=device).reshape(-1, 2)  # fmt: skip


def attention_bank(
    readout: Any, instances: Mapping[str, Mapping[str, Any]], k: int, model: Any
) -> AttentionBank:
    """``AttentionReadout.worker_bank``."""
    return AttentionBank(readout, instances, k)
