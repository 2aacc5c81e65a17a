"""Steering inside the worker: the vector bank, and each step's per-token slots.

Three kinds of buffers, all allocated when the model is loaded (before vLLM compiles it; the
op, ``probehook.worker.steer_op``, reads them all inside the compiled graph):

- the *bank*: per steered layer, ``units`` and ``writes`` ``[capacity + 1, hidden]`` float32,
  one row per named vector (row 0 zeros; :class:`SteeringBank`, changed by RPC while the engine
  runs): each op's ``u`` and ``w`` (``probehook.core.steering_ops``);
- the *tables*: per steered layer and per steered request of the batch (row 0: nobody), a
  request's terms in its order (:class:`SteerTable`): the bank row and ``a, b, c, d, lo, hi``
  of each;
- the *index*: ``[max_num_batched_tokens]``, each token's table row for this step.

A run of additions is one term: the sum of its vectors times their scales, in the bank's row
of the request's slot, so requests that only add take one term, as before the other ops.
Before each forward pass :meth:`StepSteering.prepare` writes the index from the runner's batch
metadata (request order, query offsets, computed positions), the same way the recorder
attributes rows, so continuous batching and chunked prefill need nothing special: steering is
a function of (request, position). A preempted request stays in the runner's requests while it
waits; when the table runs out, the rows of requests outside the step's batch are set aside and
given back on their return (the table has ``max_num_seqs + 1`` rows, so this always frees one).
A vector's bank row is not reused while a request that was steered with it is alive.

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
from probehook.core.steering_ops import SCALARS, row_scalars
from probehook.core.steering_wire import VectorRows

logger = logging.getLogger(__name__)

MAX_TERMS = 4
"""Terms one request applies at one layer (a run of additions counts once)."""

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
    saved: dict[int, tuple[torch.Tensor, ...]] | None = None
    """Its table rows while it waits without a slot (preempted): restored on its return, so
    a vector removed meanwhile still steers it as before."""
    bank_rows: set[int] = field(default_factory=set)
    """The bank rows of its vectors (kept while it lives, even if a vector is removed)."""


def phase_range(phase: str, prompt_len: int) -> tuple[int, int]:
    """Positions a phase steers: the prompt's (``0..P-1``), the generated tokens' fed back
    (``P..``) or both."""
    if phase == "prefill":
        return 0, prompt_len
    if phase == "decode":
        return prompt_len, OPEN
    return 0, OPEN


@dataclass
class SteerTable:
    """One steered layer's per-request terms (row 0: nobody): ``rows`` each term's row of the
    bank's ``units``/``writes`` (``[slots, MAX_TERMS]`` int64; 0: a zero row), ``scalars``
    each term's ``a, b, c, d, lo, hi`` (``[slots, MAX_TERMS, 6]`` float32; zeros: no term)."""

    rows: torch.Tensor
    scalars: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, device: torch.device | str) -> SteerTable:
        return cls(
            torch.zeros((slots, MAX_TERMS), dtype=torch.int64, device=device),
            torch.zeros((slots, MAX_TERMS, SCALARS), dtype=torch.float32, device=device),
        )

    @property
    def slots(self) -> int:
        return self.rows.shape[0]


class SteeringBank:
    """Named vectors on the device, and each request's summed additions: per steered layer
    ``units`` and ``writes`` ``[1 + capacity + slots, hidden]`` float32: row 0 zeros, then one
    row per named vector (its ``u`` and ``w``), then one per table slot (the sum of a request's
    additions, :meth:`write`)."""

    def __init__(
        self,
        layers: Sequence[int],
        hidden: int,
        capacity: int,
        device: torch.device | str,
        slots: int = 1,
        tensors: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """``tensors``: each layer's ``(units, writes)`` (the layer's buffers, which the op
        reads); None: allocated here."""
        self.layers = tuple(sorted(layers))
        self.hidden = hidden
        self.capacity = capacity
        if tensors is None:
            tensors = {
                layer: bank_tensors(capacity, slots, hidden, device) for layer in self.layers
            }
        self.units = {layer: tensors[layer][0] for layer in self.layers}
        self.writes = {layer: tensors[layer][1] for layer in self.layers}
        self.rows: dict[str, int] = {}
        self.layers_of: dict[str, tuple[int, ...]] = {}
        self.ops: dict[str, tuple[str, dict[str, Any]]] = {}
        self.retired: dict[int, str] = {}
        """Rows of removed vectors that live requests may still read, by row."""

    def add(self, name: str, vectors: VectorRows | Mapping[int, np.ndarray],
            in_use: Callable[[], set[int]] = set) -> None:  # fmt: skip
        """Put a vector in a free row (``vectors``: its :class:`VectorRows`, or ``{layer:
        vector}`` to add); ``in_use``: the rows live requests read (not reused)."""
        rows = vectors if isinstance(vectors, VectorRows) else VectorRows(dict(vectors))
        if name in self.rows:
            raise SteeringBankError(f"a steering vector named {name!r} is already in the bank")
        bad = sorted(set(rows.writes) - set(self.layers))
        if bad:
            raise SteeringBankError(
                f"vector {name!r} steers layers {bad}, which this engine does not steer "
                f"(steered layers: {list(self.layers)})"
            )
        if self.retired:
            used = in_use()
            self.retired = {r: n for r, n in self.retired.items() if r in used}
        taken = set(self.rows.values()) | set(self.retired)
        free = sorted(set(range(1, self.capacity + 1)) - taken)
        if not free:
            raise SteeringBankError(f"the steering bank is full ({self.capacity} vectors)")
        row = free[0]
        for layer in self.layers:
            for table, given in ((self.writes, rows.writes), (self.units, rows.units or {})):
                if layer in given:
                    value = np.asarray(given[layer], dtype=np.float32).reshape(self.hidden)
                    table[layer][row].copy_(torch.from_numpy(value.copy()))
                else:
                    table[layer][row].zero_()
        self.rows[name] = row
        self.layers_of[name] = tuple(sorted(rows.writes))
        self.ops[name] = (rows.op, dict(rows.params))

    def remove(self, name: str) -> None:
        """Take a vector out (its row is kept until no live request reads it)."""
        if name not in self.rows:
            raise SteeringBankError(f"no steering vector named {name!r} in the bank")
        self.retired[self.rows.pop(name)] = name
        del self.layers_of[name]
        del self.ops[name]

    def combine(self, layer: int, terms: Sequence[tuple[str, float]]) -> torch.Tensor | None:
        """``sum(scale * vector)`` at ``layer`` of additions (float32, on the device); None
        when no term steers that layer."""
        rows = [(self.rows[name], scale) for name, scale in terms if layer in self.layers_of[name]]
        if not rows:
            return None
        bank = self.writes[layer]
        index = torch.tensor([r for r, _ in rows], device=bank.device)
        scales = torch.tensor([s for _, s in rows], dtype=torch.float32, device=bank.device)
        return scales @ bank.index_select(0, index)

    def write(self, table: SteerTable, slot: int, layer: int,
              terms: Sequence[tuple[str, float]]) -> None:  # fmt: skip
        """A request's terms at ``layer`` into its table row, in the request's order: the
        first run of additions (next to each other) summed into the bank's row of the slot,
        one term; every other vector a term of its own bank row."""
        own = 1 + self.capacity + slot  # the slot's row of summed additions
        rows: list[int] = []
        scalars: list[list[float]] = []
        run: list[tuple[str, float]] = []
        summed = False
        for name, scale in [*terms, ("", 0.0)]:  # a sentinel ends the last run
            op, params = self.ops.get(name, ("", {}))
            if op == "add" and layer in self.layers_of[name]:
                run.append((name, scale))
                continue
            if run and not summed and len(run) > 1:
                self.writes[layer][own].copy_(self.combine(layer, run))
                rows.append(own)
                scalars.append(row_scalars("add", {}, 1.0))
                summed = True
            else:  # a run of one, or after the summed run: each its own term
                for added, factor in run:
                    rows.append(self.rows[added])
                    scalars.append(row_scalars("add", {}, factor))
            run = []
            if name and layer in self.layers_of[name]:
                rows.append(self.rows[name])
                scalars.append(row_scalars(op, params, scale))
        if len(rows) > MAX_TERMS:
            raise SteeringBankError(
                f"layer {layer}: {len(rows)} steering terms, at most {MAX_TERMS} (additions "
                "next to each other count once, the first such run only); combine vectors "
                "into fewer"
            )
        table.rows[slot].zero_()
        table.scalars[slot].zero_()
        if rows:
            table.rows[slot, : len(rows)] = torch.tensor(rows, dtype=torch.int64)
            table.scalars[slot, : len(rows)] = torch.tensor(scalars, dtype=torch.float32)

    def live_rows(self, terms: Sequence[tuple[str, float]]) -> set[int]:
        return {self.rows[name] for name, _ in terms if name in self.rows}


def bank_tensors(
    capacity: int, slots: int, hidden: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's bank: ``units`` and ``writes``, ``[1 + capacity + slots, hidden]`` float32
    zeros."""
    shape = (1 + capacity + slots, hidden)
    return (torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device))  # fmt: skip


@dataclass
class StepSteering:
    """Writes each step's per-token table slots and fills the tables of new requests."""

    bank: SteeringBank
    tables: dict[int, SteerTable]
    """Per steered layer; row 0 stays zero."""
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
        slots = next(iter(self.tables.values())).slots
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
                    self._restore(table, layer, slot, state.saved[layer])
                else:
                    self.bank.write(table, slot, layer, state.terms)
            if state.saved is None:
                state.bank_rows = self.bank.live_rows(state.terms)
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
                state.saved = {layer: self._save(t, layer, state.slot)
                               for layer, t in self.tables.items()}  # fmt: skip
                self._free.append(state.slot)
                state.slot = 0
                self.reclaimed += 1
        if not self._free:
            rows = next(iter(self.tables.values())).slots - 1
            raise RuntimeError(
                f"no free steering row: {len(in_batch)} requests in this step, {rows} rows "
                "(the table is built with max_num_seqs + 1)"
            )

    def _own(self, slot: int) -> int:
        return 1 + self.bank.capacity + slot

    def _save(self, table: SteerTable, layer: int, slot: int) -> tuple[torch.Tensor, ...]:
        """A slot's terms at a layer and its summed additions (the bank's row of the slot)."""
        return (table.rows[slot].clone(), table.scalars[slot].clone(),
                self.bank.writes[layer][self._own(slot)].clone(), torch.tensor(slot))  # fmt: skip

    def _restore(
        self, table: SteerTable, layer: int, slot: int, saved: tuple[torch.Tensor, ...]
    ) -> None:
        """:meth:`_save`'s terms in another slot (the summed row moves with them)."""
        rows, scalars, summed, old = saved
        own = self._own(int(old))
        table.rows[slot].copy_(torch.where(rows == own, self._own(slot), rows))
        table.scalars[slot].copy_(scalars)
        self.bank.writes[layer][self._own(slot)].copy_(summed)

    def in_use(self) -> set[int]:
        """The bank rows of vectors that live requests were steered with."""
        return {row for state in self.states.values() if state is not None
                for row in state.bank_rows}  # fmt: skip

    def add_vector(self, name: str, vectors: VectorRows) -> None:
        """Put a vector in the bank; rows live requests read are not reused."""
        self.bank.add(name, vectors, self.in_use)

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
