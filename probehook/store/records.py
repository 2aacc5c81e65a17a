"""Turning a finished ``RequestOutput`` into what the store keeps."""

from __future__ import annotations

from typing import Any

from probehook.capture_config import CaptureConfig
from probehook.core.spans import completion_spans
from probehook.store.writer import PendingRequest, RowBlock


def pending_request(output: Any, sampling: dict[str, Any], config: CaptureConfig) -> PendingRequest:
    """Record + row blocks of one output whose tensors probehook.LLM has attached."""
    prompt_len = len(output.prompt_token_ids or [])
    record = {
        "id": output.request_id,
        "prompt": output.prompt,
        "prompt_token_ids": list(output.prompt_token_ids or []),
        "sampling_params": sampling,
        "completions": [
            {
                "index": c.index,
                "token_ids": list(c.token_ids),
                "text": c.text,
                "finish_reason": c.finish_reason,
            }
            for c in output.outputs
        ],
    }
    blocks = []
    for c in output.outputs:
        prefill, decode = completion_spans(config, prompt_len, len(c.token_ids), c.index)
        if prefill is not None:
            for layer, rows in output.prefill_hidden_states.items():
                blocks.append(RowBlock("prefill", None, layer, prefill.lo, rows))
        if decode is not None:
            for layer, rows in c.hidden_states.items():
                blocks.append(RowBlock("decode", c.index, layer, decode.lo, rows))
    return PendingRequest(record, blocks)
