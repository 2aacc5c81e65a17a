"""Worker-side bookkeeping: turns each engine step's tap buffers into per-request rows.

The taps (``probehook.worker.tap_op``) fill one buffer per layer with every token of the step.
After the forward pass, :meth:`StepRecorder.record` picks the rows that requests keep, using
the runner's batch metadata (request ids and query offsets), never by counting rows. The picked
rows of all layers are gathered on the device and copied to host once per step, then copied
into each request's own buffer, so the step's staging tensor is freed at once: retained memory
is what each live request will return, nothing more. The one exception is a one-pass
(pooling) request whose every kept row comes in one step: it gets no buffer of its own (no
:class:`RequestRows`), only a view of the step's block under its key until its export, and an
export of many joins them in one copy. A pooling batch pays per request one plan lookup and
one dict entry, not an object per request and recorder.

Rows are keyed by absolute position, so a request that is preempted and recomputed overwrites
its rows. A request's rows are handed over in order up to a *cursor* (:meth:`export`) and freed
once handed over, so the same export serves a finished request and a running stream.

This module knows nothing about vLLM; ``probehook.adapter`` feeds it plain arrays.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from probehook.core.spans import OPEN, KeepPlan, Span
from probehook.worker.step_context import StepContext

MIN_CAPACITY = 16
DEPARTED_SLACK = 256
"""Entries of departed requests :meth:`StepRecorder.bound` lets accumulate beyond twice the
live ones before it drops them."""


class RequestPlan(NamedTuple):
    """What one engine request keeps, and the stream key its rows are exported under.

    A named tuple: the worker builds one per request and recorder in the step, and a tuple
    costs a fraction of a frozen dataclass to build."""

    key: str
    keep: KeepPlan
    stream: bool = False
    """Push rows to the front end as they are computed (:meth:`StepRecorder.take_streamed`)
    instead of holding them until an export."""
    layers: tuple[int, ...] | None = None
    """The layers a stream pushes (a subset of the recorder's); None: all of them."""
    error: str | None = None
    """Set when the worker could not read the request's options: its capture fails alone."""
    one_pass: bool = False
    """The request ends in the step that computes it (a pooling request): rows that arrive
    in one step stay in that step's block (:attr:`StepRecorder.held`), which its export
    frees soon. A generating request's rows are copied: one long request must not keep a
    whole step's block alive."""


@dataclass
class ExportedSpan:
    """Where one asked span landed in the export, or which positions were missing."""

    tensor_index: int
    lo: int
    hi: int
    missing: list[int]


class RequestRows:
    """The rows one engine request keeps: dense by position, plus an optional latest slot."""

    # One per request and recorder, built in the step: slots make that cheaper.
    __slots__ = (
        "key", "keep", "stream", "stream_slots", "error_sent", "num_layers", "hidden", "dtype",
        "limit", "cursor", "base", "data", "filled", "latest", "latest_position", "error",
        "closed", "wanted",
    )  # fmt: skip

    def __init__(
        self,
        key: str,
        keep: KeepPlan,
        shape: tuple[int, int],
        dtype: torch.dtype,
        limit: int,
        stream: bool = False,
    ) -> None:
        self.key = key
        self.keep = keep
        self.stream = stream
        self.stream_slots: slice | list[int] = slice(None)  # what a stream pushes
        self.error_sent = False
        self.num_layers, self.hidden = shape
        self.dtype = dtype
        self.limit = limit
        self.cursor = 0  # positions below were handed over and freed
        self.base = keep.dense.lo if keep.dense is not None else 0
        # Host rows are numpy arrays (bfloat16 as its int16 bits): a numpy slice copy costs
        # about a microsecond, a torch one several, and the recorder does one per request
        # per step.
        self.data: np.ndarray | None = None  # [layers, capacity, hidden]; slot = pos - base
        self.filled = _NONE_FILLED
        self.latest: np.ndarray | None = None  # [layers, hidden]
        self.latest_position = -1
        self.error: str | None = None
        self.closed = False  # exported for the last time or forgotten: ignore late steps
        self.wanted = _wanted(keep, self.cursor)
        """Positions a step must copy for this request, ``(lo, hi)``; ``(OPEN, 0)``: none.
        Kept up to date here because every step reads it for every request."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.data, self.latest) if a is not None)

    def write(self, rows: np.ndarray, first: int) -> None:
        """Store ``rows`` (``[layers, count, hidden]``, host numpy as from :func:`host_view`)
        for positions ``first, first + 1, ...``."""
        if self.error is not None or self.closed:
            return
        end = first + rows.shape[1]
        keep = self.keep
        # Only the highest position is kept; recompute after preemption never moves it back.
        if keep.latest_from is not None and end - 1 >= max(keep.latest_from, self.latest_position):
            if self.latest is None:
                self.latest = np.empty((self.num_layers, self.hidden), dtype=rows.dtype)
            self.latest[...] = rows[:, -1]
            self.latest_position = end - 1
        if keep.dense is None:
            return
        lo = max(first, keep.dense.lo, self.cursor)
        hi = min(end, keep.dense.hi)
        if lo >= hi:
            return
        if (self.data is None or hi - self.base > self.data.shape[1]) and not self._reserve(
            hi - self.base, rows.dtype
        ):
            return
        self.data[:, lo - self.base : hi - self.base] = rows[:, lo - first : hi - first]  # type: ignore[index]
        self.filled[lo - self.base : hi - self.base] = True

    def _reserve(self, slots: int, dtype: np.dtype) -> bool:
        capacity = 0 if self.data is None else self.data.shape[1]
        if slots <= capacity:
            return True
        dense = self.keep.dense
        assert dense is not None
        new_capacity = max(slots, 2 * capacity, MIN_CAPACITY)
        if dense.hi != OPEN:
            new_capacity = min(new_capacity, dense.hi - self.base)
        row_bytes = self.num_layers * self.hidden * dtype.itemsize
        if self.limit and new_capacity * row_bytes > self.limit:
            new_capacity = max(slots, self.limit // row_bytes)
            if new_capacity * row_bytes > self.limit:
                self.fail(
                    f"its captured rows would take {slots * row_bytes:,} bytes, over the "
                    f"per-request limit of {self.limit:,} bytes (max_request_capture_bytes). "
                    "Raise the limit, capture fewer layers, or use last_decode_token / "
                    "last_prefill_token."
                )
                return False
        grown = np.empty((self.num_layers, new_capacity, self.hidden), dtype=dtype)
        filled = np.zeros(new_capacity, dtype=bool)
        if self.data is not None:
            grown[:, :capacity] = self.data
            filled[:capacity] = self.filled
        self.data, self.filled = grown, filled
        return True

    def fail(self, reason: str) -> None:
        self.error = reason
        self.wanted = NOTHING_WANTED
        self._free()

    def close(self) -> None:
        self.closed = True
        self.wanted = NOTHING_WANTED
        self._free()

    def _free(self) -> None:
        self.data, self.latest, self.filled = None, None, _NONE_FILLED

    def read(self, span: Span, slots: list[int] | slice) -> tuple[torch.Tensor, list[int]]:
        """Rows of ``span`` for the given layer slots, and the positions that are missing."""
        out = torch.empty((self._count(slots), len(span), self.hidden), dtype=self.dtype)
        return out, self.read_into(host_view(out), span, slots)

    def read_into(self, out: np.ndarray, span: Span, slots: list[int] | slice) -> list[int]:
        """Copy the rows of ``span`` into ``out`` (``[slots, len(span), hidden]``, host);
        return the positions that are missing (their rows in ``out`` are left as they are)."""
        if (
            len(span) == 1
            and self.latest is not None
            and span.lo == self.latest_position
            and span.lo >= self.cursor
        ):
            out[:, 0] = self.latest[slots]
            return []
        if self.data is not None:
            lo = max(span.lo, self.base, self.cursor)
            hi = min(span.hi, self.base + self.data.shape[1])
            if lo < hi:
                out[:, lo - span.lo : hi - span.lo] = self.data[
                    slots, lo - self.base : hi - self.base
                ]
                filled = self.filled[lo - self.base : hi - self.base]
                if lo == span.lo and hi == span.hi and filled.all():
                    return []
                missing = np.ones(len(span), dtype=bool)
                missing[lo - span.lo : hi - span.lo] = ~filled
                return (np.flatnonzero(missing) + span.lo).tolist()
        return list(range(span.lo, span.hi))

    def ready(self) -> int:
        """How many positions from the cursor on are filled without a gap."""
        if self.data is None:
            return 0
        filled = self.filled[max(self.cursor - self.base, 0) :]
        gaps = np.flatnonzero(~filled)
        return int(gaps[0]) if len(gaps) else len(filled)

    def _count(self, slots: list[int] | slice) -> int:
        return self.num_layers if isinstance(slots, slice) else len(slots)

    def advance(self, cursor: int) -> None:
        """Hand over every position below ``cursor``: free it."""
        if cursor <= self.cursor:
            return
        self.cursor = cursor
        if self.error is None and not self.closed:
            self.wanted = _wanted(self.keep, cursor)
        if self.latest is not None and self.latest_position < cursor:
            self.latest, self.latest_position = None, -1
        if self.data is None:
            return
        shift = cursor - self.base
        if shift >= self.data.shape[1] or not self.filled[max(shift, 0) :].any():
            self.data, self.filled = None, _NONE_FILLED
            self.base = cursor
        elif shift > 0:
            self.data = self.data[:, shift:].copy()
            self.filled = self.filled[shift:].copy()
            self.base = cursor


_UNSEEN = object()


class OnePass(NamedTuple):
    """A one-pass request met in a step, before its rows arrive: its whole kept span is
    expected in that step, to be held in its block (:attr:`StepRecorder.held`). Should the span
    not arrive whole (a prompt computed in chunks, rows over the per-request limit), the
    recorder gives it a :class:`RequestRows` instead."""

    plan: RequestPlan
    wanted: tuple[int, int]


Held = tuple[np.ndarray, int, int, int]
"""Where a held request's rows lie: its step's block (``[slots, rows, width]``, host), the
offset and count of its rows there, and its first position."""


class RowTransform(Protocol):
    """Turns a step's staged rows (``[rows, hidden]`` per layer, indexed by layer slot: a
    tensor ``[len(layers), rows, hidden]`` or a list of views of the tap buffers) into what
    requests keep, ``[len(slots), rows, width]``, on the device
    (``probehook.worker.probe_bank.ProbeBank``). It must not keep or change ``staged``."""

    slots: tuple[Any, ...]
    width: int
    dtype: torch.dtype

    def __call__(self, staged: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor: ...


@dataclass
class StepRows:
    """This step's kept rows on the device, and for each request (batch order) the row of
    its last scheduled token, or -1 when that token is not kept (``keep_step_rows``)."""

    rows: torch.Tensor
    last_row: np.ndarray


class StepRecorder:
    """Collects per-request rows from the per-layer tap buffers of one worker.

    Requests keep the buffers' rows as they are (one slot per layer), or, with a
    ``transform``, what it computes from them (probe scores).
    """

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        layers: Sequence[int],
        limit_bytes: int = 0,
        transform: RowTransform | None = None,
        source: str = "hidden",
    ) -> None:
        if len(buffers) != len(layers):
            raise ValueError(f"{len(buffers)} buffers for {len(layers)} layers")
        self.source = source
        """The capture source this recorder keeps (``"hidden"`` rows, probe ``"scores"``):
        what exports ask it by, and what its stream messages are labelled."""
        self.buffers = list(buffers)
        self.layers = tuple(layers)
        self.transform = transform
        self._takes_unknown = _accepts(transform, "unknown")
        self._reads_step = bool(getattr(transform, "reads_step", False))
        """The transform reads each row's request and position, and what the adapter hands
        over (``StepContext.parts``: an attention layer's keys): it gets the step's context
        and the gathered rows' flat indices."""
        """The transform takes ``unknown`` (the step context's rows that wait for sampling:
        the built-in banks); a third party's bank gets next tokens alone."""
        self.slots: tuple[Any, ...] = transform.slots if transform else self.layers
        """What export's ``layers`` argument names: layer indices, or the transform's slots."""
        self.row_width = transform.width if transform else int(buffers[0].shape[1])
        self.row_dtype = transform.dtype if transform else buffers[0].dtype
        self.keep_step_rows = False
        """Keep :attr:`step_rows` for code that reads this step's rows before sampling."""
        self.step_rows: StepRows | None = None
        self.limit_bytes = limit_bytes
        """Per-request cap on retained bytes (0: none); over it the request fails alone."""
        self.rows_by_req: dict[str, RequestRows | OnePass | None] = {}
        self.rows_by_key: dict[str, RequestRows] = {}
        self.held: dict[str, Held] = {}
        """One-pass requests whose kept rows all came in one step, by stream key: where they
        lie in that step's block (no copy, no view per request: an export joins neighbours
        in one piece)."""
        self.streams: dict[str, RequestRows] = {}
        """Streaming requests by engine request id, until they leave the engine."""
        self._touched: dict[int, RequestRows] = {}  # streaming rows written since last taken
        self.steps_recorded = 0
        self.record_ns = 0
        self.export_ns = 0
        # GPU: host copies of earlier steps still in flight, settled at the next step.
        self._in_flight: list[tuple[torch.Tensor, object, list[tuple[RequestRows, int, int, int]]]]
        self._in_flight = []
        self._deferred: tuple[torch.Tensor, np.ndarray, list[Any]] | None = None
        """A step recorded with ``defer``: its device rows, their flat indices and writes,
        until :meth:`complete` fills what sampling decides (or the next step drops it)."""
        self._slot_cache: dict[tuple[Any, ...], list[int] | slice] = {}

    def record(
        self,
        req_ids: Sequence[str],
        query_start: np.ndarray,
        num_computed: np.ndarray,
        plan_for: Callable[[str], RequestPlan | None],
        context: StepContext | None = None,
        defer: bool = False,
    ) -> None:
        """Keep this step's wanted rows.

        Args:
            req_ids: request ids in batch order.
            query_start: ``[len(req_ids) + 1]`` row offsets of each request in the step.
            num_computed: ``[len(req_ids)]`` position of each request's first row.
            plan_for: builds the plan of a request seen for the first time (None: no capture).
            context: the step's context, for a transform that reads each row's next token
                (``reads_next_token``): it gets the kept rows' next tokens on the device and,
                on the host, which of them wait for this step's sampling (``unknown``); or
                that reads the step (``reads_step``): it gets the context and the kept rows'
                flat indices.
            defer: hold the step's rows on the device until :meth:`complete` (the
                transform fills what the step's sampling decides: a lens's target log-prob
                of the token sampled from a request's newest row); :attr:`step_rows` are
                readable before that.
        """
        started = time.perf_counter_ns()
        self.steps_recorded += 1
        self._settle()
        self.step_rows = None
        n = len(req_ids)
        owners: list[RequestRows | OnePass | None] = []
        wanted: list[tuple[int, int]] = []
        known = self.rows_by_req
        for req_id in req_ids:
            rows = known.get(req_id, _UNSEEN)
            if rows is _UNSEEN:
                rows = self._start(req_id, plan_for(req_id))
            owners.append(rows)  # type: ignore[arg-type]
            wanted.append(NOTHING_WANTED if rows is None else rows.wanted)  # type: ignore[union-attr]
        lo, hi = np.array(wanted, dtype=np.int64).reshape(n, 2).T
        starts = query_start[:n].astype(np.int64)
        n_sched = query_start[1 : n + 1].astype(np.int64) - starts
        computed = num_computed[:n].astype(np.int64)
        # np.clip costs several times more than this on small arrays.
        first = np.minimum(np.maximum(lo - computed, 0), n_sched)
        last = np.minimum(np.maximum(hi - computed, 0), n_sched)
        count = np.maximum(last - first, 0)
        total = int(count.sum())
        if total:
            out_offset = np.cumsum(count) - count
            index = (
                np.arange(total, dtype=np.int64)
                - np.repeat(out_offset, count)
                + np.repeat(starts + first, count)
            )
            selective = getattr(self.transform, "selective", False)
            slot_rows = self._slot_rows(owners, count, out_offset) if selective else None
            targets = unknown = None
            if context is not None and getattr(self.transform, "reads_next_token", False):
                targets, unknown = context.next_tokens(index), context.unknown(index)
            step = (context, index) if context is not None and self._reads_step else None
            device_rows = self._gather(index, slot_rows, targets, unknown, step)
            if self.keep_step_rows:
                ends_step = (count > 0) & (last == n_sched)
                self.step_rows = StepRows(
                    device_rows, np.where(ends_step, out_offset + count - 1, -1)
                )
            kept = np.flatnonzero(count)
            # A one-pass request's whole span in this step: held in the block at settling.
            whole = ((computed + first == lo) & (computed + last == hi))[kept].tolist()
            if self.limit_bytes:
                row_bytes = len(self.slots) * self.row_width * self.row_dtype.itemsize
                under = (count[kept] * row_bytes <= self.limit_bytes).tolist()
                whole = [w and u for w, u in zip(whole, under, strict=True)]
            kept_owners = []
            for i, held in zip(kept.tolist(), whole, strict=True):
                owner = owners[i]
                if type(owner) is OnePass and not held:
                    owner = self._rows_of(req_ids[i], owner.plan)
                kept_owners.append(owner)
            writes = list(
                zip(
                    kept_owners,
                    out_offset[kept].tolist(),
                    count[kept].tolist(),
                    (computed + first)[kept].tolist(),
                    strict=True,
                )
            )
            if defer:
                self._deferred = (device_rows, index, writes)
            else:
                self._ship(device_rows, writes)
        self.record_ns += time.perf_counter_ns() - started

    def complete(self, context: StepContext | None) -> None:
        """Finish the step recorded with ``defer``: the transform fills its rows from each
        row's next token, now that sampling drew them (``context``: the step after its
        sampling; ``transform.complete`` gets rows of the step's block -> their next tokens;
        None: not known, as when a step was never sampled), then the rows go to their
        requests."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        started = time.perf_counter_ns()
        device_rows, index, writes = deferred
        tokens = None if context is None else (lambda rows: context.next_tokens(index[rows]))
        self.transform.complete(device_rows, tokens)  # type: ignore[union-attr]
        self._ship(device_rows, writes)
        self.record_ns += time.perf_counter_ns() - started

    def _ship(self, device_rows: torch.Tensor, writes: list[Any]) -> None:
        """Copy a step's rows to the host (on a GPU: started, settled later) for ``writes``."""
        if device_rows.device.type == "cpu":
            self._in_flight.append((device_rows, None, writes))
            self._settle()
            return
        host = torch.empty(device_rows.shape, dtype=device_rows.dtype, pin_memory=True)
        host.copy_(device_rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((host, event, writes))

    def _start(self, req_id: str, plan: RequestPlan | None) -> RequestRows | OnePass | None:
        if (
            plan is not None
            and plan.one_pass
            and plan.error is None
            and not plan.stream
            and plan.keep.latest_from is None
            and plan.keep.dense is not None
            and plan.keep.dense.hi != OPEN
            and plan.key not in self.rows_by_key
        ):
            # No buffer of its own until its rows prove not to come in one step.
            pending = OnePass(plan, (plan.keep.dense.lo, plan.keep.dense.hi))
            self.rows_by_req[req_id] = pending
            return pending
        return self._rows_of(req_id, plan)

    def _rows_of(self, req_id: str, plan: RequestPlan | None) -> RequestRows | None:
        """The request's own :class:`RequestRows` (shared with an earlier engine-side entry
        of the same stream key), registered for ``req_id``."""
        rows = None
        if plan is not None and plan.key in self.rows_by_key:
            rows = self.rows_by_key[plan.key]  # seen before under another engine-side entry
        elif plan is not None:
            shape = (len(self.slots), self.row_width)
            rows = RequestRows(
                plan.key, plan.keep, shape, self.row_dtype, self.limit_bytes, plan.stream
            )
            if plan.layers is not None and plan.layers != self.slots:
                rows.stream_slots = [self.slots.index(layer) for layer in plan.layers]
            self.rows_by_key[plan.key] = rows
            if plan.error is not None:
                rows.fail(plan.error)
                if rows.stream:
                    self._touched[id(rows)] = rows  # take_streamed reports it at once
        if rows is not None and rows.stream:
            self.streams[req_id] = rows
        self.rows_by_req[req_id] = rows
        return rows

    def _slot_rows(
        self, owners: Sequence[RequestRows | OnePass | None], count: np.ndarray, offset: np.ndarray
    ) -> list[np.ndarray] | None:
        """For a selective transform (one that computes each slot on the rows that ask for
        it: SAEs): each slot's rows in this step's block, those of the requests that asked for
        that slot. None: every request asked for every slot."""
        per_slot: list[list[int]] = [[] for _ in self.slots]
        everyone = True
        for i in np.flatnonzero(count).tolist():
            owner = owners[i]
            if type(owner) is OnePass:
                layers = owner.plan.layers
                chosen = None if layers is None else self._slots_of(layers)
            else:
                chosen = owner.stream_slots if owner is not None else None
            if chosen is None or isinstance(chosen, slice):
                for rows in per_slot:
                    rows.append(i)
                continue
            everyone = False
            for slot in chosen:
                per_slot[slot].append(i)
        if everyone:
            return None
        return [
            np.concatenate([np.arange(offset[i], offset[i] + count[i]) for i in asked])
            if asked
            else np.empty(0, dtype=np.int64)
            for asked in per_slot
        ]

    def _gather(
        self,
        index: np.ndarray,
        slot_rows: list[np.ndarray] | None = None,
        next_tokens: torch.Tensor | None = None,
        unknown: np.ndarray | None = None,
        step: tuple[StepContext, np.ndarray] | None = None,
    ) -> torch.Tensor:
        """Gather rows of every layer on the device (transformed, if so built; a selective
        transform computes each slot on ``slot_rows`` alone; ``next_tokens``: each gathered
        row's next token, for a transform that reads them, and ``unknown``, where in the
        gathered rows it waits for sampling, on the host; ``step``: the step's context and
        the gathered rows' flat indices, for a transform that ``reads_step``); the device
        rows."""
        transform: Any = self.transform
        if slot_rows is not None:
            transform = functools.partial(transform, slot_rows=slot_rows)
        if step is not None:
            transform = functools.partial(transform, context=step[0], step_rows=step[1])
        if next_tokens is not None:
            held = {"unknown": unknown} if self._takes_unknown else {}
            transform = functools.partial(transform, next_tokens=next_tokens, **held)
        buf0 = self.buffers[0]
        lo = int(index[0])
        # The index rises strictly (batch order, then position): one run when its ends say
        # so, as when every token of a step is kept (prompt rows of a pooling batch).
        run = int(index[-1]) - lo + 1 == len(index)
        if run and transform is not None:
            # The transform computes new tensors: it may read the buffers in place.
            staged = transform([buf[lo : lo + len(index)] for buf in self.buffers])
        else:
            staged = torch.empty(
                (len(self.buffers), len(index), buf0.shape[1]),
                dtype=buf0.dtype,
                device=buf0.device,
            )
            if run:
                for layer_slot, buf in enumerate(self.buffers):
                    staged[layer_slot].copy_(buf[lo : lo + len(index)])
            else:
                idx = torch.from_numpy(index).to(buf0.device, non_blocking=True)
                for layer_slot, buf in enumerate(self.buffers):
                    torch.index_select(buf, 0, idx, out=staged[layer_slot])
            if transform is not None:
                staged = transform(staged)
        return staged

    def _settle(self) -> None:
        """Copy finished host transfers into the requests' own buffers; drop the staging. A
        deferred step never completed (no sampling followed) goes with what it has."""
        if self._deferred is not None:
            self.complete(None)
        for staged, ready, writes in self._in_flight:
            if ready is not None:
                ready.synchronize()  # type: ignore[attr-defined]
            host = host_view(staged)
            for rows, offset, count, first in writes:
                if type(rows) is OnePass:
                    # The step's block lives until its last held request is exported; it
                    # holds only rows requests keep.
                    self.held[rows.plan.key] = (host, offset, count, first)
                    continue
                rows.write(host[:, offset : offset + count], first)
                if rows.stream:
                    self._touched[id(rows)] = rows
        self._in_flight.clear()

    def take_streamed(
        self, live_req_ids: Container[str]
    ) -> list[tuple[str, int, np.ndarray | None, str | None]]:
        """Hand over the rows streaming requests gained since the last call, as
        ``(key, first position, rows [slots, count, width], None)``, or ``(key, 0, None,
        reason)`` once for a request whose capture failed; then forget streaming requests
        that left the engine (``live_req_ids``: the engine's current requests).

        Rows are handed over only up to the first gap, so a stream's chunks are contiguous
        and in order.
        """
        if not self.streams:
            return []
        self._settle()  # on a GPU this waits for the step's copy: the token must not outrun it
        out: list[tuple[str, int, np.ndarray | None, str | None]] = []
        for rows in self._touched.values():
            if rows.error is not None:
                if not rows.error_sent:
                    rows.error_sent = True
                    out.append((rows.key, 0, None, rows.error))
                continue
            count = rows.ready()
            if count and rows.data is not None and not rows.closed:
                first = max(rows.cursor, rows.base)  # a decode-only stream starts at P - 1
                start = first - rows.base
                chunk = rows.data[rows.stream_slots, start : start + count]
                if isinstance(rows.stream_slots, slice):
                    chunk = chunk.copy()  # a view of the buffer, which is reused
                out.append((rows.key, first, chunk, None))
                rows.advance(first + count)
        self._touched.clear()
        for req_id in [r for r in self.streams if r not in live_req_ids]:
            rows = self.streams.pop(req_id)
            if rows.error is not None and not rows.error_sent:
                rows.error_sent = True
                out.append((rows.key, 0, None, rows.error))
            self.rows_by_req.pop(req_id, None)
            if self.rows_by_key.get(rows.key) is rows:
                del self.rows_by_key[rows.key]
            rows.close()
        return out

    def export(
        self, key: str, spans: Sequence[Span], layers: Sequence[int], final: bool
    ) -> tuple[list[torch.Tensor], list[ExportedSpan], str | None]:
        """Hand over ``[len(layers), len(span), hidden]`` per span, in order; free them.

        Positions below the highest ``hi`` asked for are freed. ``final`` forgets the request.
        Returns the tensors, where each span landed (with missing positions), and the
        request's failure reason, if it failed (its rows are gone).
        """
        started = time.perf_counter_ns()
        if self._in_flight or self._deferred is not None:
            self._settle()
        rows = self.rows_by_key.get(key)
        if rows is None and key in self.held:
            rows = self.rows_by_key[key] = self._unhold(key)
        slots = self._slots_of(layers)
        tensors: list[torch.Tensor] = []
        results: list[ExportedSpan] = []
        error = rows.error if rows is not None else None
        for span in spans:
            if rows is None or error is not None:
                count = len(slots) if isinstance(slots, list) else len(self.slots)
                out = torch.empty((count, len(span), self.row_width), dtype=self.row_dtype)
                missing = list(range(span.lo, span.hi))
            else:
                out, missing = rows.read(span, slots)
            results.append(ExportedSpan(len(tensors), span.lo, span.hi, missing))
            tensors.append(out)
        if rows is not None:
            if final:
                self.rows_by_key.pop(key, None)
                rows.close()
            elif spans:
                rows.advance(max(span.hi for span in spans))
        self.export_ns += time.perf_counter_ns() - started
        return tensors, results, error

    def _slots_of(self, layers: Sequence[Any]) -> list[int] | slice:
        """The slots of ``layers``; all of them: a slice (a view instead of a gather). Worked
        out once per distinct list: an export asks it for every request."""
        named = tuple(layers)
        slots = self._slot_cache.get(named)
        if slots is None:
            listed = [self.slots.index(layer) for layer in named]
            slots = slice(None) if listed == list(range(len(self.slots))) else listed
            self._slot_cache[named] = slots
        return slots if isinstance(slots, slice) else list(slots)

    def export_final(
        self, keys: Sequence[str], spans: Sequence[Span], layers: Sequence[Any]
    ) -> tuple[torch.Tensor, list[tuple[int, list[int]]], dict[str, str]]:
        """:meth:`export` of one span per stream, final, for many streams at once (the
        finished requests of a pooling batch): the spans back to back in one
        ``[len(layers), total positions, width]`` tensor, in order.

        Returns the tensor, ``(item index, missing positions)`` for each item with missing
        positions, and the failure reason of each failed stream by key.
        """
        started = time.perf_counter_ns()
        if self._in_flight or self._deferred is not None:
            self._settle()
        slots = self._slots_of(layers)
        num_slots = len(slots) if isinstance(slots, list) else len(self.slots)
        total = sum(len(span) for span in spans)
        out = torch.empty((num_slots, total, self.row_width), dtype=self.row_dtype)
        host = host_view(out)
        incomplete: list[tuple[int, list[int]]] = []
        failures: dict[str, str] = {}
        # Held rows are cut from their step's block, neighbours in one piece (requests are
        # usually exported in the order they ran); the others are read into a piece of their
        # own. One concatenate joins the pieces.
        pieces: list[np.ndarray] = []
        held = self.held
        run: list[Any] = [None, 0, 0]  # a step block, and the rows of it to take next
        for index, (key, span) in enumerate(zip(keys, spans, strict=True)):
            entry = held.pop(key, None)
            if entry is not None:
                block, offset, n_rows, first = entry
                if span.lo == first and span.hi == first + n_rows:
                    if block is run[0] and offset == run[2]:
                        run[2] += n_rows
                    else:
                        self._cut(run, slots, pieces)
                        run[:] = block, offset, offset + n_rows
                    continue
                rows = self._unhold(key, entry)  # asked for other positions than it holds
            else:
                rows = self.rows_by_key.pop(key, None)
            self._cut(run, slots, pieces)
            piece = np.empty((num_slots, len(span), self.row_width), dtype=host.dtype)
            if rows is None or rows.error is not None:
                if rows is not None:
                    failures[key] = rows.error  # type: ignore[assignment]
                missing = list(range(span.lo, span.hi))
            else:
                missing = rows.read_into(piece, span, slots)
            if missing:
                incomplete.append((index, missing))
            pieces.append(piece)
            if rows is not None:
                rows.close()
        self._cut(run, slots, pieces)
        if pieces:
            np.concatenate(pieces, axis=1, out=host)
        self.export_ns += time.perf_counter_ns() - started
        return out, incomplete, failures

    @staticmethod
    def _cut(run: list[Any], slots: list[int] | slice, pieces: list[np.ndarray]) -> None:
        """Add the rows ``run`` names (``[block, lo, hi]``; no block: none) to ``pieces``, in
        the asked layer slots; empty ``run``."""
        block, lo, hi = run
        if block is not None:
            pieces.append(block[:, lo:hi] if isinstance(slots, slice) else block[slots, lo:hi])
            run[0] = None

    def _unhold(self, key: str, entry: Held | None = None) -> RequestRows:
        """The held rows of ``key`` as a :class:`RequestRows` of their own (for an export
        that asks other positions than it holds, or not all at once)."""
        block, offset, count, first = self.held.pop(key) if entry is None else entry
        rows_view = block[:, offset : offset + count]
        keep = KeepPlan(Span(first, first + count), None)
        rows = RequestRows(key, keep, (len(self.slots), self.row_width), self.row_dtype, 0)
        rows.data, rows.filled = rows_view, _all_filled(count)
        return rows

    def pending(self) -> int:
        """Streams whose rows wait for an export (held or in a buffer of their own)."""
        return len(self.rows_by_key) + len(self.held)

    def forget(self, key_prefixes: Iterable[str]) -> int:
        """Drop the rows of requests whose stream key starts with any prefix; return how many."""
        prefixes = tuple(key_prefixes)
        self._settle()
        doomed = [k for k in self.rows_by_key if k.startswith(prefixes)]
        for key in doomed:
            self.rows_by_key.pop(key).close()
        dropped = [k for k in self.held if k.startswith(prefixes)]
        for key in dropped:
            del self.held[key]
        return len(doomed) + len(dropped)

    def fail_request(self, req_id: str, reason: str) -> None:
        """Fail the capture of an engine request this recorder keeps rows for (the step could
        not do what the request asked, e.g. steer it); a stream reports it at once."""
        rows = self.rows_by_req.get(req_id)
        if type(rows) is not RequestRows or rows.error is not None:
            return  # none kept (a one-pass request is never steered)
        rows.fail(reason)
        if rows.stream:
            self._touched[id(rows)] = rows

    def bound(self, live_req_ids: Collection[str]) -> None:
        """Keep the per-engine-request table bounded between exports: once it holds more
        than twice the engine's requests (plus :data:`DEPARTED_SLACK`), drop the entries of
        those that left. A front end that never exports (``AsyncLLM``, a server whose
        requests mostly capture nothing) would otherwise leave one entry per request ever
        run. Amortised: one pass per ``DEPARTED_SLACK`` requests or more."""
        if len(self.rows_by_req) > 2 * len(live_req_ids) + DEPARTED_SLACK:
            self.forget_departed(live_req_ids)

    def forget_departed(self, live_req_ids: Iterable[str]) -> None:
        """Drop per-engine-request entries of requests that have left the engine.

        Their rows stay under their stream key until exported or forgotten.
        """
        live = set(live_req_ids)
        for req_id in [r for r in self.rows_by_req if r not in live]:
            del self.rows_by_req[req_id]

    def retained_bytes(self) -> int:
        self._settle()
        held = sum(block[:, :count].nbytes for block, _, count, _ in self.held.values())
        return held + sum(rows.nbytes for rows in self.rows_by_key.values())

    def failed_keys(self) -> dict[str, str]:
        return {k: r.error for k, r in self.rows_by_key.items() if r.error is not None}


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor; bfloat16, which numpy lacks, as its int16 bits."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


NOTHING_WANTED = (OPEN, 0)
_NONE_FILLED = np.zeros(0, dtype=bool)
_FILLED = np.ones(4096, dtype=bool)


def _all_filled(count: int) -> np.ndarray:
    """``filled`` of ``count`` positions that all arrived: a view of one shared array (a
    later write of the same positions sets True where True already is)."""
    return _FILLED[:count] if count <= len(_FILLED) else np.ones(count, dtype=bool)


def _wanted(keep: KeepPlan, cursor: int) -> tuple[int, int]:
    """Positions a step must copy for a request: its dense span and its latest slot, from
    its cursor on."""
    lo, hi = NOTHING_WANTED
    if keep.dense is not None:
        lo, hi = max(keep.dense.lo, cursor), keep.dense.hi
    if keep.latest_from is not None:
        lo, hi = min(lo, max(keep.latest_from, cursor)), OPEN
    return lo, hi


def _accepts(function: Any, name: str) -> bool:
    """Whether ``function`` (a transform: a callable bank, or None) takes keyword ``name``."""
    if function is None:
        return False
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
