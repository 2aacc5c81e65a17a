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

from probehook.outputs.columns import join_packed
from probehook.worker.attention_rows import batched_head_readings, head_readings
from probehook.worker.on_device import on_device
from probehook.worker.top_k_bank import TopKBank


class AttentionBank(TopKBank):
    """One layer an instance; callable on a recorder's staged query rows with the step's
    context (``reads_step``): returns ``[len(slots), rows, width]`` float32. Under tensor
    parallelism (``group``) each rank reads its slice of the heads (its query rows and its KV
    heads' cache) and one all-gather a call joins them: only the packed readings cross ranks,
    never a query, a key or a matrix."""

    site = "attn_q"
    reads_step = True

    def __init__(
        self,
        readout: Any,
        instances: Mapping[str, Mapping[str, Any]],
        k: int,
        group: Any = None,
    ) -> None:
        super().__init__(readout, instances, k)
        self.group = group
        if group is not None:
            for name, settings in instances.items():
                if int(settings["heads"]) % group.ranks:
                    raise ValueError(
                        f"attention {name!r}: {settings['heads']} query heads do not split "
                        f"over {group.ranks} tensor-parallel ranks"
                    )

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
        ranks = 1 if self.group is None else self.group.ranks
        mine = [self._local(settings, ranks) for _, settings in self._instances]
        width = max(self.readout.packed_width(s, self.k) for s in mine)
        out = torch.empty((len(self.slots), rows, width), dtype=self.dtype, device=device)
        reader = context.parts["attention"]
        for slot, (layer_slot, _) in enumerate(self._instances):
            self.readout.pad_packed(out[slot], mine[slot], self.k)
            asked = np.arange(rows) if slot_rows is None else slot_rows[slot]
            if len(asked):
                self._read(out[slot], staged[layer_slot], asked, mine[slot], context, step_rows,
                           reader)  # fmt: skip
        return out if ranks == 1 else self._join(out, mine)

    @staticmethod
    def _local(settings: Mapping[str, Any], ranks: int) -> Mapping[str, Any]:
        """An instance's settings on this rank: its slice of the heads."""
        return settings if ranks == 1 else {**settings, "heads": int(settings["heads"]) // ranks}

    def _join(self, local: torch.Tensor, mine: list[Mapping[str, Any]]) -> torch.Tensor:
        """Every rank's packed rows of its heads (``local``), gathered in one all-gather and
        joined along the heads axis into the whole layer's packed rows."""
        slots, rows, width = local.shape
        ranks = self.group.ranks
        gathered = self.group.all_gather(local.reshape(slots * rows, width))
        gathered = gathered.view(slots, rows, ranks, width)
        out = torch.empty((slots, rows, self.width), dtype=self.dtype, device=local.device)
        schema = self.readout.row_type.schema()
        for slot, settings in enumerate(mine):
            sizes = self.readout.axis_sizes(settings, self.k)
            used = self.readout.packed_width(settings, self.k)
            pieces = [gathered[slot, :, r, :used] for r in range(ranks)]
            joined = join_packed(schema, pieces, sizes, "heads")
            out[slot, :, : joined.shape[1]] = joined
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
        """Each asking request's rows of one layer, against its keys (read once a request):
        requests with one row in the step (decode) together, in batches of at most
        :data:`BATCH_KEYS` keys, the others one at a time."""
        layer, heads = int(settings["layer"]), int(settings["heads"])
        slots, min_p = int(settings["spans"]), float(settings.get("min_p", 0.0))
        flat = step_rows[asked]
        requests = context.request_of(flat)
        positions = context.position_of(flat)
        terms = reader.terms(layer)
        device = queries.device
        order, index, counts = np.unique(requests, return_index=True, return_counts=True)
        for request in order[counts > 1].tolist():
            mine = np.flatnonzero(requests == request)
            seen = int(positions[mine].max()) + 1  # every key up to its newest row
            first = int(_first_keys(positions[mine], terms).min())
            key_positions = torch.arange(first, seen, device=device)
            keys = reader.keys(layer, request, key_positions)
            where = on_device(asked[mine], device)
            q = queries.index_select(0, where).float().view(len(mine), heads, -1)
            spans = request_spans(context.request_terms(request, self.readout.source), device)
            got = head_readings(q, on_device(positions[mine], device), keys.float(),
                                key_positions, terms, self.k, min_p, spans)  # fmt: skip
            self._write(out, where, got, slots)
        mine = index[counts == 1]  # the row of each request with one
        if len(mine):
            for batch in _batches(positions[mine], terms):
                self._read_singles(out, queries, asked[mine[batch]], requests[mine[batch]],
                                   positions[mine[batch]], layer, heads, slots, min_p, terms,
                                   context, reader)  # fmt: skip

    def _read_singles(
        self,
        out: torch.Tensor,
        queries: torch.Tensor,
        rows: np.ndarray,
        requests: np.ndarray,
        positions: np.ndarray,
        layer: int,
        heads: int,
        slots: int,
        min_p: float,
        terms: Any,
        context: Any,
        reader: Any,
    ) -> None:
        """Requests with one row each: their keys read together (``[R, M]``, each request's
        visible ones, the rest padding), one batched scoring."""
        device = queries.device
        first = _first_keys(positions, terms)
        width = int((positions + 1 - first).max())
        grid = on_device(first[:, None] + np.arange(width)[None, :], device)
        newest = on_device(positions, device)
        key_positions = torch.where(grid <= newest[:, None], grid, -1)
        keys = reader.keys(layer, requests.tolist(), torch.minimum(grid, newest[:, None]))
        where = on_device(rows, device)
        q = queries.index_select(0, where).float().view(len(rows), heads, -1)
        asked = [(context.request_terms(r, self.readout.source) or {}).get("spans") or []
                 for r in requests.tolist()]  # fmt: skip
        spans = None
        if any(asked):  # [R, spans, 2], [0, 0] past a request's own
            most = max(len(a) for a in asked)
            bounds = [[[lo, hi] for _, lo, hi in a] + [[0, 0]] * (most - len(a)) for a in asked]
            spans = on_device(np.array(bounds, dtype=np.int64), device)
        got = batched_head_readings(q, newest, keys, key_positions, terms, self.k, min_p, spans)
        self._write(out, where, got, slots)

    def _write(self, out: torch.Tensor, where: torch.Tensor, got: Any, slots: int) -> None:
        mass = torch.nn.functional.pad(got.spans, (0, slots - got.spans.shape[-1]))
        packed = self.readout.pack(got.positions, got.probs, got.entropy, span_mass=mass)
        out[:, : packed.shape[1]].index_copy_(0, where, packed)


BATCH_KEYS = 1 << 16
"""Keys (per request, padded to the longest) read and scored together in one batch of decode
rows: bounds the batch's float32 keys and logits (``keys x heads x head size``)."""


def _first_keys(positions: np.ndarray, terms: Any) -> np.ndarray:
    """The first key each row sees: keys before its window are never read (vLLM may have
    freed their blocks)."""
    if terms.window is None:
        return np.zeros_like(positions)
    return np.maximum(0, positions - terms.window + 1)


def _batches(positions: np.ndarray, terms: Any) -> list[np.ndarray]:
    """Decode rows in batches of at most :data:`BATCH_KEYS` padded keys, the shortest
    together (so a long request pads no short one)."""
    seen = (positions + 1 - _first_keys(positions, terms)).tolist()
    batches: list[list[int]] = [[]]
    for i in np.argsort(seen, kind="stable").tolist():  # widest last: it sets the padding
        if batches[-1] and (len(batches[-1]) + 1) * seen[i] > BATCH_KEYS:
            batches.append([])
        batches[-1].append(i)
    return [np.array(batch) for batch in batches]


def request_spans(terms: Mapping[str, Any] | None, device: torch.device) -> torch.Tensor:
    """A request's ``[[name, start, end], ...]`` spans (its readout terms) as int64
    ``[spans, 2]``."""
    spans = (terms or {}).get("spans") or []
    bounds = np.array([[start, end] for _, start, end in spans], dtype=np.int64)
    return on_device(bounds.reshape(-1, 2), device)


def attention_bank(
    readout: Any, instances: Mapping[str, Mapping[str, Any]], k: int, model: Any
) -> AttentionBank:
    """``AttentionReadout.worker_bank`` (``model.group``: the tensor-parallel group, if any)."""
    return AttentionBank(readout, instances, k, getattr(model, "group", None))
