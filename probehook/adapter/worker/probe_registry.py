"""Where the monitor logits processor finds this worker's step hook (its probe scores and SAE
features of the step).

vLLM builds logits processors with ``(vllm_config, device, is_pin_memory)`` and no handle to
the model, so the worker registers its step hook here, keyed by the engine's ``VllmConfig``
(one process may hold several engines when vLLM runs in-process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probehook.adapter.worker.loader import StepHook
from probehook.worker.probe_bank import ProbeBank


@dataclass
class WorkerProbes:
    hook: StepHook
    bank: ProbeBank | None


_by_config: dict[int, WorkerProbes] = {}  # by id(VllmConfig)
_latest: list[WorkerProbes] = []


def register(vllm_config: Any, hook: StepHook, bank: ProbeBank | None) -> None:
    entry = WorkerProbes(hook, bank)
    _by_config[id(vllm_config)] = entry
    _latest[:] = [entry]


def lookup(vllm_config: Any) -> WorkerProbes | None:
    """The probes of the engine built with ``vllm_config`` (or, if the processor was given a
    copy of the config, of the latest engine in this process: one per worker process)."""
    entry = _by_config.get(id(vllm_config))
    return entry if entry is not None else (_latest[0] if _latest else None)
