"""Methods mixed into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

Only control messages and small manifests travel through vLLM's RPC; the rows themselves go
through the transport (``probehook.worker.transport_writer``) as raw bytes.

With tensor parallelism every rank holds the complete residual stream after each layer. Rank 0
records hidden rows and answers exports; probe scores are computed on every rank, because
every rank samples and a monitor's stop must be forced on all of them alike. The other ranks
free their scores when rank 0 exports them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from probehook.adapter.worker import runner_v1
from probehook.adapter.worker.loader import StepHook, register_loader, step_hook
from probehook.core.export_wire import (
    BatchAsk,
    BatchReport,
    ExportReply,
    SpanReport,
    StreamAsk,
    stream_id,
)
from probehook.core.request_options import EXTRA_ARGS_KEY, PLAN_KEY
from probehook.core.spans import Span
from probehook.core.steering_wire import vectors_from_wire
from probehook.core.stream_frames import encode
from probehook.worker.clamp_tables import StepClamps
from probehook.worker.recorder import RequestPlan, StepRecorder
from probehook.worker.steering_bank import StepSteering
from probehook.worker.stream_publisher import Publisher
from probehook.worker.transport_writer import write_tensors_with_fallback

MAX_MISSING_REPORTED = 8
MAX_CACHED_PLANS = 4096
PlanFor = Callable[[str], RequestPlan | None]


# vLLM imports this class (``worker_extension_cls``) in every worker of a probehook engine,
# before the model loads, whatever the executor: the loader is known there even where the
# plugin's PROBEHOOK_ENGINE was not inherited (vLLM's Ray executor passes only VLLM_ variables).
register_loader()


def _hook(worker: Any) -> StepHook:
    return step_hook(worker.model_runner.get_model())


def _reports(worker: Any) -> bool:
    """Whether this worker answers exports (rank 0; the others hold the same data)."""
    return getattr(worker, "rank", 0) == 0


def _recorder(hook: StepHook, source: str) -> StepRecorder | None:
    """The recorder of ``source`` (None: this engine records no such source)."""
    return next((r for r in hook.recorders() if r.source == source), None)


EVERY_RANK = ("scores", "sae")
"""Sources every rank records (each rank samples, so a monitor's stop must be forced on all
alike); hidden rows are recorded by rank 0 alone. Of SAE features the other ranks record only
the requests a feature stop monitor watches (:data:`STOPS_ONLY_OFF_RANK_0`): every rank holds
the SAEs, but only rank 0 answers exports."""
STOPS_ONLY_OFF_RANK_0 = ("sae",)


def _answers(worker: Any, source: str) -> bool:
    """Whether this worker records (and so exports) ``source``."""
    return source in EVERY_RANK or _reports(worker)


class ProbehookWorkerExtension:
    """Worker-side RPC surface of probehook."""

    def probehook_start_recording(self, limit_bytes: int = 0) -> dict[str, Any] | None:
        """Start recording requests' rows, probe scores and SAE features, and steering them;
        steps before this (warm-up) are ignored. The banks (probes, steering vectors, SAEs)
        were allocated at model load (``StepHook.allocate_banks``)."""
        hook = _hook(self)
        runner = self.model_runner  # type: ignore[attr-defined]
        runner_v1.check_runner(runner)
        steer = hook.steer
        steerable = steer.bank.rows.__contains__ if steer is not None else None
        # The stop processors of this worker's batch read this step's scores and features.
        runner_v1.hand_hook_to_processors(runner, hook)
        if hook.recorder is not None:
            hook.recorder.limit_bytes = int(limit_bytes)
        active = [r for r in hook.recorders() if _answers(self, r.source)]
        # The recorders meet each new request in the same step: the first to read its wire
        # leaves what it read to the others.
        signatures = SharedReads(len(active) - 1) if len(active) > 1 else None
        recorders = [
            (
                recorder,
                _reuse_plans(
                    runner,
                    runner_v1.plan_factory(
                        runner,
                        hook.config,
                        recorder.source,
                        steerable,
                        recorder.slots,
                        stops_only=recorder.source in STOPS_ONLY_OFF_RANK_0 and not _reports(self),
                    ),
                    signatures,
                ),
            )
            for recorder in active
        ]
        if getattr(self, "_probehook_publisher", None) is None:
            self._probehook_publisher = Publisher(None)  # until a stream connects

        clamps = StepClamps(hook.clamp_buffers) if hook.clamp_buffers else None
        self._probehook_clamps = clamps
        before_forward = on_schedule = None
        if steer is not None:
            steer_plan = runner_v1.steering_factory(runner, steerable)

            def on_schedule(scheduled: Any) -> None:
                steer.finish(getattr(scheduled, "finished_req_ids", None) or ())

        if steer is not None or clamps is not None:
            clamp_plan = runner_v1.clamp_factory(runner, tuple(hook.clamp_buffers))

            def before_forward(scheduled: Any) -> None:
                if steer is not None:
                    runner_v1.prepare_steering(runner, steer, steer_plan)
                if clamps is not None:
                    runner_v1.prepare_clamps(runner, clamps, clamp_plan)

        scorer = hook.scorer

        def on_step() -> None:
            runner_v1.record_step(runner, recorders)
            if steer is not None and steer.failed:  # fail those requests alone, named
                for req_id, reason in steer.take_failed().items():
                    for recorder, _ in recorders:
                        recorder.fail_request(req_id, f"probehook could not steer it ({reason})")
            if steer is not None and scorer is not None and scorer.step_rows is not None:
                steer.check_gates(scorer.step_rows.rows, scorer.step_rows.last_row)
            for recorder, _ in recorders:
                _publish(recorder, self._probehook_publisher, runner.requests)
                recorder.bound(runner.requests)
            if clamps is not None:
                clamps.bound(runner.requests)

        hook.install_on(runner, on_step, before_forward, on_schedule)
        if not _reports(self):
            return None
        return {
            "layers": list(hook.config.layers),
            "tapped_layers": sorted(hook.buffers),
            "steered_layers": sorted(hook.steering.tables) if hook.steering else [],
            "banks": hook.banks,  # allocated at load
            # Capture-only engines stop early: the decoder layers run, and what was cut.
            "layers_run": hook.layers_run,
            "cut": list(hook.cut),
            "hidden_size": hook.hidden_size,
            "dtype": str(hook.dtype),
            "runner": f"{type(runner).__module__}.{type(runner).__name__}",
            # What this worker process inherited (probehook sets 0 while the engine starts).
            "runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        }

    def probehook_export(
        self,
        paths: list[str],
        requests: list[dict[str, Any]],
        batches: list[dict[str, Any]] | None = None,
    ) -> dict | None:
        """Hand over the asked spans of each stream; free them (and forget final streams).

        ``requests``: :class:`~probehook.core.export_wire.StreamAsk` wires (score requests
        name the slot ``"scores"``); ``batches``: :class:`~probehook.core.export_wire.BatchAsk`
        wires, one final span of many streams each, whose spans come back back to back in one
        tensor. Returns an :class:`~probehook.core.export_wire.ExportReply` wire (rank 0)."""
        started = time.perf_counter_ns()
        hook = _hook(self)
        tensors: list[Any] = []
        reply = ExportReply()
        for ask in map(StreamAsk.from_wire, requests):
            if not _answers(self, ask.source):
                continue  # only rank 0 records rows; the other ranks free their scores
            recorder = _recorder(hook, ask.source)
            if recorder is None:
                raise ValueError(f"export from {ask.source!r}, which this engine does not record")
            spans = [Span(lo, hi) for lo, hi in ask.spans]
            got, exported, error = recorder.export(ask.key, spans, ask.layers, ask.final)
            if error is not None:
                reply.failures[stream_id(ask.source, ask.key)] = error
            reply.spans += [
                SpanReport(
                    ask.key,
                    ask.source,
                    item.lo,
                    item.hi,
                    len(tensors) + item.tensor_index,
                    len(item.missing),
                    item.missing[:MAX_MISSING_REPORTED],
                )
                for item in exported
            ]
            tensors.extend(got)
        for batch in map(BatchAsk.from_wire, batches or ()):
            if not _answers(self, batch.source):
                continue
            recorder = _recorder(hook, batch.source)
            if recorder is None:
                raise ValueError(f"export from {batch.source!r}, which this engine does not record")
            spans = [Span(lo, hi) for lo, hi in batch.pairs()]
            tensor, incomplete, failed = recorder.export_final(batch.keys, spans, batch.layers)
            for key, error in failed.items():
                reply.failures[stream_id(batch.source, key)] = error
            reply.batches.append(
                BatchReport(
                    len(tensors),
                    [
                        (i, len(missing), missing[:MAX_MISSING_REPORTED])
                        for i, missing in incomplete
                    ],
                )
            )
            tensors.append(tensor)
        live = runner_v1.live_request_ids(self.model_runner)  # type: ignore[attr-defined]
        for recorder in hook.recorders():
            recorder.forget_departed(live)
        if not _reports(self):
            return None
        written = time.perf_counter_ns()
        if tensors:
            reply.path, reply.entries = write_tensors_with_fallback(paths, tensors)
        self._probehook_write_ns = getattr(self, "_probehook_write_ns", 0) + (
            time.perf_counter_ns() - written
        )
        self._probehook_export_rpc_ns = getattr(self, "_probehook_export_rpc_ns", 0) + (
            time.perf_counter_ns() - started
        )
        return reply.to_wire()

    def probehook_steering_add(self, name: str, wire: dict[str, Any]) -> bool:
        """Put a vector into this worker's bank (every rank holds the whole stream, so every
        rank steers)."""
        steer = _steering_of(self)
        steer.bank.add(name, vectors_from_wire(wire, steer.bank.hidden))
        return True

    def probehook_steering_remove(self, name: str) -> bool:
        """Take a vector out of the bank. Requests already steered keep their sums."""
        _steering_of(self).bank.remove(name)
        return True

    def probehook_stream_connect(self, address: str) -> bool | None:
        """Push streaming requests' rows and scores to the front end's socket at ``address``
        (rank 0; the other ranks drop theirs)."""
        old = getattr(self, "_probehook_publisher", None)
        if old is not None:
            old.close()
        self._probehook_publisher = Publisher(address if _reports(self) else None)
        return True if _reports(self) else None

    def probehook_forget(self, key_prefixes: list[str]) -> int | None:
        """Drop rows nobody will collect (aborted, failed or interrupted requests)."""
        hook = _hook(self)
        dropped = sum(r.forget(key_prefixes) for r in hook.recorders())
        return dropped if _reports(self) else None

    def probehook_stats(self) -> dict[str, int] | None:
        """Counters for tests, debugging and the benchmark."""
        hook = _hook(self)
        steer = hook.steer
        recorders = hook.recorders()
        publisher = getattr(self, "_probehook_publisher", None)
        if publisher is not None:  # streams whose requests left since the last step
            for recorder in recorders:
                _publish(recorder, publisher, self.model_runner.requests)  # type: ignore[attr-defined]
        if not _reports(self):
            return None
        return {
            "pending_streams": sum(len(r.streams) for r in recorders),
            "steps_recorded": max((r.steps_recorded for r in recorders), default=0),
            "pending_requests": sum(r.pending() for r in recorders),
            "pending_scores": hook.scorer.pending() if hook.scorer is not None else 0,
            # Per-engine-request entries: bounded between exports (an AsyncLLM never exports).
            "tracked_requests": sum(len(r.rows_by_req) for r in recorders),
            "steering_states": len(steer.states) if steer is not None else 0,
            # Stream messages the step handed over that the front end has not taken yet.
            "stream_backlog": publisher.backlog if publisher is not None else 0,
            "retained_bytes": sum(r.retained_bytes() for r in recorders),
            "record_ns": sum(r.record_ns for r in recorders),
            "export_ns": sum(r.export_ns for r in recorders),
            # probehook_export calls, whole (export_ns is the recorders' part of them), and
            # their transport writes.
            "export_rpc_ns": getattr(self, "_probehook_export_rpc_ns", 0),
            "write_ns": getattr(self, "_probehook_write_ns", 0),
            "steps": hook.steps,
            "steps_steered": getattr(steer, "steps_steered", 0),
            "steer_prepare_ns": getattr(steer, "prepare_ns", 0),
            # Rows taken from steered requests waiting outside the batch (preempted), and
            # requests that ran unsteered because no row could be given (never expected).
            "steering_slots_reclaimed": getattr(steer, "reclaimed", 0),
            "steering_failures": getattr(steer, "failures", 0),
            "steps_clamped": getattr(getattr(self, "_probehook_clamps", None), "steps_clamped", 0),
            **_compilations(),
            "forwards": hook.forwards,
            "step_ns": hook.step_ns,
        }


def _reuse_plans(runner: Any, plan_for: PlanFor, signatures: SharedReads | None = None) -> PlanFor:
    """``plan_for`` that reads each distinct request plan once: requests whose wires differ
    only in their tag (a batch of requests with the same options and prompt length, such as
    the patches of an image) get the plan of the first, under their own stream key. Reading
    a wire and building its keep plan costs tens of microseconds per request and recorder,
    which a one-pass request has no decode steps to spread over. ``signatures``: shared by
    the recorders of a worker, which meet each new request in the same step; the later ones
    take the wire, the signature and the template check the first worked out."""
    cache: dict[tuple, tuple[RequestPlan | None, _Template | None, str]] = {}

    def cached(req_id: str) -> RequestPlan | None:
        try:
            shared = signatures.take(req_id) if signatures is not None else None
            if shared is not None:  # another recorder read this wire in this step
                raw, known, verified = shared
            else:
                state = runner.requests.get(req_id)
                params = runner_v1.request_params(state)
                raw = runner_v1.extra_options(params).get(EXTRA_ARGS_KEY)
                known, verified = _plan_signature(raw, req_id, state, params), None
        except Exception:  # noqa: BLE001 - plan_for reports what it cannot read
            known = None
        if known is None:
            return plan_for(req_id)
        signature, shape = known
        hit = cache.get(signature)
        if hit is not None:
            plan, template, suffix = hit
            if template is not None and template is not verified and not template.matches(shape):
                # The wire names a template it does not match (it did not come from the
                # front end as written): read it afresh, and do not cache what it gets.
                return plan_for(req_id)
            if signatures is not None and shared is None:
                signatures.share(req_id, (raw, known, template))
            if plan is None:
                return None
            return RequestPlan(
                raw["tag"] + suffix, plan.keep, plan.stream, plan.layers, None, plan.one_pass
            )
        if signatures is not None and shared is None:
            signatures.share(req_id, (raw, known, None))
        plan = plan_for(req_id)
        if plan is None or plan.error is None:
            if len(cache) >= MAX_CACHED_PLANS:
                cache.clear()
            suffix = plan.key[plan.key.rindex("/") :] if plan is not None else ""
            cache[signature] = (plan, _Template(shape) if shape is not None else None, suffix)
        return plan

    return cached


_SCALARS = (bool, int, float, str, type(None))


class _Template:
    """The first wire read of a template (``plan``), which later wires naming it must equal
    but for their tag, value types included (``include_prefill: 1`` is not ``True``)."""

    __slots__ = ("wire", "types")

    def __init__(self, wire: dict[str, Any]) -> None:
        self.wire = dict(wire)  # a copy of its own: matches() writes the tag into it
        self.types = tuple(map(type, wire.values()))

    def matches(self, raw: dict[str, Any]) -> bool:
        wire = self.wire
        wire["tag"] = raw["tag"]  # the one value that differs; both compare in C
        return raw == wire and tuple(map(type, raw.values())) == self.types


class SharedReads(dict):
    """What one recorder read of a new request's wire (the wire, its signature, the template
    shape it was checked against), left for the worker's other recorders, which meet the
    request in the same step: each entry is taken by ``readers`` of them, then dropped."""

    def __init__(self, readers: int) -> None:
        super().__init__()
        self.readers = readers

    def take(self, req_id: str) -> tuple | None:
        entry = self.get(req_id)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del self[req_id]
        return entry[0]

    def share(self, req_id: str, read: tuple) -> None:
        if len(self) >= MAX_CACHED_PLANS:
            self.clear()  # requests the other recorders never met
        self[req_id] = [read, self.readers]


def _plan_signature(raw: Any, req_id: str, state: Any, params: Any) -> tuple | None:
    """Everything a request's plan depends on except its tag, as ``(signature, shape)``
    (None: do not reuse plans for it). The signature holds the wire's template (``plan``,
    set by the front end on wires that differ only in their tag) or else its other values
    with their types (a wire with nested values, such as monitors or a store record, is read
    afresh), the prompt length, whether the request has stop strings, and the
    completion-index prefix of its engine id. ``shape``, for a template's wire: the wire
    itself, compared with the template's first (:class:`_Template`, never hashed) so that a
    wire that names a template without matching it is read afresh."""
    tag = raw.get("tag") if isinstance(raw, dict) else None
    if type(tag) is not str or not tag:
        return None
    head = req_id.split("_", 1)[0] if "_" in req_id else ""
    stop = bool(getattr(params, "stop", None))
    template = raw.get(PLAN_KEY)
    if type(template) is str:
        return (template, state.num_prompt_tokens, stop, head), raw
    items: list[tuple] = []
    for key, value in raw.items():
        if key == "tag":
            continue
        kind = type(value)
        if kind is list or kind is tuple:
            if not all(type(v) in _SCALARS for v in value):
                return None
            value = (kind, *((type(v), v) for v in value))
        elif kind not in _SCALARS:
            return None
        items.append((key, kind, value))
    return (tuple(items), state.num_prompt_tokens, stop, head), None


def _publish(recorder: StepRecorder, publisher: Publisher, live: Any) -> None:
    chunks = recorder.take_streamed(live)
    if chunks:  # one message for every stream of the step
        publisher.send(encode(recorder.source, chunks, recorder.row_dtype))


def _compilations() -> dict[str, int]:
    """How many graphs this worker process compiled (a recompile after start-up shows here)."""
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    return {
        "graphs_seen": compilation_counter.num_graphs_seen,
        "backend_compilations": compilation_counter.num_backend_compilations,
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
    }


def _steering_of(worker: Any) -> StepSteering:
    steer = _hook(worker).steer
    if steer is None:
        raise ValueError("this engine was built without steering layers")
    return steer
