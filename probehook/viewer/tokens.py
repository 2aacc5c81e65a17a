"""What the viewer shows of one request, as JSON-able data: its tokens (prompt, then the first
completion's), each token's scores (probe scores, a lens's target log-prob, ...), each token's
top-k entries of every top-k readout (SAE features, a lens's next tokens), layer x token grids,
and the marks (flags, the stop, steering, the write table's entries: SAE clamps, ...).

Rows are placed by position (docs/capture.md): prefill row ``p`` and decode row ``i`` (at
position ``n_prompt - 1 + i``) paint the token at that position, the input the row was
computed on; the last generated token was never fed back, so it has no row. Any top-k readout
the output registry knows shows up (lenses, SAE features, the next ones): nothing here names
one but to label it. No vLLM.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.intervention import STEERING_KEYS, interventions

Labels = Mapping[str, Mapping[int, str]]
"""Labels of top-k entries by instance name: an SAE's (``{"res3": {320: "false
statement"}}``), any top-k readout instance's (``{"n3": {0: "the norm"}}``, ``{"j@3": ...}``):
shown beside the entry, each labelled entry a series of its own."""


def request_data(
    output: Any,
    token_text: Callable[[int], str],
    labels: Labels | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """One request's view data: a ``RequestOutput`` (its first completion) or a stored
    request (``probehook.store.StoredRequest``)."""
    stored = hasattr(output, "output_token_ids") and not hasattr(output, "outputs")
    completion = None if stored else _first_completion(output)
    prompt_ids = [int(t) for t in (output.prompt_token_ids or [])]
    if stored:
        out_ids = [int(t) for t in output.output_token_ids]
    else:  # a capture-only output (LLM.capture) has prompt rows and no completion
        out_ids = [int(t) for t in completion.token_ids] if completion is not None else []
    n_prompt = len(prompt_ids)
    ids = prompt_ids + out_ids
    place = _Placer(n_prompt, len(ids))
    series: list[dict[str, Any]] = []
    top_k: list[dict[str, Any]] = []
    by_layer: dict[tuple[str, str], dict[int, list[Any]]] = {}  # instances' series by layer
    # probe scores: one series per probe (per class of a multi-class probe)
    prefill = _get(output, "prefill_probe_scores")
    decode = output.probe_scores if stored else _get(completion, "probe_scores")
    for name in sorted({*prefill, *decode}):
        for label, values in _columns(place.series(prefill.get(name), decode.get(name))):
            series.append(_series(f"probe {name}{label}", "probe", values, "score"))
    # every top-k readout: its rows per token, and a series of its scalar where it means one
    for readout, prefill_rows, decode_rows in _top_k_readouts(output, completion, stored):
        for instance in sorted({*prefill_rows, *decode_rows}):
            shown = readout.display_name
            before, after = prefill_rows.get(instance), decode_rows.get(instance)
            heads = _lead_slices(before, after)
            numbers = _head_numbers(before, after, len(heads))
            # a head is named where there are several, or where a request chose it
            named = len(heads) > 1 or numbers != list(range(len(heads)))
            for head, (head_before, head_after) in zip(numbers, heads, strict=True):
                rows = place.top_k(head_before, head_after)
                name = f"{shown} {instance}" + (f" h{head}" if named else "")
                entry = {"name": name, "tokens": readout.entries_are_tokens, "rows": rows,
                         "labels": {}, "keys": readout.entries_are_positions}  # fmt: skip
                if readout.entries_are_tokens:
                    entry["texts"] = _entry_texts(rows, token_text)
                series.extend(_labelled(entry, (labels or {}).get(instance, {}), name, shown))
                top_k.append(entry)
                if readout.scalar_series is not None:  # a lens's target log-prob
                    label, scale = readout.scalar_series
                    values = place.series(_scalar(head_before), _scalar(head_after))
                    series.append(_series(f"{name} {label}", shown, values, scale))
                    group, at, layer = instance.rpartition("@")  # "<name>@<layer>": one grid
                    if at and layer.isdigit() and len(heads) == 1:
                        key = (f"{shown} {group}: {label} by layer", scale)
                        by_layer.setdefault(key, {})[int(layer)] = values
            for column, scale in readout.column_series.items():  # further per-token columns
                values = place.series(_extra(before, column), _extra(after, column))
                series.append(_series(f"{shown} {instance} {column}", shown, values, scale))
    grids = [
        {
            "name": name,
            "scale": scale,
            "layers": sorted(layers),
            "values": [layers[k] for k in sorted(layers)],
        }  # fmt: skip
        for (name, scale), layers in by_layer.items()
        if len(layers) > 1
    ]
    probes = [s for s in series if s["kind"] == "probe"]
    if len(probes) > 1:  # e.g. a probe per layer: one row each
        grids.append({
            "name": "probes: score by token",
            "scale": "score",
            "layers": [s["name"].removeprefix("probe ") for s in probes],
            "values": [s["values"] for s in probes],
        })  # fmt: skip
    return {
        "title": title if title is not None else _title(output, stored),
        "tokens": [token_text(t) for t in ids],
        "ids": ids,
        "n_prompt": n_prompt,
        "series": series,
        "top_k": top_k,
        "grids": grids,
        "marks": _marks(output, completion, stored, place),
    }


class _Placer:
    """Puts prefill and decode rows at their positions among ``n_tokens`` tokens."""

    def __init__(self, n_prompt: int, n_tokens: int) -> None:
        self.n_prompt = n_prompt
        self.n_tokens = n_tokens

    def positions(self, n_prefill: int, n_decode: int) -> tuple[int, int]:
        """Where the prefill rows and the decode rows start (prefill rows are the last
        ``n_prefill`` prompt positions: a request may keep only the last one)."""
        return self.n_prompt - n_prefill, self.n_prompt - 1

    def series(self, prefill: Any, decode: Any) -> list[Any]:
        out: list[Any] = [None] * self.n_tokens
        for rows, start in self._placed(prefill, decode):
            for i, value in enumerate(rows.tolist()):
                if 0 <= start + i < self.n_tokens:
                    out[start + i] = value
        return out

    def top_k(self, prefill: Any, decode: Any) -> list[Any]:
        out: list[Any] = [None] * self.n_tokens
        for rows, start in self._placed(prefill, decode):
            for i in range(len(rows)):
                if 0 <= start + i < self.n_tokens:
                    on = rows.indices[i] >= 0
                    pairs = zip(rows.indices[i][on].tolist(), rows.values[i][on].tolist(),
                                strict=True)  # fmt: skip
                    out[start + i] = [[int(a), _finite(b)] for a, b in pairs]
        return out

    def _placed(self, prefill: Any, decode: Any) -> list[tuple[Any, int]]:
        n_prefill = len(prefill) if prefill is not None else 0
        p0, d0 = self.positions(n_prefill, 0)
        placed = []
        if prefill is not None and n_prefill:
            placed.append((prefill, p0))
        if decode is not None and len(decode):
            placed.append((decode, d0))  # decode row 0 is the last prompt position
        return placed


def _first_completion(output: Any) -> Any:
    """A ``RequestOutput``'s first completion; None for a capture-only output (its
    ``outputs`` is None: nothing was generated)."""
    completions = getattr(output, "outputs", None)
    if isinstance(completions, list | tuple) and completions:
        return completions[0]
    if completions is None:
        return None
    raise TypeError(
        f"view() shows RequestOutputs, capture() outputs and stored requests; got a "
        f"{type(output).__name__} whose outputs is a {type(completions).__name__}."
    )


def _get(obj: Any, name: str) -> dict:
    value = getattr(obj, name, None) if obj is not None else None
    return value if isinstance(value, Mapping) else {}


def _columns(values: list[Any]) -> list[tuple[str, list[Any]]]:
    """A probe's series: one, or one per class of a multi-class probe (``[n, classes]``)."""
    first = next((v for v in values if v is not None), None)
    if not isinstance(first, list):
        return [("", [_finite(v) for v in values])]
    return [
        (f"[{c}]", [None if v is None else _finite(v[c]) for v in values])
        for c in range(len(first))
    ]


def _series(name: str, kind: str, values: list[Any], scale: str) -> dict[str, Any]:
    return {"name": name, "kind": kind, "scale": scale, "values": values}


def _finite(value: Any) -> float | None:
    """A JSON number (None for NaN and infinities, which JSON has not)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _scalar(rows: Any) -> Any:
    return None if rows is None else rows.l0.float()


def _extra(rows: Any, column: str) -> Any:
    return None if rows is None else rows.extra[column].float()


def _head_numbers(before: Any, after: Any, count: int) -> list[Any]:
    """What each lead slice is (a request's chosen attention heads, ``labels["heads"]``), else
    its index."""
    for rows in (before, after):
        labels = getattr(rows, "labels", None) or {}
        if "heads" in labels and len(labels["heads"]) == count:
            return list(labels["heads"])
    return list(range(count))


def _lead_slices(before: Any, after: Any) -> list[tuple[Any, Any]]:
    """The prompt's and the completion's rows of each lead index (a top-k per head: a block
    each, ``" h<i>"``); one pair without lead axes."""
    pieces = [r.lead_slices() if r is not None else None for r in (before, after)]
    count = max(len(p) for p in pieces if p is not None)
    return [tuple(p[i] if p is not None else None for p in pieces) for i in range(count)]  # type: ignore[misc]


def _labelled(entry: dict[str, Any], known: Mapping[Any, str], name: str, kind: str) -> list[dict]:
    """Put the labels of a top-k block's entries on it (by entry index), and a series for each
    labelled entry (its value on each token: 0 where it is not among the kept)."""
    known = {int(k): str(v) for k, v in known.items()}
    entry["labels"] = {str(k): v for k, v in known.items()}
    return [
        _series(
            f"{name} #{index} {label}",
            kind,
            [_value_of(row, index) for row in entry["rows"]],
            "activation",
        )  # fmt: skip
        for index, label in sorted(known.items())
    ]


def _value_of(row: Any, index: int) -> float | None:
    if row is None:
        return None
    return next((v for i, v in row if i == index), 0.0)


def _entry_texts(rows: list[Any], token_text: Callable[[int], str]) -> dict[str, str]:
    """The text of every token id the rows name (once each)."""
    ids = {i for row in rows if row for i, _ in row}
    return {str(i): token_text(i) for i in sorted(ids)}


def _top_k_readouts(output: Any, completion: Any, stored: bool) -> list[tuple[Any, dict, dict]]:
    """Every registered top-k readout the output has: ``(readout, prefill rows by instance,
    decode rows by instance)``."""
    from probehook.outputs import registered_readouts

    found = []
    for source, readout in registered_readouts().items():
        if stored:
            prefill = output.top_k(source, phase="prefill")
            decode = output.top_k(source)
        else:
            before = getattr(output, readout.request_attributes[0], None)
            after = getattr(completion, readout.completion_attributes[0], None)
            prefill = readout.flat(before) if isinstance(before, Mapping) else {}
            decode = readout.flat(after) if isinstance(after, Mapping) else {}
        if prefill or decode:
            found.append((readout, prefill, decode))
    return found


def _marks(output: Any, completion: Any, stored: bool, place: _Placer) -> dict[str, Any]:
    """Flags (positions of the rows that crossed), the stop, steering, and what each write-table
    entry applied (on every token; its own words, ``Intervention.mark``)."""
    d0 = place.n_prompt - 1
    flags: dict[str, list[int]] = {}
    if completion is not None:
        for attribute in _flag_attributes():
            for key, rows in _get(completion, attribute).items():
                flags[f"{attribute.split('_')[0]} {key}"] = [d0 + int(r) for r in rows]
    stop_reason = None if stored else getattr(completion, "stop_reason", None)
    finish = output.finish_reason if stored else getattr(completion, "finish_reason", None)
    steering = output.steering if stored else getattr(completion, "steering", None)
    n_out = place.n_tokens - place.n_prompt
    stop = None
    if isinstance(stop_reason, str) and n_out:
        # The monitor crossed on the last decode row; the forced token came out of it.
        stop = {"position": d0 + n_out - 1, "reason": stop_reason}
    steering = _jsonable(steering) or None
    vectors = (steering or {}).get("vectors") or {}
    start = (steering or {}).get("start")
    return {
        "flags": flags,
        "stop": stop,
        "finish_reason": finish,
        "steering": steering,
        # the rows computed at positions from ``start`` on were steered (None: none were)
        "steered": (
            {"from": start, "vectors": vectors, "ops": (steering or {}).get("ops") or {}}
            if vectors and start is not None
            else None
        ),
        "writes": _write_marks(steering or {}),
    }


def _write_marks(steering: dict[str, Any]) -> dict[str, str]:
    """Each write-table entry's mark, by request option, in its intervention's words (where
    this process registers it; else its JSON)."""
    entries = interventions(OUTPUT_PROCESSORS)
    marks = {}
    for option, applied in steering.items():
        if option in STEERING_KEYS or not applied:
            continue
        entry = entries.get(option)
        marks[option] = entry.mark(applied) if entry is not None else json.dumps(applied)
    return marks


def _flag_attributes() -> list[str]:
    """Where flags are: the probe monitors', and those of every processor whose values
    monitors watch (SAE features, lenses, any registered readout's)."""
    from probehook.outputs.registry import MonitorFlags

    return [p.name for p in OUTPUT_PROCESSORS if isinstance(p, MonitorFlags)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float):
        return _finite(value)
    return value if isinstance(value, int | str | bool) or value is None else str(value)


def _title(output: Any, stored: bool) -> str:
    name = getattr(output, "store_id", None) if stored else getattr(output, "request_id", None)
    return f"request {name}" if name is not None else "request"
