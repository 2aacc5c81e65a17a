"""Filling each output a streaming front end yields with its streamed rows and scores.

One :class:`RequestStream` per user request. For every output vLLM yields, it plans the rows
of the tokens the output holds (:func:`probehook.frontend.fill.plan`, from what earlier
outputs held), asks the :class:`~probehook.frontend.stream_receiver.Receiver` for them
(waiting, if need be, for the few microseconds the worker's push may trail the token) and
sets them with :func:`probehook.frontend.fill.apply`: the algorithm and attributes of the
offline ``LLM``, with the same row semantics:

- ``cumulative`` (vLLM's default): every row to date;
- ``delta``: only the rows of the tokens this output adds (prefill rows in the first output
  that has tokens);
- ``final``: everything, once.

This module knows nothing about vLLM.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import Executor
from typing import Any, Literal

from probehook.core.stream_frames import StreamFailed
from probehook.frontend.fill import (
    FailedCapture,
    Need,
    OutputPlan,
    Progress,
    apply,
    plan,
    reset,
)
from probehook.frontend.session import CaptureSession
from probehook.frontend.stream_receiver import Receiver
from probehook.frontend.tracked_request import TrackedRequest
from probehook.outputs.shapes import completions
from probehook.store.records import store_filled

Kind = Literal["cumulative", "delta", "final"]


class RequestStream:
    """Per-request state of a stream: what earlier outputs held, whether it was stored."""

    def __init__(
        self,
        session: CaptureSession,
        receiver: Receiver,
        request: TrackedRequest,
        kind: Kind,
        store_thread: Executor | None = None,
    ):
        self.session = session
        self.store_thread = store_thread
        """Where the store add runs (its backpressure and first fsync wait on the disk: never
        on the event loop). None: in the caller, as offline."""
        self.receiver = receiver
        self.request = request
        self.kind = kind
        self.progress = Progress(delta=kind == "delta")
        self.stored = False
        # Delta mode: every token and every piece of text so far, per completion, for the
        # store (appended in place: a long stream must not copy its history per output).
        self.history: dict[int, tuple[list[int], list[str]]] = {}
        self.decoded: dict[Any, Any] = {}
        """What sources decoded of this stream's rows (each row once: :meth:`stream_value`)."""

    async def fill(self, output: Any) -> None:
        """Set ``hidden_states``, ``probe_scores``, ``probe_flags`` (and the prefill twins)
        on ``output`` and its completions; name the probe that stopped a finished one; store
        a finished request when the engine has a store."""
        delta = self.kind == "delta"
        if delta and self.session.store is not None:
            for c in output.outputs:
                tokens, texts = self.history.setdefault(c.index, ([], []))
                tokens.extend(c.token_ids)
                texts.append(c.text or "")
        await self._fill(output, self.progress)
        if output.finished and self.session.store is not None and not self.stored:
            whole = await self._whole(output) if delta else output
            self.stored = True
            store = self.session.store
            if self.store_thread is None:
                store_filled(store, whole, self.request)
            else:
                await asyncio.get_running_loop().run_in_executor(
                    self.store_thread, store_filled, store, whole, self.request
                )
            output.store_id = getattr(whole, "store_id", None)

    async def _whole(self, output: Any) -> Any:
        """A copy of a delta stream's final output holding every token and row, as a
        cumulative stream's final output would."""
        whole = copy.copy(output)
        whole.outputs = []
        for c in output.outputs:
            full = copy.copy(c)
            tokens, texts = self.history.get(c.index, ([], []))
            full.token_ids, full.text = list(tokens), "".join(texts)
            whole.outputs.append(full)
        await self._fill(whole, None)  # the whole request, as offline
        return whole

    async def _fill(self, output: Any, progress: Progress | None) -> None:
        # vLLM grows a cumulative output's token list in place, and its output handler may
        # append a token while the rows are awaited: plan again until no token came in
        # meanwhile (no await between the last check and apply), so rows match tokens. A
        # delta output is never grown, and its plan advances the stream's progress: once.
        while True:
            tokens = _token_counts(output)
            reset(output, self.request)
            planned = plan(output, self.request, self.session.sources, progress)
            got = await self._take(planned)
            if self.kind == "delta" or _token_counts(output) == tokens:
                break
        apply(planned, got, self.session.sources)

    async def _take(self, planned: OutputPlan) -> dict[Need, Any]:
        """Each need's rows from the receiver, as values (a failed stream: FailedCapture)."""
        got: dict[Need, Any] = {}
        for need in planned.needs():
            if need.hi <= need.lo or need in got:
                continue  # an empty range: 0 rows, every key
            try:
                rows = await self.receiver.take(need.source, need.key, need.lo, need.hi)
            except StreamFailed as e:
                got[need] = FailedCapture(str(e))
                continue
            source = self.session.sources[need.source]
            got[need] = source.stream_value(rows, need.lo, need.key, self.request, self.decoded)
        return got


def _token_counts(output: Any) -> list[int]:
    """How many tokens each completion of ``output`` holds now."""
    return [len(c.token_ids) for c in completions(output)]
