"""Capture sources as the front end sees them: one small object per source, so the fill path
has no per-source branches. A source is what one worker recorder keeps per token: hidden
``"hidden"`` rows (by layer), probe ``"scores"`` (by probe) or a top-k readout's rows (by
instance: SAE features, lenses).
Each says whether a request captures it, which positions it covers, what the export asks it
by, and how rows become an output's values. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from probehook.capture_config import CaptureConfig
from probehook.core.probe_spec import SCORES_SLOT
from probehook.core.spans import readout_config, score_config
from probehook.outputs.top_k import TopKDecoder

if TYPE_CHECKING:
    from probehook.frontend.probe_set import ProbeSet
    from probehook.frontend.readout_set import ReadoutSet
    from probehook.frontend.tracked_request import TrackedRequest


class CaptureSource:
    """One capture source of an engine (subclasses below)."""

    name = ""
    _spans: dict[CaptureConfig, CaptureConfig]

    def spans_of(self, config: CaptureConfig) -> CaptureConfig:
        """:meth:`spans_config`, worked out once per distinct config (a pooling batch asks
        it for every output)."""
        cache = self.__dict__.setdefault("_spans", {})
        spans = cache.get(config)
        if spans is None:
            if len(cache) > 256:
                cache.clear()
            spans = cache[config] = self.spans_config(config)
        return spans

    def active(self, request: TrackedRequest) -> bool:
        """Whether ``request`` captures this source."""
        raise NotImplementedError

    def spans_config(self, config: CaptureConfig) -> CaptureConfig:
        """The config this source's spans follow (scores and features: every token of the
        request's phases)."""
        return score_config(config)

    def slots(self, request: TrackedRequest) -> tuple[Any, ...]:
        """What an export of this source names for ``request`` (layers, probe slot, a
        readout's instances)."""
        raise NotImplementedError

    def value(self, rows: torch.Tensor, request: TrackedRequest) -> dict[Any, Any]:
        """Rows ``[len(slots), n, width]`` as an output holds them."""
        raise NotImplementedError

    def batch_values(
        self,
        slots: Sequence[Any],
        tensor: torch.Tensor,
        sizes: list[int],
        requests: Sequence[TrackedRequest],
    ) -> list[dict[Any, Any]]:
        """:meth:`value` of many spans fetched back to back (``sizes`` rows each)."""
        return [
            self.value(part, request)
            for part, request in zip(tensor.split(sizes, dim=1), requests, strict=False)
        ]

    def empty(self, request: TrackedRequest) -> dict[Any, Any]:
        """The value of positions an output does not hold: every slot, 0 rows."""
        raise NotImplementedError

    def stream_value(
        self, rows: torch.Tensor, lo: int, key: str, request: TrackedRequest, state: dict
    ) -> dict[Any, Any]:
        """:meth:`value` of a stream's rows from position ``lo`` (a view of the receiver's
        growing buffer); ``state``: this request stream's, kept across its yields, so a source
        that converts rows converts each once. Default: :meth:`value` (views of the rows)."""
        return self.value(rows, request)


class HiddenRows(CaptureSource):
    name = "hidden"

    def __init__(self) -> None:
        self.row_format: tuple[int, torch.dtype] = (0, torch.float32)
        """(hidden size, dtype) of captured rows, as the workers report them."""

    def active(self, request: TrackedRequest) -> bool:
        return request.config is not None and bool(request.config.layers)

    def spans_config(self, config: CaptureConfig) -> CaptureConfig:
        return config

    def slots(self, request: TrackedRequest) -> tuple[Any, ...]:
        assert request.config is not None
        return request.config.layers

    def value(self, rows: torch.Tensor, request: TrackedRequest) -> dict[Any, Any]:
        return dict(zip(self.slots(request), rows, strict=True))

    def batch_values(self, slots, tensor, sizes, requests):  # type: ignore[no-untyped-def]
        # One split per layer: far cheaper than a slice per span.
        per_layer = [(layer, rows.split(sizes)) for layer, rows in zip(slots, tensor, strict=True)]
        return [{layer: parts[i] for layer, parts in per_layer} for i in range(len(requests))]

    def empty(self, request: TrackedRequest) -> dict[Any, Any]:
        hidden, dtype = self.row_format
        return {layer: torch.empty((0, hidden), dtype=dtype) for layer in self.slots(request)}


class ProbeScores(CaptureSource):
    name = "scores"

    def __init__(self, probes: ProbeSet) -> None:
        self.probes = probes

    def active(self, request: TrackedRequest) -> bool:
        return request.probes is not None and bool(request.probes.names)

    def slots(self, request: TrackedRequest) -> tuple[Any, ...]:
        return (SCORES_SLOT,)

    def value(self, rows: torch.Tensor, request: TrackedRequest) -> dict[Any, Any]:
        assert request.probes is not None
        return self.probes.split(rows[0], request.probes.names)

    def batch_values(self, slots, tensor, sizes, requests):  # type: ignore[no-untyped-def]
        # One split per probe, once per set of probe names.
        scores = tensor[0]
        split: dict[tuple[str, ...], list[tuple[str, tuple[torch.Tensor, ...]]]] = {}
        values = []
        for i, request in enumerate(requests):
            names = request.probes.names
            columns = split.get(names)
            if columns is None:
                columns = split[names] = [
                    (name, column.split(sizes))
                    for name, column in self.probes.split(scores, names).items()
                ]
            values.append({name: parts[i] for name, parts in columns})
        return values

    def empty(self, request: TrackedRequest) -> dict[Any, Any]:
        assert request.probes is not None
        width = max((c.hi for c in self.probes.columns.values()), default=0)
        return self.probes.split(torch.empty((0, width)), request.probes.names)


class TopKReadoutRows(CaptureSource):
    """A top-k readout's rows (:class:`~probehook.frontend.readout_set.ReadoutSet`): one
    source for every registered readout, named by it."""

    def __init__(self, readouts: ReadoutSet) -> None:
        self.readouts = readouts
        self.name = readouts.source

    def _of(self, request: TrackedRequest) -> Any:
        return (request.readouts or {}).get(self.name)

    def spans_config(self, config: CaptureConfig) -> CaptureConfig:
        return readout_config(config, self.readouts.readout.follows_last_prefill_token)

    def active(self, request: TrackedRequest) -> bool:
        return self._of(request) is not None

    def slots(self, request: TrackedRequest) -> tuple[Any, ...]:
        return self._of(request).names

    def value(self, rows: torch.Tensor, request: TrackedRequest) -> dict[Any, Any]:
        return self.readouts.values(rows, self._of(request))

    def empty(self, request: TrackedRequest) -> dict[Any, Any]:
        return self.readouts.empty(self._of(request))

    def stream_value(self, rows, lo, key, request, state):  # type: ignore[no-untyped-def]
        asked = self._of(request)
        decoder = state.get((self.name, key))
        if decoder is None:
            sizes = [self.readouts.sizes(name) for name in asked.names]
            decoder = TopKDecoder(self.readouts.readout.row_type, sizes)
            state[(self.name, key)] = decoder
        decoded = decoder.decode(rows, lo)
        return self.readouts.readout.present(
            {
                name: self.readouts.view(name, r, asked)
                for name, r in zip(asked.names, decoded, strict=True)
            }
        )


def engine_sources(
    probes: ProbeSet | None = None,
    readouts: Mapping[str, ReadoutSet] | None = None,
) -> dict[str, CaptureSource]:
    """The sources an engine with these probes and top-k readouts records."""
    sources: dict[str, CaptureSource] = {"hidden": HiddenRows()}
    if probes is not None:
        sources["scores"] = ProbeScores(probes)
    for source, readout_set in (readouts or {}).items():
        sources[source] = TopKReadoutRows(readout_set)
    return sources


Sources = Mapping[str, CaptureSource]
