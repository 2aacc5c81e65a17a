"""Attaching streamed rows and scores to each output a streaming front end yields.

One :class:`RequestStream` per user request. For every output vLLM yields, it asks the
:class:`~probehook.frontend.stream_receiver.Receiver` for the rows of the tokens the output holds
(waiting, if need be, for the few microseconds the worker's push may trail the token) and sets
the same attributes the offline ``LLM`` sets, with the same row semantics:

- ``cumulative`` (vLLM's default): every row to date;
- ``delta``: only the rows of the tokens this output adds (prefill rows in the first output
  that has tokens);
- ``final``: everything, once.

This module knows nothing about vLLM.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch

from probehook.core.spans import Span, completion_spans, score_config
from probehook.core.stream_frames import StreamFailed
from probehook.frontend.session import (
    CaptureSession,
    FailedCapture,
    RequestTag,
    attributes_of,
    clear_outputs,
    ended_on_stop_token,
    is_pooled,
    mirror_first_completion,
    note_steering,
)
from probehook.frontend.stream_receiver import Receiver

Kind = Literal["cumulative", "delta", "final"]


class RequestStream:
    """Per-request state of a stream: tokens seen per completion, whether prefill rows went."""

    def __init__(self, session: CaptureSession, receiver: Receiver, tag: RequestTag, kind: Kind):
        self.session = session
        self.receiver = receiver
        self.tag = tag
        self.kind = kind
        self.seen: dict[int, int] = {}  # completion index -> tokens yielded so far
        self.gate_started: dict[int, int] = {}  # completion index -> first steered position
        self.prefill_sent = False
        self.stored = False
        # Delta mode: every token and all text so far, per completion, for the store.
        self.history: dict[int, tuple[list[int], str]] = {}

    async def attach(self, output: Any) -> None:
        """Set ``hidden_states``, ``probe_scores``, ``probe_flags`` (and the prefill twins)
        on ``output`` and its completions; name the probe that stopped a finished one; store
        a finished request when the engine has a store."""
        delta = self.kind == "delta"
        if delta and self.session.store is not None:
            for c in output.outputs:
                tokens, text = self.history.get(c.index, ([], ""))
                self.history[c.index] = (tokens + list(c.token_ids), text + (c.text or ""))
        await self._attach(output, delta)
        if output.finished and self.session.store is not None and not self.stored:
            whole = await self._whole(output) if delta else output
            self.stored = True
            self.session.store_output(whole, self.tag)
            output.store_id = getattr(whole, "store_id", None)

    async def _whole(self, output: Any) -> Any:
        """A copy of a delta stream's final output holding every token and row, as a
        cumulative stream's final output would."""
        whole = copy.copy(output)
        whole.outputs = []
        for c in output.outputs:
            full = copy.copy(c)
            full.token_ids, full.text = self.history.get(c.index, ([], ""))
            whole.outputs.append(full)
        await self._attach(whole, delta=False)
        return whole

    async def _attach(self, output: Any, delta: bool) -> None:
        clear_outputs(output)
        if self.tag.steering is not None:
            note_steering(output, self.tag.steering)
        tag, config = self.tag, self.tag.config
        assert config is not None
        prompt_len = len(output.prompt_token_ids or [])
        if is_pooled(output):
            await self._attach_pooled(output, prompt_len)
            return
        send_prefill = not delta or not self.prefill_sent
        for completion in output.outputs:
            index = completion.index
            before = self.seen.get(index, 0) if delta else 0
            total = before + len(completion.token_ids)
            self.seen[index] = total
            # total == 0: an early abort; the output holds nothing computed, so no rows
            # are taken, but it keeps its shape (every asked layer and probe, 0 rows).
            take = total > 0
            prefill = send_prefill and take
            key = f"{tag.tag}/{index}"
            has_prefill = config.include_prefill and index == 0
            if config.layers:
                spans = completion_spans(config, prompt_len, total, index)
                await self._fill(
                    "hidden", key, spans, before, prompt_len, prefill, output, completion
                )
            if tag.probes is not None and tag.probes.names:
                spans = completion_spans(score_config(config), prompt_len, total, index)
                await self._fill(
                    "scores", key, spans, before, prompt_len, prefill, output, completion
                )
                if take:
                    await self._act_on_scores(key, spans[1], before, delta, output, completion)
                    self._gate_start(index, before, prompt_len, completion)
            self.prefill_sent = self.prefill_sent or (has_prefill and take)
        mirror_first_completion(output)

    def _gate_start(self, index: int, before: int, prompt_len: int, completion: Any) -> None:
        """Where probe-gated steering started: the position after the first decode row that
        crossed, remembered across a delta stream's outputs."""
        steer = self.tag.steering
        if steer is None or not steer.gates or self.session.probes is None:
            return
        if index not in self.gate_started:
            scores = completion.probe_scores
            gate = steer.gates[0]
            if not isinstance(scores, FailedCapture) and gate.probe in scores:
                first = self.session.probes.first_crossing(gate, scores[gate.probe])
                if first is not None:
                    self.gate_started[index] = prompt_len + before + first
        if completion.steering is not None:
            completion.steering["start"] = self.gate_started.get(index)

    async def _attach_pooled(self, output: Any, prompt_len: int) -> None:
        """A pooling model's one output: every row is an input (prompt) row."""
        tag, config = self.tag, self.tag.config
        assert config is not None
        key = f"{tag.tag}/0"
        wanted = [("hidden", config)] if config.layers else []
        if tag.probes is not None and tag.probes.names:
            wanted.append(("scores", score_config(config)))
        for source, spans_config in wanted:
            attribute = attributes_of(source)[0]
            prefill, _ = completion_spans(spans_config, prompt_len, 0)
            assert prefill is not None  # pooling engines capture every input row
            try:
                rows = await self.receiver.take(source, key, prefill.lo, prefill.hi)
                setattr(output, attribute, self._value(source, rows))
            except StreamFailed as e:
                setattr(output, attribute, FailedCapture(str(e)))
                output.capture_error = str(e)
        mirror_first_completion(output)

    async def _fill(
        self,
        source: str,
        key: str,
        spans: tuple[Span | None, Span | None],
        before: int,
        prompt_len: int,
        send_prefill: bool,
        output: Any,
        completion: Any,
    ) -> None:
        prefill, decode = spans
        on_request, on_completion = attributes_of(source)
        try:
            # A span this output holds no positions of still gets its keys, with 0 rows.
            if prefill is not None:
                if send_prefill:
                    rows = await self.receiver.take(source, key, prefill.lo, prefill.hi)
                    value = self._value(source, rows)
                else:
                    value = self.session.no_rows(source, self.tag)
                setattr(output, on_request, value)
            if decode is not None:
                # Only the rows of tokens this output adds, in delta mode.
                lo = max(decode.lo, prompt_len - 1 + before)
                if lo < decode.hi:
                    rows = await self.receiver.take(source, key, lo, decode.hi)
                    value = self._value(source, rows)
                else:
                    value = self.session.no_rows(source, self.tag)
                setattr(completion, on_completion, value)
        except StreamFailed as e:
            failed = FailedCapture(str(e))
            for target, attribute in ((output, on_request), (completion, on_completion)):
                setattr(target, attribute, failed)
            completion.capture_error = str(e)

    def _value(self, source: str, rows: torch.Tensor) -> dict[Any, torch.Tensor]:
        assert self.tag.config is not None
        if source == "hidden":
            return dict(zip(self.tag.config.layers, rows, strict=True))
        assert self.session.probes is not None and self.tag.probes is not None
        return self.session.probes.split(rows[0], self.tag.probes.names)

    async def _act_on_scores(
        self, key: str, decode: Span | None, before: int, delta: bool, output: Any, completion: Any
    ) -> None:
        """Flags over every score to date (only new crossings in delta mode); the probe's
        name on ``stop_reason`` when a stop monitor ended the completion."""
        probes, tag = self.session.probes, self.tag
        assert probes is not None and tag.probes is not None
        if not tag.probes.monitors or decode is None or len(decode) == 0:
            return
        if isinstance(completion.probe_scores, FailedCapture):
            return
        scores = probes.split(
            (await self.receiver.take("scores", key, decode.lo, decode.hi))[0], tag.probes.names
        )
        stopped = output.finished and ended_on_stop_token(tag, completion)
        flags, stop_reason = probes.flags_and_stop(tag.probes, scores, stopped)
        if delta:
            flags = {name: [p for p in where if p >= before] for name, where in flags.items()}
        completion.probe_flags = flags
        if stop_reason is not None:
            completion.stop_reason = stop_reason
