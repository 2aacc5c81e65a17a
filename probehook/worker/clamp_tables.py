"""The clamp op's tables, written before each forward pass: which tokens are clamped, and
which features of theirs are held at which values (``probehook.worker.clamp_op``).

Rebuilt from the step's batch every step: row ``i + 1`` of an SAE's tables belongs to the
request at batch position ``i`` (row 0: nobody), so no row is held across steps and preempted
or finished requests need no bookkeeping. Each request's clamp plan is read from its wire
once and kept until it leaves the engine.

No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ClampPlan = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""SAE name -> (feature ids int64, values float32) a request holds."""
_UNSEEN = object()
MAX_PLANS_SLACK = 256


@dataclass
class ClampBuffers:
    """One clamped SAE's buffers (registered on its layer, read by its clamp op)."""

    index: torch.Tensor
    """``[max_num_batched_tokens]`` int64: each token's row (0: not clamped)."""
    features: torch.Tensor
    """``[max_num_seqs + 1, MAX_CLAMPED]`` int64, -1: unused."""
    values: torch.Tensor
    """``[max_num_seqs + 1, MAX_CLAMPED]`` float32."""
    dirty: bool = False


class StepClamps:
    """Writes every clamped SAE's buffers for a step's batch."""

    def __init__(self, buffers: Mapping[str, ClampBuffers]) -> None:
        self.buffers = dict(buffers)
        self.plans: dict[str, ClampPlan | None] = {}
        self.steps_clamped = 0

    def prepare(
        self,
        req_ids: Sequence[str],
        query_start: np.ndarray,
        plan_for: Callable[[str], ClampPlan | None],
    ) -> None:
        for buffers in self.buffers.values():
            if buffers.dirty:
                buffers.index.zero_()
                buffers.features.fill_(-1)
                buffers.dirty = False
        clamped = False
        for position, req_id in enumerate(req_ids):
            plan = self.plans.get(req_id, _UNSEEN)
            if plan is _UNSEEN:
                plan = self.plans[req_id] = plan_for(req_id)
            if not plan:
                continue
            lo, hi = int(query_start[position]), int(query_start[position + 1])
            row = position + 1
            for name, (features, values) in plan.items():  # type: ignore[union-attr]
                buffers = self.buffers.get(name)
                if buffers is None:
                    continue  # an SAE this engine does not clamp (checked in the front end)
                n = len(features)
                buffers.index[lo:hi] = row
                buffers.features[row, :n] = features
                buffers.values[row, :n] = values
                buffers.dirty = True
                clamped = True
        self.steps_clamped += clamped

    def bound(self, live_req_ids: Collection[str]) -> None:
        """Forget the plans of requests that left the engine, once they pile up."""
        if len(self.plans) > 2 * len(live_req_ids) + MAX_PLANS_SLACK:
            self.plans = {r: p for r, p in self.plans.items() if r in live_req_ids}
