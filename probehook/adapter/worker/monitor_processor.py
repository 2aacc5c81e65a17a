"""The ``stop`` action of probe, feature and lens monitors, as a vLLM V1 custom logits
processor.

It runs in the worker after ``compute_logits``, in the same step and process as the step hook
that scored the batch, so it reads this step's scores, features and lens readings: for a
request whose monitor crosses its threshold it forces the request's stop token (an id the
front end added to the request's ``stop_token_ids``, so vLLM's own ``check_stop`` ends it,
also under ``ignore_eos``). The front end then names the monitor in ``stop_reason``. Batch
tracking is vLLM's (``process_dict_updates``); the processor is passed per engine
(``LLM(logits_processors=...)``), never through the global entry-point group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from probehook.core.monitors import crosses, top_k_value
from probehook.core.request_options import EXTRA_ARGS_KEY, RequestWire, WireMonitor

logger = logging.getLogger(__name__)


@dataclass
class _Watch:
    stops: list[WireMonitor]  # the request's monitors with action "stop"
    readout_stops: list[tuple[Any, int]]  # feature and lens monitors, with their bank slot
    stop_token: int
    min_tokens: int
    output_ids: list[int]  # vLLM's live list of the request's generated tokens


class ProbeStopProcessor(LogitsProcessor):
    """Forces the stop token of requests whose stop monitor fired in this step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.watches: dict[int, _Watch] = {}  # by persistent-batch index
        self.hook: Any = None
        """The worker's step hook (its step's scores and SAE features): handed over by
        ``probehook_start_recording``, which finds this processor in the runner's batch (vLLM
        builds logits processors with no handle to the model)."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: must run for greedy batches too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.watches, batch_update, _watch)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.watches:
            return logits
        hook = self.hook
        if hook is None:
            return logits  # before recording starts (warm-up): nothing is watched yet
        scores = _StepValues(hook.scorer)
        readouts: dict[str, _StepValues] = {}
        for index, watch in self.watches.items():
            if len(watch.output_ids) < watch.min_tokens or watch.stop_token >= logits.shape[1]:
                continue  # vLLM would not stop it yet; the forced token would be kept
            if _crossed(watch, index, scores) or _readout_crossed(watch, index, hook, readouts):
                logits[index] = float("-inf")
                logits[index, watch.stop_token] = 0.0
                hook.forced_stops += 1
        return logits


class _StepValues:
    """A recorder's rows of this step on the host, copied at the first use (one sync on a
    GPU), and the row of each request's last token."""

    def __init__(self, recorder: Any) -> None:
        self.step = recorder.step_rows if recorder is not None else None
        self._host: Any = None
        entries = getattr(getattr(recorder, "transform", None), "entries", None)
        self.entries = entries if callable(entries) else (lambda slot: None)
        """A top-k bank's entries per row in a slot (its column schema's; None: the
        three-column layout's)."""

    def row(self, index: int, slot: int) -> Any:
        """Batch entry ``index``'s last row in slot ``slot`` (None: not kept this step)."""
        step = self.step
        if step is None or index >= len(step.last_row) or step.last_row[index] < 0:
            return None
        if self._host is None:
            self._host = step.rows.cpu().numpy()
        if slot >= self._host.shape[0]:
            return None  # a slot this bank does not have (a wire that skipped checks)
        return self._host[slot, int(step.last_row[index])]


def _crossed(watch: _Watch, index: int, scores: _StepValues) -> bool:
    """Whether a probe stop monitor of the request crossed on this step's last row."""
    if watch.stops:
        row = scores.row(index, 0)
        for wired in watch.stops if row is not None else ():
            if wired.column >= len(row):
                continue  # a column this bank does not have (a wire that skipped checks)
            monitor = wired.monitor
            if crosses(float(row[wired.column]), monitor.threshold, monitor.direction):
                return True
    return False


def _readout_crossed(
    watch: _Watch, index: int, hook: Any, readouts: dict[str, _StepValues]
) -> bool:
    """Whether a stop monitor of top-k rows (SAE features, a lens) crossed on this step's
    last row of the request (its source's rows, read before sampling; outside the top k the
    monitor's ``outside`` value)."""
    for monitor, slot in watch.readout_stops:
        values = readouts.get(monitor.source)
        if values is None:
            values = readouts[monitor.source] = _StepValues(hook.recording.get(monitor.source))
        packed = values.row(index, slot)
        if packed is None:
            continue
        value = top_k_value(packed, monitor.entry, monitor.outside, values.entries(slot))
        if crosses(value, monitor.threshold, monitor.direction):
            return True
    return False


def _watch(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Watch | None:
    # vLLM calls this while it builds the batch: an exception here would end the engine for
    # every request. A request whose options cannot be read is not watched (its capture
    # fails in the step hook, so its outputs say why).
    try:
        raw = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        wire = RequestWire.from_wire(raw)
        if wire is None or wire.stop_token is None:
            return None
        stops = [m for m in wire.monitors if m.monitor.action == "stop"]
        readout_stops = [(m, slot) for m, slot in wire.readout_monitors if m.action == "stop"]
        if not stops and not readout_stops:
            return None
        min_tokens = int(params.min_tokens or 0)
        return _Watch(stops, readout_stops, wire.stop_token, min_tokens, output_ids)
    except Exception as e:  # noqa: BLE001
        logger.warning("probehook: not watching a request with unreadable options: %s", e)
        return None
