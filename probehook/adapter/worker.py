"""Methods mixed into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

Only control messages and small manifests travel through vLLM's RPC; the rows themselves go
through ``probehook.core.transport`` as raw bytes.
"""

from __future__ import annotations

import os
from typing import Any

from probehook.adapter import runner_v1
from probehook.adapter.loader import StepHook, step_hook
from probehook.core.spans import Span
from probehook.core.transport import write_tensors_with_fallback

MAX_MISSING_REPORTED = 8


def _hook(worker: Any) -> StepHook | None:
    """This worker's step hook, or None on ranks that do not collect (TP rank > 0)."""
    hook = step_hook(worker.model_runner.get_model())
    return hook if getattr(worker, "rank", 0) == 0 else None


class ProbehookWorkerExtension:
    """Worker-side RPC surface of probehook."""

    def probehook_attach(self, limit_bytes: int = 0) -> dict[str, Any] | None:
        """Start recording requests' rows; steps before this (warm-up) are ignored."""
        hook = _hook(self)
        if hook is None:
            return None
        runner = self.model_runner  # type: ignore[attr-defined]
        runner_v1.check_runner(runner)
        recorder = hook.recorder
        recorder.limit_bytes = int(limit_bytes)
        plan_for = runner_v1.plan_factory(runner, hook.config)
        hook.attach(runner, lambda: runner_v1.record_step(runner, recorder, plan_for))
        buf = recorder.buffers[0]
        return {
            "layers": list(recorder.layers),
            "hidden_size": int(buf.shape[1]),
            "dtype": str(buf.dtype),
            "runner": f"{type(runner).__module__}.{type(runner).__name__}",
            # What this worker process inherited (probehook sets 0 while the engine starts).
            "runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        }

    def probehook_export(self, paths: list[str], requests: list[dict[str, Any]]) -> dict | None:
        """Hand over the asked spans of each stream; free them (and forget final streams).

        Each request is ``{"key", "spans": [[lo, hi], ...], "layers": [...], "final": bool}``.
        """
        hook = _hook(self)
        if hook is None:
            return None
        recorder = hook.recorder
        tensors = []
        reports = []
        failures = {}
        for request in requests:
            spans = [Span(int(lo), int(hi)) for lo, hi in request["spans"]]
            got, exported, error = recorder.export(
                request["key"], spans, request["layers"], bool(request.get("final", True))
            )
            if error is not None:
                failures[request["key"]] = error
            for item in exported:
                reports.append(
                    {
                        "key": request["key"],
                        "tensor_index": len(tensors) + item.tensor_index,
                        "lo": item.lo,
                        "hi": item.hi,
                        "num_missing": len(item.missing),
                        "missing": item.missing[:MAX_MISSING_REPORTED],
                    }
                )
            tensors.extend(got)
        path, entries = write_tensors_with_fallback(paths, tensors) if tensors else (None, [])
        recorder.forget_departed(runner_v1.live_request_ids(self.model_runner))  # type: ignore
        return {"path": path, "entries": entries, "spans": reports, "failures": failures}

    def probehook_forget(self, key_prefixes: list[str]) -> int | None:
        """Drop rows nobody will collect (aborted, failed or interrupted requests)."""
        hook = _hook(self)
        if hook is None:
            return None
        return hook.recorder.forget(key_prefixes)

    def probehook_stats(self) -> dict[str, int] | None:
        """Counters for tests, debugging and the benchmark."""
        hook = _hook(self)
        if hook is None:
            return None
        recorder = hook.recorder
        return {
            "steps_recorded": recorder.steps_recorded,
            "pending_requests": len(recorder.rows_by_key),
            "retained_bytes": recorder.retained_bytes(),
            "record_ns": recorder.record_ns,
            "export_ns": recorder.export_ns,
            "steps": hook.steps,
            "forwards": hook.forwards,
            "step_ns": hook.step_ns,
        }
