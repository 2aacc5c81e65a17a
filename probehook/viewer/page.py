"""The viewer's page: one self-contained HTML fragment (its CSS, its script and its data
inline; nothing fetched), drawn here with the tokens already coloured by the first score, so it
reads even where scripts do not run (an untrusted notebook); ``static/view.js`` adds the score
selector and the panel of the token under the pointer. No vLLM.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from probehook.viewer.tokens import Labels, request_data

BASE_COLOUR = (33, 102, 172)
"""Tokens are painted from white to this blue by their score's level in [0, 1]."""
NEGATIVE_COLOUR = (178, 24, 43)
"""... and from white to this red by a negative level in [-1, 0) (a value below zero)."""


def shade(t: float) -> str:
    """The colour of level ``t`` in [-1, 1] (the same rule as ``view.js``'s ``shade``)."""
    base, a = (NEGATIVE_COLOUR, -t) if t < 0 else (BASE_COLOUR, t)
    return "rgb({}, {}, {})".format(*(math.floor(255 + (c - 255) * a + 0.5) for c in base))


def paint(t: float) -> str:
    """A token's style at level ``t``: its background, and white text where it is dark."""
    text = "; color: #ffffff" if abs(t) > DARK else ""
    return f"background-color: {shade(t)}{text}"


DARK = 0.6
"""Above this level (either sign) the background is dark enough for white text."""


def level(value: float | None, scale: str, top: float) -> float | None:
    """A score's level in [-1, 1]: a probability as it is, a log-prob's probability, an
    activation or a value over the series' largest magnitude ``top`` (``view.js``'s
    ``level``); None for no value (or a non-finite one)."""
    if value is None or not math.isfinite(value):
        return None
    if scale == "logprob":
        t = math.exp(value)
    elif scale == "probability":
        t = value
    else:  # "activation", "value": signed, over the largest magnitude
        t = value / top if top > 0 else 0.0
    return min(1.0, max(-1.0, t))


def series_top(series: dict[str, Any]) -> float:
    """The largest magnitude among a series' values."""
    return max([abs(v) for v in series["values"] if v is not None and math.isfinite(v)] + [0.0])


def series_scale(series: dict[str, Any]) -> str:
    """The scale a series is painted on: a probe's ``"score"`` is ``"probability"`` where
    every value lies in [0, 1] (a binary or multi-class probe), else ``"value"`` (a regression
    probe's raw outputs, signed); others as they say (``view.js``'s ``scaleOf``)."""
    if series["scale"] != "score":
        return series["scale"]
    inside = all(v is None or not math.isfinite(v) or 0.0 <= v <= 1.0 for v in series["values"])
    return "probability" if inside else "value"


@cache
def _static(name: str) -> str:
    return resources.files("probehook.viewer").joinpath("static", name).read_text("utf-8")


class View:
    """Requests' tokens and everything probehook read of them, as a page: shown inline in a
    notebook (``_repr_html_``), written to a file (:meth:`save`), or handed to CircuitsVis
    (:meth:`colored_tokens`)."""

    def __init__(self, requests: Sequence[dict[str, Any]]) -> None:
        self.requests = list(requests)
        """Each request's view data (:func:`~probehook.viewer.tokens.request_data`)."""

    def html(self) -> str:
        """The fragment: CSS, each request's tokens and data, the script."""
        body = "".join(_request_html(i, data) for i, data in enumerate(self.requests))
        return (
            f'<div class="ph-view"><style>{_static("view.css")}</style>{body}'
            f"<script>{_static('view.js')}</script></div>"
        )

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:  # what a notebook shows where HTML is not rendered
        sizes = ", ".join(str(len(data["tokens"])) for data in self.requests)
        return f"<probehook View of {len(self.requests)} request(s), tokens: {sizes}>"

    def save(self, path: str | Path) -> Path:
        """A standalone page (opens in any browser, offline)."""
        path = Path(path)
        page = (
            '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>probehook view</title>'
            f"</head><body>{self.html()}</body></html>\n"
        )
        path.write_text(page, encoding="utf-8")
        return path

    def colored_tokens(self, series: str | None = None, request: int = 0) -> dict[str, Any]:
        """One request's tokens and one score per token in CircuitsVis's ``colored_tokens``
        arguments (``circuitsvis.tokens.colored_tokens(**view.colored_tokens())``): the first
        series, or the one named; tokens without a row get 0."""
        data = self.requests[request]
        chosen = _series(data, series)
        values = chosen["values"] if chosen is not None else [None] * len(data["tokens"])
        return {"tokens": list(data["tokens"]), "values": [0.0 if v is None else v for v in values]}


def _series(data: dict[str, Any], name: str | None) -> dict[str, Any] | None:
    if name is None:
        return data["series"][0] if data["series"] else None
    for series in data["series"]:
        if series["name"] == name:
            return series
    names = [s["name"] for s in data["series"]]
    raise ValueError(f"no series {name!r} in this view; its series are {names}.")


def _request_html(index: int, data: dict[str, Any]) -> str:
    first = data["series"][0] if data["series"] else None
    top = series_top(first) if first is not None else 0.0
    scale = series_scale(first) if first is not None else "probability"
    flagged = {p for rows in data["marks"]["flags"].values() for p in rows}
    stop = data["marks"]["stop"]
    steered = data["marks"].get("steered")
    spans = []
    for p, text in enumerate(data["tokens"]):
        classes = ["ph-token", "ph-prompt" if p < data["n_prompt"] else "ph-output"]
        if p in flagged:
            classes.append("ph-flag")
        if stop is not None and stop["position"] == p:
            classes.append("ph-stop")
        if steered is not None and p >= steered["from"]:
            classes.append("ph-steered")
        t = level(first["values"][p], scale, top) if first is not None else None
        style = f' style="{paint(t)}"' if t is not None else ""
        spans.append(
            f'<span class="{" ".join(classes)}" data-i="{p}"{style}>{html.escape(text)}</span>'
        )
    options = "".join(
        f'<option value="{i}">{html.escape(s["name"])}</option>'
        for i, s in enumerate(data["series"])
    )
    select = f'<select class="ph-series">{options}</select>' if options else ""
    marks = _marks_text(data["marks"])
    grids = "".join(_grid_html(grid, data) for grid in data["grids"])
    payload = inline_json(data)
    return (
        f'<div class="ph-request" data-request="{index}">'
        f'<div class="ph-title">{html.escape(data["title"])}</div>'
        f'<div class="ph-controls">colour by {select}</div>'
        f'<div class="ph-tokens">{"".join(spans)}</div>'
        f'<div class="ph-marks">{html.escape(marks)}</div>'
        f'<div class="ph-panel">point at a token</div>{grids}'
        f'<script type="application/json" class="ph-data">{payload}</script></div>'
    )


def inline_json(data: Any) -> str:
    """``data`` as JSON safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` as ``\\u``
    escapes (as Django's ``json_script``), so no text in it (a label, a token, a probe's name
    from someone else's store) can close the element or open an HTML comment in it."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _marks_text(marks: dict[str, Any]) -> str:
    parts = [f"finish: {marks['finish_reason']}"] if marks["finish_reason"] else []
    if marks["stop"] is not None:
        parts.append(f"stopped by {marks['stop']['reason']}")
    for key, rows in marks["flags"].items():
        parts.append(f"{key}: {len(rows)} flagged")
    if marks.get("steered"):
        ops = marks["steered"].get("ops") or {}  # a vector's op where it is not add
        vectors = ", ".join(
            f"{k}{' ' + str(ops[k]) if k in ops else ''} x{v:g}"
            for k, v in marks["steered"]["vectors"].items()
        )
        parts.append(f"steered by {vectors} from position {marks['steered']['from']}")
    parts.extend((marks.get("writes") or {}).values())
    return "; ".join(parts)


def _grid_html(grid: dict[str, Any], data: dict[str, Any]) -> str:
    rows = []
    whole = {"scale": grid["scale"], "values": [v for values in grid["values"] for v in values]}
    scale, top = series_scale(whole), series_top(whole)
    for layer, values in zip(grid["layers"], grid["values"], strict=True):
        cells = []
        for p, value in enumerate(values):
            t = level(value, scale, top)
            colour = shade(t) if t is not None else "#ffffff"
            tip = html.escape(f"layer {layer}, {data['tokens'][p]!r}: {value}")
            cells.append(f'<td title="{tip}" style="background-color: {colour}"></td>')
        rows.append(f"<tr><th>{html.escape(str(layer))}</th>{''.join(cells)}</tr>")
    return (
        f'<div class="ph-grid-name">{html.escape(grid["name"])}</div>'
        f'<table class="ph-grid">{"".join(rows)}</table>'
    )


def view(
    outputs: Any,
    tokenizer: Any = None,
    labels: Labels | None = None,
) -> View:
    """A :class:`View` of outputs: a ``RequestOutput``, a stored request, or a list of them
    (each shows its prompt and first completion).

    Args:
        tokenizer: what turns each token id into its text (``llm.get_tokenizer()``; anything
            with ``decode``); None: ids are shown as ``<id>``.
        labels: names of top-k entries by instance name, e.g. an SAE's features
            (``{"res3": {320: "false statement"}}``) or a lens instance's tokens
            (``{"j@3": {1234: "Paris"}}``).
    """
    items = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    if not items:
        raise ValueError("view() needs at least one output: got an empty list.")
    token_text = _token_text(tokenizer)
    return View([request_data(item, token_text, labels) for item in items])


def _token_text(tokenizer: Any) -> Callable[[int], str]:
    if tokenizer is None:
        return lambda token: f"<{token}>"
    if not hasattr(tokenizer, "decode"):
        raise TypeError(
            f"tokenizer={type(tokenizer).__name__} has no decode(); pass llm.get_tokenizer() "
            "or a Hugging Face tokenizer."
        )
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = tokenizer.decode([token])
        return cache[token]

    return text
