"""The ``probehook`` extension field of an OpenAI choice, and the request option that asks
for it. The server (``probehook serve``) fills it; clients read it with :func:`decode_array`.

A request opts in with a top-level ``probehook`` object in its body (``extra_body=`` in the
``openai`` client); its keys are the per-request options of the offline ``LLM``'s
``extra_args["probehook"]`` (``layers``, ``probes``, ``monitors``, ``include_prefill``, ...),
but everything defaults to *off*, so a request that does not ask gets an ordinary response
and costs nothing. Each choice then carries::

    "probehook": {
        "probe_scores": {"truth": [0.91, 0.88, ...]},     # one per token of this choice/chunk
        "probe_flags": {"truth": [3]},                    # rows where a flag monitor fired
        "hidden_states": {"15": {"dtype": "float32", "shape": [n, d], "data": "<base64>"}},
        "sae_features": {"res12": {"indices": [[...], ...], "values": [[...], ...],
                                   "l0": [...]}},        # top-k per token of this choice/chunk
        "prefill_hidden_states": {...}, "prefill_probe_scores": {...},  # first choice only
        "prefill_sae_features": {...},
        # ... and each other top-k readout's field (a lens's: {lens: {layer: {"token_ids",
        # "logprobs", "target_logprob", "tokens"}}})
        "error": "..."                                    # only when the capture failed
    }

Arrays are the raw little-endian bytes of the tensor, base64-encoded, with dtype and shape:
never pickle (``probehook.outputs.array_codec``; its two functions are importable from here too).
In a stream each chunk carries the rows of its own tokens.

This module knows nothing about vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from probehook.core.request_options import RequestOptions, picking_options
from probehook.frontend.readout_set import without_unread
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.array_codec import decode_array as decode_array
from probehook.outputs.array_codec import encode_array as encode_array
from probehook.outputs.intervention import interventions

FIELD = "probehook"
# Key, inside the field, naming output processors whose ``fill`` raised on this output.
PROCESSOR_ERRORS = "processor_errors"
OFF = {"layers": [], "probes": False, "include_prefill": False}
"""What a request that names nothing gets: no rows, no scores (and no top-k readout:
:func:`request_options` turns each off)."""


def request_options(value: Any, readout_options: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The engine's per-request options for a request body's ``probehook`` value (None when
    the body has none): opt-in, so every key defaults to off (``readout_options``: the
    engine's top-k readouts' request options, off too)."""
    readout_options = dict(readout_options or {})
    picking = picking_options(readout_options)
    # A readout is off unless the request names one of its options (lens_layers alone asks
    # for every lens on those layers).
    asked = value if isinstance(value, Mapping) else {}  # a non-dict is refused below
    named = {s for o, s in readout_options.items() if o in asked}
    off = {**OFF, **{o: False for s, o in picking.items() if s not in named}}
    if value is None:
        return off
    # the checks and words of every front end (a readout this engine lacks, asked for
    # nothing: accepted, as the session accepts it)
    RequestOptions.from_user(
        without_unread(value, set(readout_options.values())),
        readout_options,
        tuple(interventions(OUTPUT_PROCESSORS)),  # refused by name where the engine lacks one
    )
    return {**off, **value}


def response_bytes_bound(rows: int, layers: int, hidden_size: int, itemsize: int) -> int:
    """The most bytes the hidden states of ``rows`` rows can add to a response (base64)."""
    return 4 * -(-(rows * layers * hidden_size * itemsize) // 3)


FEATURE_JSON_BYTES = 34
"""The most JSON bytes one SAE feature of one token takes: an index (up to 10 digits), a
float32 value as JSON writes it (up to 24 characters), separators."""
NUMBER_JSON_BYTES = 26
"""The most JSON bytes one further number of a token takes (a float32 and a separator)."""


def features_bytes_bound(rows: int, instances: Sequence[tuple[int, int]]) -> int:
    """The most bytes top-k readings (SAEs, lens instances, any readout's) of ``rows`` rows
    can add to a response (JSON lists); ``instances``: each one's entries and packed width at
    the request's k (``TopKReadout.entries``, ``packed_width``): the entries' pairs, a
    scalar, and whatever further numbers its column schema holds."""
    return rows * sum(
        entries * FEATURE_JSON_BYTES + 12 + (width - 2 * entries - 1) * NUMBER_JSON_BYTES
        for entries, width in instances
    )


# -- choices --------------------------------------------------------------------------------


class ChoiceFields:
    """Collects, per choice index, the values of outputs not yet written to a choice, and
    writes them as one ``probehook`` field. What is collected, how stream pieces join and how
    values are written is each output processor's business (``probehook.outputs``): every
    registered processor's non-empty attributes go in. A stream's chunk may be skipped (a token
    with no text yet): its values wait for the next chunk of the same choice."""

    def __init__(
        self,
        processors: Iterable[Any] | None = None,
        compact: bool = False,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        if processors is None:
            from probehook.outputs import OUTPUT_PROCESSORS

            processors = OUTPUT_PROCESSORS
        self.compact = compact
        """Write values in a processor's compact form where it has one (``to_compact``)."""
        self.token_text = token_text
        """A token id's text (:class:`TokenText`): readouts whose entries are token ids (a
        lens's) write the strings beside them. None: ids only."""
        # (processor, attribute, on the request output?) for every attribute owned
        self._owned = [
            (p, attribute, on_request)
            for p in processors
            for on_request, attributes in (
                (True, p.request_attributes),
                (False, p.completion_attributes),
            )
            for attribute in attributes
        ]
        self._parts: dict[int, dict[str, Any]] = {}

    def add(self, index: int, output: Any, completion: Any) -> None:
        """Note what ``output`` (a ``RequestOutput``) and ``completion`` (one of its
        ``outputs``) carry for choice ``index``. The request output's values (the prompt's
        rows) go with the request's first choice."""
        error = getattr(completion, "capture_error", None)
        if error:
            self._parts.setdefault(index, {})["error"] = error
            return
        failed = getattr(output, "processor_errors", None)
        if failed:  # a processor's fill raised: say so rather than leave its field out
            self._parts.setdefault(index, {}).setdefault(PROCESSOR_ERRORS, {}).update(failed)
        for processor, attribute, on_request in self._owned:
            if on_request and completion.index != 0:
                continue
            value = getattr(output if on_request else completion, attribute, None)
            if value:
                part = self._parts.setdefault(index, {})
                part.setdefault(attribute, (processor, []))[1].append(value)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def take(self, index: int) -> dict[str, Any] | None:
        """The ``probehook`` field for choice ``index`` (None: nothing waiting), forgotten."""
        part = self._parts.pop(index, None)
        if part is None:
            return None
        if "error" in part:
            return {"error": part["error"]}
        failed = part.pop(PROCESSOR_ERRORS, None)
        field = {
            attribute: self._write(processor, processor.merge(pieces))
            for attribute, (processor, pieces) in part.items()
        }
        if failed:
            field[PROCESSOR_ERRORS] = failed
        return field

    def _write(self, processor: Any, value: Any) -> Any:
        compact = getattr(processor, "to_compact", None) if self.compact else None
        written = compact(value) if compact is not None else processor.to_response(value)
        if self.token_text is not None and getattr(processor, "entries_are_tokens", False):
            processor.add_token_text(written, value, self.token_text)
        return written

    def annotate_sse(self, line: str) -> str:
        """An SSE line of vLLM's stream with the waiting fields added to its choices that
        carry tokens; other lines unchanged."""
        if not self._parts or not line.startswith("data: {"):
            return line
        chunk = json.loads(line[len("data: ") :])
        changed = False
        for choice in chunk.get("choices") or ():
            if _carries_tokens(choice):
                field = self.take(choice.get("index", 0))
                if field is not None:
                    choice[FIELD] = field
                    changed = True
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n" if changed else line


class TokenText:
    """A token id's text as the tokenizer decodes it alone (the strings OpenAI's logprobs
    show), remembered: a lens names the same few tokens on most rows."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decode = tokenizer.decode
        self._known: dict[int, str] = {}
        self._json_bytes: int | None = None

    @property
    def json_bytes(self) -> int:
        """The most JSON bytes one entry's text can take: the vocabulary's longest token
        (a token decodes to at most as many characters as its vocabulary string has) at 12
        bytes a character (``\\ud83d\\ude00``: ensure_ascii's worst), its quotes and comma."""
        if self._json_bytes is None:
            vocab = self._tokenizer.get_vocab() if hasattr(self._tokenizer, "get_vocab") else {}
            longest = max(map(len, vocab), default=64)
            self._json_bytes = 12 * longest + 3
        return self._json_bytes

    def __call__(self, token_id: int) -> str:
        text = self._known.get(token_id)
        if text is None:
            text = self._known[token_id] = self._decode([token_id])
        return text


class PooledFields:
    """The ``probehook`` field of one item of a pooling response (an embedding, a
    classification): every registered processor's non-empty value on the pooled output,
    under the processor's name (its rows are input rows, one per token)."""

    def __init__(self, processors: Iterable[Any] | None = None) -> None:
        if processors is None:
            from probehook.outputs import OUTPUT_PROCESSORS

            processors = OUTPUT_PROCESSORS
        self._processors = list(processors)

    def of(self, output: Any) -> dict[str, Any]:
        error = getattr(output, "capture_error", None)
        if error:
            return {"error": error}
        field = {}
        for processor in self._processors:
            for attribute in processor.request_attributes:
                value = getattr(output, attribute, None)
                if value:
                    field[processor.name] = processor.to_response(value)
        failed = getattr(output, "processor_errors", None)
        if failed:
            field[PROCESSOR_ERRORS] = dict(failed)
        return field


def _carries_tokens(choice: Mapping[str, Any]) -> bool:
    """A chunk choice that holds new tokens, or ends its choice (not a chat role chunk)."""
    if choice.get("finish_reason") or choice.get("text") or choice.get("token_ids"):
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning", "reasoning_content", "tool_calls"))
