"""The write table in the worker: each intervention instance's term at its site, and the step
writer that fills every term's per-token index and per-request rows before each forward pass.

An instance's writer (:class:`InstanceWriter`, built at load by its intervention's
``worker_writer`` factory) owns the buffers its write kind reads after the index (its tables,
its constants) and writes one request's row of them from the request's terms. The table
(:class:`StepWrites`) is rebuilt from the step's batch every step: row ``i + 1`` belongs to the
request at batch position ``i`` (row 0: nobody), so no row is held across steps and preempted
or finished requests need no bookkeeping. Each request's terms are read from its wire once and
kept until it leaves the engine.

No vLLM imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MAX_PLANS_SLACK = 256
_UNSEEN: Any = object()


@dataclass(frozen=True)
class WriterContext:
    """What a writer factory may build its buffers with."""

    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    slots: int
    """Rows of each per-request table: the batch's most requests, plus row 0 (nobody)."""
    banks: Mapping[str, Any] = field(default_factory=dict)
    """The engine's top-k banks by source (an SAE clamp writes with its SAE's weights)."""
    max_tokens: int = 0
    """Tokens a step holds at most (``max_num_batched_tokens``: per-token buffers)."""


class InstanceWriter:
    """One intervention instance's write term: where it applies, its kind's buffers after the
    index, and how a request's terms fill its row. Subclasses set the fields in ``__init__``
    and implement :meth:`plan` and :meth:`write_row`."""

    layer: int
    site: str
    kind: str
    settings: str = ""
    """The kind's constant settings (part of the traced graph)."""
    buffers: dict[str, torch.Tensor]
    """The kind's tensors after the index, in order (registered on the layer at load)."""
    index: torch.Tensor
    """``[max_num_batched_tokens]`` int64: each token's row (0: not written); set at load."""

    def plan(self, terms: Any) -> Any:
        """A request's terms of this instance (its wire's JSON) in the form :meth:`write_row`
        writes; raises on terms the front end would have refused."""
        raise NotImplementedError

    def write_row(self, row: int, plan: Any) -> None:
        raise NotImplementedError

    def write_tokens(self, slot: int, plan: Any, lo: int, hi: int, first: int) -> bool:
        """Point the request's tokens ``lo..hi`` of the step at its row ``slot`` (``first``:
        the absolute position of token ``lo``); True when any token was written. Default:
        every token (a writer that applies at some positions only narrows it)."""
        self.index[lo:hi] = slot
        return True

    def clear(self) -> None:
        """Reset the rows written (a step writes only its requests' rows). Default: nothing
        (rows the index does not point at are never read)."""


def build_writers(entry: Any, instances: Mapping[str, Any], context: WriterContext) -> dict:
    """The writers of an intervention's instances, from its ``worker_writer`` factory."""
    module, _, function = entry.worker_writer.partition(":")
    factory = getattr(importlib.import_module(module), function)
    return factory(entry, instances, context)


class StepWrites:
    """Writes every instance's index and rows for a step's batch. ``writers`` by ``(request
    option, instance)``: a request's terms are ``wire.writes[option][instance]``."""

    def __init__(self, writers: Mapping[tuple[str, str], InstanceWriter]) -> None:
        self.writers = dict(writers)
        self.dirty: set[tuple[str, str]] = set()
        self.plans: dict[str, dict[tuple[str, str], Any] | None] = {}
        self.steps_written = 0
        self.failed: dict[str, str] = {}
        """Why each request whose terms could not be read runs unwritten, by engine request
        id, until :meth:`take_failed` (the worker fails their captures with it)."""

    def prepare(
        self,
        req_ids: Sequence[str],
        query_start: np.ndarray,
        terms_for: Callable[[str], Mapping[str, Mapping[str, Any]] | None],
        computed: np.ndarray | None = None,
    ) -> None:
        """Write this step's indexes and rows (before the forward pass). ``terms_for``: a
        request's ``{option: {instance: terms}}`` (None: it writes nothing); ``computed``:
        each request's tokens computed before this step (its first token's position; None:
        0)."""
        for key in self.dirty:
            writer = self.writers[key]
            writer.index.zero_()
            writer.clear()
        self.dirty.clear()
        for position, req_id in enumerate(req_ids):
            plans = self.plans.get(req_id, _UNSEEN)
            if plans is _UNSEEN:
                try:
                    plans = self._plans(terms_for(req_id))
                except Exception as e:  # noqa: BLE001 - it runs in the step: fail it alone
                    self.failed[req_id] = f"{type(e).__name__}: {e}"
                    plans = None
                self.plans[req_id] = plans
            if not plans:
                continue
            lo, hi = int(query_start[position]), int(query_start[position + 1])
            first = 0 if computed is None else int(computed[position])
            try:
                for key, plan in plans.items():
                    writer = self.writers[key]
                    self.dirty.add(key)
                    if writer.write_tokens(position + 1, plan, lo, hi, first):
                        writer.write_row(position + 1, plan)
            except Exception as e:  # noqa: BLE001 - it runs in the step: fail it alone
                for key in plans:
                    self.writers[key].index[lo:hi] = 0
                self.failed[req_id] = f"{type(e).__name__}: {e}"
                self.plans[req_id] = None
        self.steps_written += bool(self.dirty)

    def _plans(self, terms: Mapping[str, Mapping[str, Any]] | None) -> dict | None:
        if not terms:
            return None
        plans = {}
        for option, by_instance in terms.items():
            for instance, value in by_instance.items():
                writer = self.writers.get((option, instance))
                if writer is None:
                    raise ValueError(
                        f"it writes {option}[{instance!r}], which this engine does not install"
                    )
                plans[(option, instance)] = writer.plan(value)
        return plans

    def take_failed(self) -> dict[str, str]:
        """The requests that could not be written since the last call, with the reasons."""
        failed, self.failed = self.failed, {}
        return failed

    def bound(self, live_req_ids: Collection[str]) -> None:
        """Forget the plans of requests that left the engine, once they pile up."""
        if len(self.plans) > 2 * len(live_req_ids) + MAX_PLANS_SLACK:
            self.plans = {r: p for r, p in self.plans.items() if r in live_req_ids}
