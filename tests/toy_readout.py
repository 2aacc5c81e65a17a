"""Test-only top-k readouts. ``RowNorm``: each row's L2 norm, as a one-entry top-k (index 0,
the norm, l0 1). ``ChunkPeaks``: a readout with a per-head axis and a second scalar column
(the row split into ``heads`` equal chunks: each chunk's ``k`` largest entries and its norm,
and the row's mean). The proof that a readout is one module plus one registration line
(``OUTPUT_PROCESSORS.register(RowNorm)``, or the entry point a package declares:
``row_norms = toy_readout:RowNorm`` in ``probehook.output_processors``): nothing else in
probehook names them, and they reach offline outputs, streams, the server, the store and the
viewer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probehook.core.monitors import TopKMonitor
from probehook.errors import CaptureConfigError
from probehook.outputs.columns import Column
from probehook.outputs.top_k import TopKRows
from probehook.outputs.top_k_readout import TopKReadout, pack


@dataclass(frozen=True)
class NormMonitor(TopKMonitor):
    """Stop or flag where instance ``norm``'s row norm crosses ``threshold``: the readout's
    own monitor, declared here (``RowNorm.monitor``) and known to probehook by that alone
    (dict form ``{"norm": "n3", "threshold": 5.0, "action": "flag"}``)."""

    norm: str
    threshold: float
    action: str = "flag"
    direction: str = "above"

    source: ClassVar[str] = "norm"
    marker: ClassVar[str] = "norm"
    required: ClassVar[tuple[str, ...]] = ("norm", "threshold")
    watches: ClassVar[str] = "row norms"
    stop_prefix: ClassVar[str] = "norm:"

    def __post_init__(self) -> None:
        self._check_action(f"NormMonitor({self.norm!r})")

    @property
    def instance(self) -> str:
        return self.norm

    @property
    def entry(self) -> int:
        return 0  # the norm is entry 0 of the one-entry top-k

    @property
    def key(self) -> str:
        return self.norm


class RowNorm(TopKReadout):
    name = "row_norms"
    source = "norm"
    request_attributes = ("prefill_row_norms",)
    completion_attributes = ("row_norms",)
    engine_option = "norms"
    request_option = "norms"
    default_k = 1
    max_k = 1
    monitor = NormMonitor
    flags_attribute = "norm_flags"

    def settings(self, name: str, spec: Any, *, num_layers: int, hidden_size: int) -> dict:
        if isinstance(spec, str) and spec.isdigit():
            spec = int(spec)  # from the server's command line
        if isinstance(spec, bool) or not isinstance(spec, int) or not 0 <= spec < num_layers:
            raise CaptureConfigError(
                f"norms[{name!r}]={spec!r}: pass a layer in 0..{num_layers - 1}."
            )
        return {"layer": spec}

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        return 1  # one entry, index 0: stored as uint16

    def read(self, rows: torch.Tensor, settings: Mapping[str, Any], k: int) -> torch.Tensor:
        n = rows.shape[0]
        norms = rows.float().norm(dim=1, keepdim=True)
        index = torch.zeros((n, 1), device=rows.device)
        return pack(index, norms, torch.ones(n, device=rows.device))


class NextToken(TopKReadout):
    """A test-only readout of each row's next token (``reads_next_token``): entry the token's
    id, value 1 (none where no token came). It proves the generic bank hands ``read`` the next
    tokens, after the step's sampling, as the lens bank's are: registered in-process only."""

    name = "next_tokens"
    source = "next"
    request_attributes = ("prefill_next_tokens",)
    completion_attributes = ("next_tokens",)
    engine_option = "nexts"
    request_option = "nexts"
    default_k = max_k = 1
    reads_next_token = True
    entries_are_tokens = True

    def settings(self, name: str, spec: Any, *, num_layers: int, hidden_size: int) -> dict:
        return {"layer": int(spec)}

    def read(
        self, rows: torch.Tensor, settings: Mapping[str, Any], k: int, next_tokens: Any = None
    ) -> torch.Tensor:
        assert next_tokens is not None and len(next_tokens) == rows.shape[0]
        known = next_tokens >= 0
        return pack(
            next_tokens.unsqueeze(1).float(),
            known.float().unsqueeze(1),
            known.float(),
        )


@dataclass(frozen=True, repr=False)
class PeakRows(TopKRows):
    """``offsets`` int64 ``[n, heads, k]`` (each chunk's largest entries, by their offset in
    the chunk), ``peaks`` float32 ``[n, heads, k]`` (their values), ``chunk_norms`` float32
    ``[n, heads]``, and a second scalar, ``mean`` float32 ``[n]`` (the row's mean)."""

    scalar_dtype: ClassVar[torch.dtype] = torch.float32
    column_names: ClassVar[tuple[str, str, str]] = ("offsets", "peaks", "chunk_norms")
    lead_axes: ClassVar[tuple[str, ...]] = ("heads",)
    extra_columns: ClassVar[tuple[Column, ...]] = (Column("mean"),)


@dataclass(frozen=True)
class PeakMonitor(TopKMonitor):
    """Stop or flag where offset ``offset`` is among a chunk's peaks of instance ``peaks``
    with a value crossing ``threshold`` (the largest among the heads)."""

    peaks: str
    offset: int
    threshold: float
    action: str = "flag"
    direction: str = "above"

    source: ClassVar[str] = "peaks"
    marker: ClassVar[str] = "peaks"
    required: ClassVar[tuple[str, ...]] = ("peaks", "offset", "threshold")
    watches: ClassVar[str] = "chunk peaks"
    stop_prefix: ClassVar[str] = "peaks:"

    def __post_init__(self) -> None:
        self._check_action(f"PeakMonitor({self.peaks!r})")

    @property
    def instance(self) -> str:
        return self.peaks

    @property
    def entry(self) -> int:
        return self.offset

    @property
    def key(self) -> str:
        return f"{self.peaks}:{self.offset}"


class ChunkPeaks(TopKReadout):
    """``LLM(peaks={"p3": {"layer": 3, "heads": 4}}, peaks_top_k=2)``; ``probehook serve
    --peaks p3=3:4``; per request ``{"peaks": ["p3"], "peaks_top_k": 1}``."""

    name = "chunk_peaks"
    source = "peaks"
    request_attributes = ("prefill_chunk_peaks",)
    completion_attributes = ("chunk_peaks",)
    engine_option = "peaks"
    request_option = "peaks"
    default_k = 2
    max_k = 4
    row_type = PeakRows
    monitor = PeakMonitor
    flags_attribute = "peak_flags"
    scalar_series = ("norm", "activation")
    column_series = {"mean": "activation"}

    def settings(self, name: str, spec: Any, *, num_layers: int, hidden_size: int) -> dict:
        if isinstance(spec, str) and spec.count(":") == 1:  # from the server's command line
            layer, heads = spec.split(":")
            spec = {"layer": int(layer), "heads": int(heads)}
        if not isinstance(spec, Mapping) or set(spec) != {"layer", "heads"}:
            raise CaptureConfigError(
                f"peaks[{name!r}]={spec!r}: pass {{'layer': L, 'heads': H}} (or 'L:H')."
            )
        layer, heads = spec["layer"], spec["heads"]
        if not 0 <= layer < num_layers or heads < 1 or hidden_size % heads:
            raise CaptureConfigError(
                f"peaks[{name!r}]={dict(spec)!r}: the layer must be in 0..{num_layers - 1} and "
                f"the heads divide the hidden size {hidden_size}."
            )
        return {"layer": int(layer), "heads": int(heads), "width": hidden_size // heads}

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        return int(settings["width"])

    def read(self, rows: torch.Tensor, settings: Mapping[str, Any], k: int) -> torch.Tensor:
        chunks = rows.float().reshape(rows.shape[0], settings["heads"], settings["width"])
        peaks, offsets = chunks.topk(k, dim=-1)
        return self.pack(offsets, peaks, chunks.norm(dim=-1), mean=rows.float().mean(dim=1))
