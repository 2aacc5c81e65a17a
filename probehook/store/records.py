"""Turning a finished ``RequestOutput`` into what the store keeps."""

from __future__ import annotations

import logging
from typing import Any

from probehook.capture_config import CaptureConfig
from probehook.core.spans import completion_spans, readout_config
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.shapes import completions, failed, is_pooled
from probehook.outputs.top_k_readout import top_k_readouts
from probehook.store.features import FeatureBlock
from probehook.store.writer import PendingRequest, RowBlock

logger = logging.getLogger(__name__)


def store_filled(store: Any, output: Any, request: Any) -> None:
    """Add a finished output, rows filled in, to ``store`` (an ``ActivationStore``); set its
    ``store_id``. ``request`` is the front end's ``TrackedRequest`` of it. A request whose
    capture failed is logged and not stored. Offline and streamed outputs both end here."""
    assert request.config is not None
    if failed(output):
        logger.error("probehook: request %s is not stored.", output.request_id)
        return
    # vLLM's request_id stays as it is; the store names the request itself.
    pending = pending_request(output, request.sampling, request.config, request.record)
    output.store_id = store.add(pending)


def pending_request(
    output: Any,
    sampling: dict[str, Any],
    config: CaptureConfig,
    extra: dict[str, Any] | None = None,
) -> PendingRequest:
    """Record + row blocks of one output whose rows and scores are filled in; ``extra``
    fields join the record (a one-pass input's ``user_request`` and ``patch``)."""
    prompt_len = len(output.prompt_token_ids or [])
    pooled = is_pooled(output)
    record = {
        "id": output.request_id,
        "prompt": getattr(output, "prompt", None),
        "prompt_token_ids": list(output.prompt_token_ids or []),
        "sampling_params": sampling,
        "completions": [
            {
                "index": c.index,
                "token_ids": list(c.token_ids),
                "text": c.text,
                "finish_reason": c.finish_reason,
                **_probe_fields(c),
                **_steering_field(c),
            }
            for c in completions(output)
        ],
    }
    if pooled:  # a pooling model's request: one pass, no completions
        record["pooling_params"] = record.pop("sampling_params")
    record.update(extra or {})
    prefill_scores = getattr(output, "prefill_probe_scores", None)
    if prefill_scores:
        record["prefill_probe_scores"] = _scores(prefill_scores)
    blocks = []
    features = _feature_blocks(output, config, prompt_len, pooled)
    if pooled:
        prefill, _ = completion_spans(config, prompt_len, 0)
        assert prefill is not None  # pooling engines capture every input row
        for layer, rows in output.prefill_hidden_states.items():
            blocks.append(RowBlock("prefill", None, layer, prefill.lo, rows))
    for c in completions(output):
        prefill, decode = completion_spans(config, prompt_len, len(c.token_ids), c.index)
        if prefill is not None:
            for layer, rows in output.prefill_hidden_states.items():
                blocks.append(RowBlock("prefill", None, layer, prefill.lo, rows))
        if decode is not None:
            for layer, rows in c.hidden_states.items():
                blocks.append(RowBlock("decode", c.index, layer, decode.lo, rows))
    return PendingRequest(record, blocks, features)


def _feature_blocks(
    output: Any, config: CaptureConfig, prompt_len: int, pooled: bool
) -> list[FeatureBlock]:
    """The output's top-k readouts' rows (SAE features, lenses, ...), one block per (phase,
    completion, instance), under each instance's stored name; their positions follow the
    readout's spans (every token of the request's phases; a lens's last-prompt-token rule)."""
    blocks = []
    for source, readout in top_k_readouts(OUTPUT_PROCESSORS).items():
        spans = readout_config(config, readout.follows_last_prefill_token)
        prefill, _ = completion_spans(spans, prompt_len, 0)
        on_request = readout.request_attributes[0]
        for name, rows in readout.flat(getattr(output, on_request, None) or {}).items():
            if prefill is not None:
                stored = readout.stored_name(name)
                blocks.append(FeatureBlock("prefill", None, stored, prefill.lo, rows, source))
        if pooled:
            continue
        for c in completions(output):
            _, decode = completion_spans(spans, prompt_len, len(c.token_ids), c.index)
            if decode is None:
                continue
            on_completion = readout.completion_attributes[0]
            for name, rows in readout.flat(getattr(c, on_completion, None) or {}).items():
                stored = readout.stored_name(name)
                blocks.append(FeatureBlock("decode", c.index, stored, decode.lo, rows, source))
    return blocks


def _probe_fields(completion: Any) -> dict[str, Any]:
    """Runtime probe results of a completion, when it has any (JSON: a few floats a token)."""
    fields: dict[str, Any] = {}
    scores = getattr(completion, "probe_scores", None)
    if scores:
        fields["probe_scores"] = _scores(scores)
        fields["probe_flags"] = dict(getattr(completion, "probe_flags", None) or {})
        fields["stop_reason"] = _jsonable_reason(completion.stop_reason)
    return fields


def _steering_field(completion: Any) -> dict[str, Any]:
    """Which steering applied to a completion: vectors and scales, phase, gate, and ``start``
    (the first steered position; None if a gate never crossed)."""
    steering = getattr(completion, "steering", None)
    return {"steering": steering} if steering is not None else {}


def _scores(scores: dict[str, Any]) -> dict[str, list]:
    return {name: values.tolist() for name, values in scores.items()}


def _jsonable_reason(reason: Any) -> Any:
    return reason if reason is None or isinstance(reason, int | str) else str(reason)
