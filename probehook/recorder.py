"""Worker-side bookkeeping: turns each engine step's tap buffers into per-request rows.

The taps (``probehook.tap_op``) fill one buffer per layer with every token of the step. After
the forward pass, :meth:`StepRecorder.record` picks the rows that requests asked for, using
the runner's batch metadata (request ids and query offsets), never by counting rows. The
picked rows of all layers move to host in one copy per step. Rows are keyed by absolute
position, so a request that is preempted and recomputed simply overwrites its rows.

This module knows nothing about vLLM; ``probehook._vllm_adapter`` feeds it plain arrays.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from probehook.capture_config import CaptureConfig

NO_END = sys.maxsize


@dataclass
class RowChunk:
    """Rows of one request from one step: ``rows[:, offset : offset + count]``."""

    rows: torch.Tensor  # [num_engine_layers, step_rows, hidden], host
    offset: int
    count: int
    first_position: int
    ready: torch.cuda.Event | None = None


@dataclass
class RequestPlan:
    """What one engine request keeps: positions ``lo <= p < hi`` of the given layers."""

    key: str
    req_id: str
    lo: int
    hi: int
    chunks: list[RowChunk] = field(default_factory=list)


def keep_interval(config: CaptureConfig, prompt_len: int) -> tuple[int, int]:
    """Positions a request must keep. Decode row i is position ``prompt_len - 1 + i``."""
    last_prompt = max(prompt_len - 1, 0)
    lo, hi = NO_END, 0
    if config.include_prefill:
        lo = last_prompt if config.last_prefill_token else 0
        hi = prompt_len
    if config.include_decode:
        lo = min(lo, last_prompt)
        hi = NO_END
    return lo, hi


@dataclass
class ExportedRange:
    """Where one requested position range landed in the export, or what was missing."""

    tensor_index: int
    lo: int
    hi: int
    missing: list[int]


class StepRecorder:
    """Collects per-request rows from the per-layer tap buffers of one worker."""

    def __init__(self, buffers: Sequence[torch.Tensor], layers: Sequence[int]) -> None:
        if len(buffers) != len(layers):
            raise ValueError(f"{len(buffers)} buffers for {len(layers)} layers")
        self.buffers = list(buffers)
        self.layers = tuple(layers)
        self.plans_by_req: dict[str, RequestPlan | None] = {}
        self.plans_by_key: dict[str, RequestPlan] = {}
        self.steps_recorded = 0

    def record(
        self,
        req_ids: Sequence[str],
        query_start: np.ndarray,
        num_computed: np.ndarray,
        plan_for: Callable[[str], RequestPlan | None],
    ) -> None:
        """Keep this step's wanted rows.

        Args:
            req_ids: request ids in batch order.
            query_start: ``[len(req_ids) + 1]`` row offsets of each request in the step.
            num_computed: ``[len(req_ids)]`` position of each request's first row.
            plan_for: builds the plan of a request seen for the first time (None: no capture).
        """
        n = len(req_ids)
        lo = np.full(n, NO_END, dtype=np.int64)
        hi = np.zeros(n, dtype=np.int64)
        plans: list[RequestPlan | None] = []
        for i, req_id in enumerate(req_ids):
            plan = self.plans_by_req.get(req_id, _UNSEEN)
            if plan is _UNSEEN:
                plan = plan_for(req_id)
                self.plans_by_req[req_id] = plan
                if plan is not None:
                    self.plans_by_key[plan.key] = plan
            plans.append(plan)
            if plan is not None:
                lo[i], hi[i] = plan.lo, plan.hi
        starts = query_start[:n].astype(np.int64)
        n_sched = query_start[1 : n + 1].astype(np.int64) - starts
        computed = num_computed[:n].astype(np.int64)
        first = np.clip(lo - computed, 0, n_sched)
        last = np.clip(hi - computed, 0, n_sched)
        count = np.maximum(last - first, 0)
        total = int(count.sum())
        self.steps_recorded += 1
        if total == 0:
            return
        out_offset = np.cumsum(count) - count
        index = (
            np.arange(total, dtype=np.int64)
            - np.repeat(out_offset, count)
            + np.repeat(starts + first, count)
        )
        rows, ready = self._gather(index)
        for i in np.flatnonzero(count):
            plans[i].chunks.append(  # type: ignore[union-attr]
                RowChunk(
                    rows, int(out_offset[i]), int(count[i]), int(computed[i] + first[i]), ready
                )
            )

    def _gather(self, index: np.ndarray) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Gather rows of every layer on the device, then one copy to host."""
        buf0 = self.buffers[0]
        idx = torch.from_numpy(index).to(buf0.device, non_blocking=True)
        staged = torch.empty(
            (len(self.buffers), len(index), buf0.shape[1]), dtype=buf0.dtype, device=buf0.device
        )
        for layer_slot, buf in enumerate(self.buffers):
            torch.index_select(buf, 0, idx, out=staged[layer_slot])
        if staged.device.type == "cpu":
            return staged, None
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        host.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def export(
        self, key: str, ranges: Sequence[tuple[int, int]], layers: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[ExportedRange]]:
        """Assemble ``[len(layers), hi - lo, hidden]`` per range, then forget the request."""
        plan = self.plans_by_key.pop(key, None)
        if plan is not None:
            self.plans_by_req.pop(plan.req_id, None)
        slots: list[int] | slice = [self.layers.index(layer) for layer in layers]
        if slots == list(range(len(self.layers))):
            slots = slice(None)  # all layers: a view instead of a gather per chunk
        tensors: list[torch.Tensor] = []
        results: list[ExportedRange] = []
        hidden = self.buffers[0].shape[1]
        for lo, hi in ranges:
            out = torch.empty((len(layers), hi - lo, hidden), dtype=self.buffers[0].dtype)
            filled = np.zeros(hi - lo, dtype=bool)
            for chunk in plan.chunks if plan is not None else ():
                a = max(lo, chunk.first_position)
                b = min(hi, chunk.first_position + chunk.count)
                if a >= b:
                    continue
                if chunk.ready is not None:
                    chunk.ready.synchronize()
                src = chunk.offset + a - chunk.first_position
                out[:, a - lo : b - lo] = chunk.rows[slots, src : src + b - a]
                filled[a - lo : b - lo] = True
            missing = (np.flatnonzero(~filled) + lo).tolist()
            results.append(ExportedRange(len(tensors), lo, hi, missing))
            tensors.append(out)
        return tensors, results

    def forget(self, key_prefixes: Sequence[str]) -> int:
        """Drop the rows of requests whose key starts with any prefix; return how many."""
        doomed = [k for k in self.plans_by_key if k.startswith(tuple(key_prefixes))]
        for key in doomed:
            plan = self.plans_by_key.pop(key)
            self.plans_by_req.pop(plan.req_id, None)
        return len(doomed)

    def forget_unless(self, live_req_ids: Mapping[str, object] | set[str]) -> None:
        """Drop 'no capture' markers of requests that have left the engine."""
        for req_id in [r for r, p in self.plans_by_req.items() if p is None]:
            if req_id not in live_req_ids:
                del self.plans_by_req[req_id]


_UNSEEN = object()
