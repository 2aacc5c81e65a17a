"""Steering inside the worker: the vector bank, and each step's per-token slots.

Three kinds of buffers, all allocated when the model is loaded (before vLLM compiles it):

- the *bank*: per steered layer, ``[capacity, hidden]`` float32 rows on the device, one per
  named vector (:class:`SteeringBank`; changed by RPC while the engine runs);
- the *tables*: per steered layer, ``[slots, hidden]`` rows in the model dtype, one per steered
  request in the batch: the sum of its vectors times their scales (row 0 stays zero);
- the *index*: ``[max_num_batched_tokens]``, each token's table row for this step.

The steering op (``probehook.worker.steer_op``) reads the index and the tables inside the
compiled graph. Before each forward pass :meth:`StepSteering.prepare` writes the index from the
runner's batch metadata (request order, query offsets, computed positions), the same way the
recorder attributes rows, so continuous batching and chunked prefill need nothing special:
steering is a function of (request, position). A preempted request stays in the runner's
requests while it waits; when the table runs out, the rows of requests outside the step's batch
are set aside and given back on their return (the table has ``max_num_seqs + 1`` rows, so this
always frees one).

No vLLM imports: ``probehook.adapter`` feeds plain arrays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probehook.core.monitors import crosses
from probehook.core.spans import OPEN

logger = logging.getLogger(__name__)

PHASES = ("both", "prefill", "decode")


class SteeringBankError(ValueError):
    """A bank operation that cannot be done (full bank, unknown name, unsteered layer)."""


@dataclass(frozen=True)
class Gate:
    """Probe-gated steering: the score column to watch and the crossing rule."""

    column: int
    threshold: float
    direction: str


@dataclass
class RequestSteering:
    """One request's steering as the worker applies it."""

    terms: tuple[tuple[str, float], ...]
    """(vector name, scale) pairs."""
    lo: int | None
    """First steered position; None while a gate has not crossed."""
    hi: int
    """Positions ``lo <= p < hi`` are steered (``OPEN``: to the end)."""
    prompt_len: int
    gate: Gate | None = None
    slot: int = 0
    """Its row in the tables (0: none assigned yet)."""
    saved: dict[int, torch.Tensor] | None = None
    """Its table rows while it waits without a slot (preempted): restored on its return, so
    a vector removed meanwhile still steers it as before."""


def phase_range(phase: str, prompt_len: int) -> tuple[int, int]:
    """Positions a phase steers: the prompt's (``0..P-1``), the generated tokens' fed back
    (``P..``) or both."""
    if phase == "prefill":
        return 0, prompt_len
    if phase == "decode":
        return prompt_len, OPEN
    return 0, OPEN


class SteeringBank:
    """Named vectors on the device, one ``[capacity, hidden]`` float32 matrix per layer."""

    def __init__(
        self, layers: Sequence[int], hidden: int, capacity: int, device: torch.device | str
    ) -> None:
        self.layers = tuple(sorted(layers))
        self.hidden = hidden
        self.capacity = capacity
        self.vectors = {
            layer: torch.zeros((capacity, hidden), dtype=torch.float32, device=device)
            for layer in self.layers
        }
        self.rows: dict[str, int] = {}
        self.layers_of: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, vectors: Mapping[int, np.ndarray]) -> None:
        if name in self.rows:
            raise SteeringBankError(f"a steering vector named {name!r} is already in the bank")
        bad = sorted(set(vectors) - set(self.layers))
        if bad:
            raise SteeringBankError(
                f"vector {name!r} steers layers {bad}, which this engine does not steer "
                f"(steered layers: {list(self.layers)})"
            )
        free = sorted(set(range(self.capacity)) - set(self.rows.values()))
        if not free:
            raise SteeringBankError(f"the steering bank is full ({self.capacity} vectors)")
        row = free[0]
        for layer in self.layers:
            bank = self.vectors[layer]
            if layer in vectors:
                value = np.asarray(vectors[layer], dtype=np.float32).reshape(self.hidden)
                bank[row].copy_(torch.from_numpy(value.copy()))
            else:
                bank[row].zero_()
        self.rows[name] = row
        self.layers_of[name] = tuple(sorted(vectors))

    def remove(self, name: str) -> None:
        if name not in self.rows:
            raise SteeringBankError(f"no steering vector named {name!r} in the bank")
        del self.rows[name]
        del self.layers_of[name]

    def combine(self, layer: int, terms: Sequence[tuple[str, float]]) -> torch.Tensor | None:
        """``sum(scale * vector)`` at ``layer`` (float32, on the device); None when no term
        steers that layer."""
        rows = [(self.rows[name], scale) for name, scale in terms if layer in self.layers_of[name]]
        if not rows:
            return None
        bank = self.vectors[layer]
        index = torch.tensor([r for r, _ in rows], device=bank.device)
        scales = torch.tensor([s for _, s in rows], dtype=torch.float32, device=bank.device)
        return scales @ bank.index_select(0, index)


@dataclass
class StepSteering:
    """Writes each step's per-token table slots and fills the tables of new requests."""

    bank: SteeringBank
    tables: dict[int, torch.Tensor]
    """Per steered layer: ``[slots, hidden]`` in the model dtype; row 0 stays zero."""
    index: torch.Tensor
    """``[max_num_batched_tokens]`` int64: each token's slot this step."""
    states: dict[str, RequestSteering | None] = field(default_factory=dict)
    """By engine request id; None: seen, not steered. Dropped when the request finishes."""
    _host: np.ndarray = field(init=False)
    _written: int = 0  # index entries [0, _written) may be nonzero
    _free: list[int] = field(init=False)
    _step: tuple[Sequence[str], np.ndarray, np.ndarray] | None = None
    steps_steered: int = 0
    reclaimed: int = 0  # rows taken from requests outside the step (preempted), for the stats
    failures: int = 0  # requests that ran unsteered because they could not get a row
    failed: dict[str, str] = field(default_factory=dict)
    """Why each such request runs unsteered, by engine request id, until :meth:`take_failed`
    (the worker fails their captures with it)."""
    prepare_ns: int = 0  # host time spent writing indexes and tables (for the benchmark)

    def __post_init__(self) -> None:
        slots = next(iter(self.tables.values())).shape[0]
        self._free = list(range(slots - 1, 0, -1))
        self._host = (
            self.index.numpy()
            if self.index.device.type == "cpu"
            else np.zeros(self.index.shape[0], dtype=np.int64)
        )

    def prepare(
        self,
        req_ids: Sequence[str],
        query_start: np.ndarray,
        num_computed: np.ndarray,
        plan_for: Callable[[str], RequestSteering | None],
    ) -> None:
        """Write this step's index (before the forward pass)."""
        started = time.perf_counter_ns()
        n = len(req_ids)
        total = int(query_start[n])
        host = self._host
        upto = max(total, self._written)
        steered = False
        states = self.states
        for i, req_id in enumerate(req_ids):
            state = states.get(req_id, _UNSEEN)
            if state is _UNSEEN:
                state = states[req_id] = plan_for(req_id)
            if state is None or state.lo is None:  # type: ignore[union-attr]
                continue
            computed = int(num_computed[i])
            start, end = int(query_start[i]), int(query_start[i + 1])
            a = max(state.lo - computed, 0)  # type: ignore[union-attr]
            b = min(state.hi - computed, end - start)  # type: ignore[union-attr]
            if a >= b:
                continue
            if not steered:
                host[:upto] = 0
                steered = True
            if state.slot == 0 and not self._assign(req_id, state, req_ids):  # type: ignore[union-attr]
                continue
            host[start + a : start + b] = state.slot  # type: ignore[union-attr]
        # Views of the runner's arrays: check_gates reads them in this same step.
        self._step = (req_ids, query_start[: n + 1], num_computed[:n])
        if not steered:
            if self._written:
                host[: self._written] = 0
                self._copy(self._written)
                self._written = 0
        else:
            self.steps_steered += 1
            self._copy(upto)
            self._written = total
        self.prepare_ns += time.perf_counter_ns() - started

    def _copy(self, count: int) -> None:
        if self.index.device.type != "cpu":
            self.index[:count].copy_(torch.from_numpy(self._host[:count]), non_blocking=True)

    def _assign(self, req_id: str, state: RequestSteering, batch: Sequence[str]) -> bool:
        """Give a request a table row; False (the request runs unsteered, with an error in
        the log and the stats) when that fails: it runs inside the step, where an exception
        would end the engine and every request in it."""
        slot = 0
        try:
            if not self._free:
                self._reclaim(batch)
            slot = self._free.pop()
            for layer, table in self.tables.items():
                if state.saved is not None:
                    table[slot].copy_(state.saved[layer])
                    continue
                combined = self.bank.combine(layer, state.terms)
                if combined is None:
                    table[slot].zero_()
                else:
                    table[slot].copy_(combined)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the engine
            logger.error("probehook: request %s runs unsteered: %s", req_id, e)
            if slot:
                self._free.append(slot)
            self.states[req_id] = None
            self.failures += 1
            self.failed[req_id] = f"{type(e).__name__}: {e}"
            return False
        state.slot, state.saved = slot, None
        return True

    def _reclaim(self, batch: Sequence[str]) -> None:
        # The batch holds at most max_num_seqs requests and the table has one row more, so
        # freeing the rows of every request outside this step's batch (preempted ones, which
        # stay in the runner's requests while they wait) always frees one. Their rows are
        # kept aside and restored when they return.
        in_batch = set(batch)
        for req_id, state in self.states.items():
            if state is not None and state.slot and req_id not in in_batch:
                state.saved = {layer: t[state.slot].clone() for layer, t in self.tables.items()}
                self._free.append(state.slot)
                state.slot = 0
                self.reclaimed += 1
        if not self._free:
            rows = next(iter(self.tables.values())).shape[0] - 1
            raise RuntimeError(
                f"no free steering row: {len(in_batch)} requests in this step, {rows} rows "
                "(the table is built with max_num_seqs + 1)"
            )

    def take_failed(self) -> dict[str, str]:
        """The requests that could not be steered since the last call, with the reasons."""
        failed, self.failed = self.failed, {}
        return failed

    def check_gates(self, rows: torch.Tensor | None, last_row: np.ndarray | None) -> None:
        """After this step's probe scores: start the steering of requests whose gate crossed
        on their last row (a decode row), from the next position on."""
        if self._step is None or rows is None or last_row is None:
            return
        req_ids, query_start, computed = self._step
        scores = None
        for i, req_id in enumerate(req_ids):
            state = self.states.get(req_id)
            if state is None or state.gate is None or state.lo is not None:
                continue
            if i >= len(last_row) or last_row[i] < 0:
                continue
            position = int(computed[i]) + int(query_start[i + 1] - query_start[i]) - 1
            if position < state.prompt_len - 1:
                continue  # a prompt row: gates watch decode rows
            if scores is None:
                scores = rows[0].float().cpu().numpy()
            row = scores[int(last_row[i])]
            gate = state.gate
            if gate.column < len(row) and crosses(row[gate.column], gate.threshold, gate.direction):
                state.lo = position + 1

    def finish(self, req_ids: Any) -> None:
        """Forget requests that finished; free their slots."""
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None and state.slot:
                self._free.append(state.slot)


_UNSEEN: Any = object()
