"""Methods mixed into every vLLM worker (``worker_extension_cls``), called by collective_rpc.

Only control messages and small manifests travel through vLLM's RPC; the rows themselves go
through ``probehook.transport`` as raw bytes.
"""

from __future__ import annotations

from typing import Any

from probehook import _vllm_adapter as adapter
from probehook.transport import write_tensors

MAX_MISSING_REPORTED = 8


class ProbehookWorkerExtension:
    """Worker-side RPC surface of probehook."""

    def probehook_attach(self) -> dict[str, Any] | None:
        """Start recording requests' rows; steps before this (warm-up) are ignored."""
        recorder = adapter.worker_recorder(self)
        if recorder is None:
            return None
        adapter.attach_runner(self, recorder)
        buf = recorder.buffers[0]
        return {
            "layers": list(recorder.layers),
            "hidden_size": int(buf.shape[1]),
            "dtype": str(buf.dtype),
        }

    def probehook_export(self, path: str, requests: list[dict[str, Any]]) -> dict | None:
        """Write the asked ranges of each request to ``path``; forget those requests.

        Each request is ``{"key", "ranges": [[lo, hi], ...], "layers": [...]}``.
        """
        recorder = adapter.worker_recorder(self)
        if recorder is None:
            return None
        tensors = []
        reports = []
        for request in requests:
            ranges = [(int(lo), int(hi)) for lo, hi in request["ranges"]]
            got, exported = recorder.export(request["key"], ranges, request["layers"])
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
        entries = write_tensors(path, tensors) if tensors else []
        recorder.forget_unless(adapter.live_request_ids(self))
        return {"entries": entries, "ranges": reports}

    def probehook_forget(self, key_prefixes: list[str]) -> int | None:
        """Drop rows nobody will collect (requests of a failed or interrupted generate)."""
        recorder = adapter.worker_recorder(self)
        if recorder is None:
            return None
        return recorder.forget(key_prefixes)

    def probehook_stats(self) -> dict[str, int] | None:
        """Counters for tests and debugging."""
        recorder = adapter.worker_recorder(self)
        if recorder is None:
            return None
        return {
            "steps_recorded": recorder.steps_recorded,
            "pending_requests": len(recorder.plans_by_key),
        }
