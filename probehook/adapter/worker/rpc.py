"""Methods mixed into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

Only control messages and small manifests travel through vLLM's RPC; the rows themselves go
through the transport (``probehook.worker.transport_writer``) as raw bytes.

With tensor parallelism every rank holds the complete residual stream after each layer. Rank 0
records hidden rows and answers exports; which other ranks record what is the readout table's
(``probehook.worker.readouts``): probe scores on every rank, because every rank samples and a
monitor's stop must be forced on all of them alike; SAE features there only for the requests a
feature stop monitor watches. The other ranks free what they hold when rank 0 exports it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from probehook.adapter.worker import runner_v1
from probehook.adapter.worker.loader import register_loader
from probehook.adapter.worker.plan_cache import SharedReads, reuse_plans
from probehook.adapter.worker.step_hook import StepHook
from probehook.adapter.worker.surgery import step_hook
from probehook.core.export_wire import (
    BatchAsk,
    BatchReport,
    ExportReply,
    SpanReport,
    StreamAsk,
    stream_id,
)
from probehook.core.spans import Span
from probehook.core.steering_wire import vectors_from_wire
from probehook.core.stream_frames import encode
from probehook.worker.recorder import StepRecorder
from probehook.worker.steering_bank import StepSteering
from probehook.worker.stream_publisher import Publisher
from probehook.worker.transport_writer import write_tensors_with_fallback
from probehook.worker.write_table import StepWrites

MAX_MISSING_REPORTED = 8


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


def _answers(worker: Any, source: str) -> bool:
    """Whether this worker records (and so exports) ``source``: the readout table says which
    ranks record what (rank 0 answers exports; every rank samples, so a stop monitor's values
    are recorded wherever it must be forced)."""
    return _hook(worker).readout_row(source).records_on(_reports(worker))


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
                reuse_plans(
                    runner,
                    runner_v1.plan_factory(
                        runner,
                        hook.config,
                        recorder.source,
                        steerable,
                        recorder.slots,
                        stops_only=hook.readout_row(recorder.source).stops_only_on(_reports(self)),
                    ),
                    signatures,
                ),
            )
            for recorder in active
        ]
        if getattr(self, "_probehook_publisher", None) is None:
            self._probehook_publisher = Publisher(None)  # until a stream connects

        writes = StepWrites(hook.writers) if hook.writers else None
        self._probehook_writes = writes
        before_forward = on_schedule = None
        if steer is not None:
            steer_plan = runner_v1.steering_factory(runner, steerable)

            def on_schedule(scheduled: Any) -> None:
                steer.finish(getattr(scheduled, "finished_req_ids", None) or ())

        if steer is not None or writes is not None:
            terms_for = runner_v1.writes_factory(runner)

            def before_forward(scheduled: Any) -> None:
                if steer is not None:
                    runner_v1.prepare_steering(runner, steer, steer_plan)
                if writes is not None:
                    runner_v1.prepare_writes(runner, writes, terms_for)

        scorer = hook.scorer
        # Readouts that read each row's next token record with the rest (monitors read them
        # in the sampler) and complete after the step's sampling, which draws the token after
        # each request's newest row; a pooling model samples nothing, so they complete at once
        # (the prompt knows each row's next token but the last's).
        late = []
        if not getattr(runner, "is_pooling_model", False):
            late = [r for r in recorders if getattr(r[0].transform, "reads_next_token", False)]
        now = [r for r in recorders if r not in late]

        def on_step() -> None:
            runner_v1.record_step(runner, now)
            runner_v1.record_step(runner, late, defer=True)
            if steer is not None and steer.failed:  # fail those requests alone, named
                for req_id, reason in steer.take_failed().items():
                    for recorder, _ in recorders:
                        recorder.fail_request(req_id, f"probehook could not steer it ({reason})")
            if writes is not None and writes.failed:
                for req_id, reason in writes.take_failed().items():
                    for recorder, _ in recorders:
                        recorder.fail_request(req_id, f"probehook could not write it ({reason})")
            if steer is not None and scorer is not None and scorer.step_rows is not None:
                steer.check_gates(scorer.step_rows.rows, scorer.step_rows.last_row)
            for recorder, _ in now:
                _publish(recorder, self._probehook_publisher, runner.requests)
                recorder.bound(runner.requests)
            if writes is not None:
                writes.bound(runner.requests)

        after_sample = None
        if late:

            def after_sample(sampled: Any) -> None:
                runner_v1.complete_step(runner, late, sampled)
                for recorder, _ in late:
                    _publish(recorder, self._probehook_publisher, runner.requests)
                    recorder.bound(runner.requests)

        hook.install_on(runner, on_step, before_forward, on_schedule, after_sample)
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
        steer.add_vector(name, vectors_from_wire(wire, steer.bank.hidden))
        return True

    def probehook_patch_rows(self, first: int, data: bytes, count: int) -> bool:
        """Write ``count`` float32 rows (raw bytes, no pickle) into the patching source bank
        from row ``first`` (a sweep's noise rows; every rank writes the same)."""
        writers = [w for w in (_hook(self).writers or {}).values() if w.kind == "patch"]
        if not writers:
            raise ValueError("this engine was built without patching=True")
        source = writers[0].buffers["source"]
        rows = torch.frombuffer(bytearray(data), dtype=torch.float32).view(count, -1)
        if rows.shape[1] != source.shape[1] or not 1 <= first <= source.shape[0] - count:
            raise ValueError(f"rows {first}..{first + count} of width {rows.shape[1]} do not fit "
                             f"the bank {tuple(source.shape)}")  # fmt: skip
        source[first : first + count].copy_(rows)
        return True

    def probehook_embedding_stats(self) -> tuple[int, float, float, int]:
        """``(entries, sum, sum of squares, hidden size)`` of this rank's rows of the input
        embedding matrix (its real vocabulary, padding rows left out): the front end joins
        the ranks' into the matrix's standard deviation (noise corruption's unit)."""
        embedding = _input_embedding(self.model_runner.get_model())
        weight = embedding.weight
        shard = getattr(embedding, "shard_indices", None)
        if shard is not None:
            weight = weight[: shard.org_vocab_end_index - shard.org_vocab_start_index]
        values = weight.double()
        return (values.numel(), float(values.sum()), float((values * values).sum()),
                int(weight.shape[1]))  # fmt: skip

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

    def probehook_forced_stops(self) -> int:
        """The stop tokens this worker's stop processor forced, on every rank (a test of
        tensor parallelism asks each rank: rank 0's output alone would hide a rank that did
        not stop)."""
        return _hook(self).forced_stops

    def probehook_bank_bytes(self) -> dict[str, int]:
        """What each readout's bank holds in this rank's memory, by source (those that say:
        a lens bank's matrices, sharded under tensor parallelism; a test asks every rank)."""
        recording = _hook(self).recording
        return {
            source: int(recorder.transform.nbytes)
            for source, recorder in recording.items()
            if isinstance(getattr(recorder.transform, "nbytes", None), int)
        }

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
            "steps_written": getattr(getattr(self, "_probehook_writes", None), "steps_written", 0),
            **_compilations(),
            "forwards": hook.forwards,
            "step_ns": hook.step_ns,
        }


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


def _input_embedding(model: Any) -> Any:
    """The model's input embedding module (vLLM's ``VocabParallelEmbedding``, not its LM
    head)."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            return getter()
        except (NotImplementedError, AttributeError):
            pass
    for module in model.modules():
        kind = type(module).__name__
        if kind == "VocabParallelEmbedding":
            return module
    raise ValueError(f"no input embedding found on {type(model).__name__}")


def _steering_of(worker: Any) -> StepSteering:
    steer = _hook(worker).steer
    if steer is None:
        raise ValueError("this engine was built without steering layers")
    return steer
