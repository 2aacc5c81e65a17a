"""The export RPC's messages, defined once (as :class:`~probehook.core.request_options.RequestWire`
is for a request's plan): what the front end asks the workers for and what rank 0 answers.
They travel as plain dicts and lists on vLLM's RPC; each class writes and reads its own form,
so neither side builds or indexes the other's dicts by hand.

- :class:`StreamAsk`: spans of one stream (a generation output's rows, or its scores);
- :class:`BatchAsk`: one final span of each of many streams, answered with one tensor
  (finished pooling requests);
- :class:`ExportReply`: the tensors' file, a :class:`SpanReport` per span handed over, a
  :class:`BatchReport` per batch and the streams whose capture failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def stream_id(source: str, key: str) -> str:
    """How a stream is named in failures: ``"<source>:<key>"``."""
    return f"{source}:{key}"


@dataclass
class StreamAsk:
    """Spans ``[lo, hi)`` of one stream, in ``layers`` (layer indices, or the scores' slot)."""

    key: str
    source: str
    layers: list[Any]
    spans: list[list[int]] = field(default_factory=list)
    final: bool = True
    """Forget the stream once handed over."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "source": self.source,
            "spans": self.spans,
            "layers": self.layers,
            "final": self.final,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> StreamAsk:
        return cls(
            str(d["key"]),
            str(d.get("source", "hidden")),
            list(d["layers"]),
            [[int(lo), int(hi)] for lo, hi in d["spans"]],
            bool(d.get("final", True)),
        )


@dataclass
class BatchAsk:
    """One final span of each stream in ``keys`` (``spans``: ``lo, hi`` of each, flat)."""

    source: str
    layers: list[Any]
    keys: list[str] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "layers": self.layers,
            "keys": self.keys,
            "spans": self.spans,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BatchAsk:
        return cls(str(d["source"]), list(d["layers"]), list(d["keys"]), list(d["spans"]))

    def pairs(self) -> list[tuple[int, int]]:
        flat = self.spans
        return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


@dataclass
class SpanReport:
    """One span handed over: where its rows are (``tensor_index``) and what was missing."""

    key: str
    source: str
    lo: int
    hi: int
    tensor_index: int = -1
    num_missing: int = 0
    missing: list[int] = field(default_factory=list)
    """The first missing positions (at most a few)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "source": self.source,
            "tensor_index": self.tensor_index,
            "lo": self.lo,
            "hi": self.hi,
            "num_missing": self.num_missing,
            "missing": self.missing,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SpanReport:
        return cls(
            d["key"],
            d["source"],
            d["lo"],
            d["hi"],
            d["tensor_index"],
            d["num_missing"],
            list(d["missing"]),
        )


@dataclass
class BatchReport:
    """A batch's tensor, and its items with rows missing: ``(item, number missing, first
    missing positions)``."""

    tensor_index: int
    incomplete: list[tuple[int, int, list[int]]] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"tensor_index": self.tensor_index, "incomplete": [list(i) for i in self.incomplete]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BatchReport:
        return cls(d["tensor_index"], [(i, n, list(m)) for i, n, m in d["incomplete"]])


@dataclass
class ExportReply:
    """Rank 0's answer: the file the tensors were written to (``path``, ``entries``: the
    transport's manifest; None and empty when nothing was), the reports, and the streams
    whose capture failed (:func:`stream_id` -> reason)."""

    path: str | None = None
    entries: list[Any] = field(default_factory=list)
    spans: list[SpanReport] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    batches: list[BatchReport] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "entries": self.entries,
            "spans": [s.to_wire() for s in self.spans],
            "failures": self.failures,
            "batches": [b.to_wire() for b in self.batches],
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ExportReply:
        return cls(
            d["path"],
            list(d["entries"]),
            [SpanReport.from_wire(s) for s in d["spans"]],
            dict(d["failures"]),
            [BatchReport.from_wire(b) for b in d.get("batches") or ()],
        )
