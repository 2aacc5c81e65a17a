"""A top-k readout as one entry of the readout table: an output processor that also says
which engine and request options ask for it, how its named instances are checked against the
model, and what the worker computes from a row. Register it as any output processor
(``OUTPUT_PROCESSORS.register(MyReadout)``, or the ``probehook.output_processors`` entry
point: every process of an engine must know it), and it flows with no other edit: the engine
option (``LLM(**{engine_option: {name: spec}})``, ``probehook serve --readout
SOURCE:NAME=SPEC``), the per-request option (``extra_args={"probehook": {request_option:
[names]}}``), the worker's generic bank (:class:`~probehook.worker.top_k_bank.TopKBank`:
each name on the rows of the requests that asked for it), the generic top-k rows
(:class:`~probehook.outputs.top_k.TopKRows`) on offline outputs, streams and server choices,
and the store's sparse top-k datasets.

No vLLM. The worker calls :meth:`TopKReadout.read`; everything else runs in the front end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from probehook.outputs.registry import OutputProcessor
from probehook.outputs.top_k import TopKRows, compact_top_k, json_top_k


class TopKReadout(OutputProcessor):
    """Base class of top-k readouts. Subclasses set ``name`` (the output processor's),
    ``source`` (the capture source, also the readout's key on the wire and in the store),
    ``request_attributes = ("prefill_<x>",)``, ``completion_attributes = ("<x>",)``,
    ``engine_option`` and ``request_option``, and implement :meth:`settings` and
    :meth:`read`."""

    engine_option: ClassVar[str] = ""
    """The engine keyword argument that names the readout's instances: ``{name: spec}``."""
    request_option: ClassVar[str] = ""
    """The per-request option that picks instances: a list of names, True (all) or False."""
    default_k: ClassVar[int] = 8
    """Entries kept per token (the engine's ``<engine_option>_top_k`` may change it)."""
    max_k: ClassVar[int] = 256

    @property
    def k_option(self) -> str:
        """The engine keyword argument for k: ``<engine_option>_top_k``."""
        return f"{self.engine_option}_top_k"

    def settings(self, name: str, spec: Any, *, num_layers: int, hidden_size: int) -> dict:
        """The JSON-able settings of instance ``name`` the worker reads (``"layer"``: the
        decoder layer whose rows it reads), checked against the model; a clear
        :class:`~probehook.errors.CaptureConfigError` otherwise."""
        raise NotImplementedError

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        """How many distinct indices an instance's rows can hold (a vocabulary's size, an
        SAE's width): the store keeps indices in the smallest unsigned type that holds them.
        Default: uint32's range."""
        return 2**32 - 2

    def read(self, rows: torch.Tensor, settings: Mapping[str, Any], k: int) -> torch.Tensor:
        """In the worker: ``rows`` ``[n, hidden]`` of the instance's layer -> packed float32
        ``[n, 2k + 1]`` (k indices, -1 padding; k values, 0 padding; l0), on the rows'
        device."""
        raise NotImplementedError

    # -- the output processor's part: generic over top-k rows --------------------------

    def merge(self, pieces: list[dict[str, TopKRows]]) -> dict[str, TopKRows]:
        names = list(dict.fromkeys(name for piece in pieces for name in piece))
        return {name: TopKRows.cat([p[name] for p in pieces if name in p]) for name in names}

    def to_response(self, value: dict[str, TopKRows]) -> dict[str, Any]:
        return {name: json_top_k(rows) for name, rows in value.items()}

    def to_compact(self, value: dict[str, TopKRows]) -> dict[str, Any]:
        return compact_top_k(value)


def pack(indices: torch.Tensor, values: torch.Tensor, l0: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` indices and values and ``[n]`` l0 as the worker's packed float32 rows
    ``[n, 2k + 1]`` (what :meth:`TopKReadout.read` returns)."""
    return torch.cat([indices.float(), values.float(), l0.float().unsqueeze(1)], dim=1)


def top_k_readouts(processors: Any) -> dict[str, TopKReadout]:
    """The registered top-k readouts by source (``processors``: ``OUTPUT_PROCESSORS``)."""
    return {p.source: p for p in processors if isinstance(p, TopKReadout) and p.source}
