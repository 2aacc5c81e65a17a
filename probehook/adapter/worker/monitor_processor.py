"""The ``stop`` action of probe monitors, as a vLLM V1 custom logits processor.

It runs in the worker after ``compute_logits``, in the same step and process as the step hook
that scored the batch, so it reads this step's scores: for a request whose monitor crosses its
threshold it forces the request's stop token (an id the front end added to the request's
``stop_token_ids``, so vLLM's own ``check_stop`` ends it, also under ``ignore_eos``). The
front end then names the probe in ``stop_reason``. Batch tracking is vLLM's
(``process_dict_updates``); the processor is passed per engine (``LLM(logits_processors=...)``),
never through the global entry-point group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from probehook.adapter.worker import probe_registry
from probehook.core.monitors import crosses
from probehook.core.request_options import EXTRA_ARGS_KEY, RequestWire, WireMonitor

logger = logging.getLogger(__name__)


@dataclass
class _Watch:
    stops: list[WireMonitor]  # the request's monitors with action "stop"
    stop_token: int
    min_tokens: int
    output_ids: list[int]  # vLLM's live list of the request's generated tokens


class ProbeStopProcessor(LogitsProcessor):
    """Forces the stop token of requests whose stop monitor fired in this step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self.watches: dict[int, _Watch] = {}  # by persistent-batch index

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: must run for greedy batches too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.watches, batch_update, _watch)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.watches:
            return logits
        probes = probe_registry.lookup(self.vllm_config)
        scorer = probes.hook.scorer if probes is not None else None
        step = scorer.step_rows if scorer is not None else None
        if step is None:
            return logits
        scores = None  # this step's scores on the host, copied once (one sync on a GPU)
        for index, watch in self.watches.items():
            if index >= len(step.last_row) or step.last_row[index] < 0:
                continue
            if len(watch.output_ids) < watch.min_tokens or watch.stop_token >= logits.shape[1]:
                continue  # vLLM would not stop it yet; the forced token would be kept
            if scores is None:
                scores = step.rows[0].cpu().numpy()
            row = scores[int(step.last_row[index])]
            for wired in watch.stops:
                if wired.column >= len(row):
                    continue  # a column this bank does not have (a wire that skipped checks)
                value = float(row[wired.column])
                monitor = wired.monitor
                if crosses(value, monitor.threshold, monitor.direction):
                    logits[index] = float("-inf")
                    logits[index, watch.stop_token] = 0.0
                    break
        return logits


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
        if not stops:
            return None
        return _Watch(stops, wire.stop_token, int(params.min_tokens or 0), output_ids)
    except Exception as e:  # noqa: BLE001
        logger.warning("probehook: not watching a request with unreadable options: %s", e)
        return None
