"""Saved server responses as outputs the viewer reads: each line of a JSONL file is the JSON
body of a ``/v1/completions`` or ``/v1/chat/completions`` response (not streamed), with
vLLM's ``return_token_ids`` (the tokens the page shows) and a ``probehook`` field per choice.
Every registered output processor reads its own field back (``from_response``), so any
readout the server sent shows up. No vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probehook.errors import ProbehookError

FIX = 'send the request with "return_token_ids": true (vLLM\'s option) to view it'


class ResponseFileError(ProbehookError, ValueError):
    """A line of a responses file the viewer cannot read, named with the fix."""


class _Readings:
    """Its ``readings`` (what the output processors read back) as attributes, by the names
    vLLM's outputs carry them under."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["readings"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class ServedCompletion(_Readings):
    """One choice's tokens and what probehook read of them (``CompletionOutput``'s names)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: Any = None
    readings: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServedOutput(_Readings):
    """One choice as a ``RequestOutput`` of one completion: the view's input."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[ServedCompletion]
    readings: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    """The response's ``model`` (the served model name)."""


def outputs_from_response(body: Mapping[str, Any], where: str = "response") -> list[ServedOutput]:
    """Each choice of a served (completion or chat completion) response as an output."""
    from probehook.outputs import OUTPUT_PROCESSORS

    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list) or not choices:
        raise ResponseFileError(f"{where} is not a completion response: it has no choices.")
    out = []
    for choice in choices:
        index = choice.get("index", 0)
        here = f"{where}, choice {index}"
        prompt = choice.get("prompt_token_ids") or body.get("prompt_token_ids")
        tokens = choice.get("token_ids")
        if not isinstance(tokens, list) or not isinstance(prompt, list):
            raise ResponseFileError(f"{here} has no token ids: {FIX}.")
        served = choice.get("probehook") or {}
        if "error" in served:
            raise ResponseFileError(f"{here}: its capture failed ({served['error']}).")
        prefill, completion = {}, {}
        for processor in OUTPUT_PROCESSORS:
            for attributes, into in (
                (processor.request_attributes, prefill),
                (processor.completion_attributes, completion),
            ):
                for attribute in attributes:
                    if attribute in served:
                        try:
                            into[attribute] = processor.from_response(served[attribute])
                        except (TypeError, ValueError, KeyError) as e:
                            raise ResponseFileError(
                                f"{here}: its probehook field {attribute!r} is not what "
                                f"the {processor.name!r} processor writes ({e})."
                            ) from None
        request_id = f"{body.get('id', 'response')}-{index}"
        out.append(
            ServedOutput(
                request_id,
                [int(t) for t in prompt],
                [
                    ServedCompletion(
                        index,
                        [int(t) for t in tokens],
                        choice.get("finish_reason"),
                        choice.get("stop_reason"),
                        completion,
                    )
                ],  # fmt: skip
                prefill,
                body.get("model"),
            )
        )
    return out


def read_responses(path: str | Path, ids: list[str] | None = None) -> Iterator[ServedOutput]:
    """The choices of a JSONL file of responses (blank lines skipped); ``ids``: only the
    responses with these ids (or ``<id>-<choice>``)."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                body = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResponseFileError(f"{where} is not JSON ({e}).") from None
            for output in outputs_from_response(body, where):
                if ids is None or body.get("id") in ids or output.request_id in ids:
                    yield output
