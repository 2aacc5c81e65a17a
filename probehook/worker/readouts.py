"""The worker's readout table: one row per capture source (``"hidden"`` rows, probe
``"scores"``, and each top-k readout's: SAE features, lenses, a third party's), saying how
its recorder is built from what the loader allocated, which wire key lists what a request
gets of it, and which ranks record it. The step hook, the plan factory and the RPC surface
read the table instead of naming sources; a top-k readout's row is derived from what it
declares (its bank's factory and its ranks).

No vLLM imports.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probehook.worker.probe_bank import ProbeBank
from probehook.worker.recorder import StepRecorder

RANK_0 = "rank 0"
"""Recorded by the rank that answers exports alone (the other ranks hold the same data)."""
EVERY_RANK = "every rank"
"""Recorded by every rank: each rank samples, so a stop monitor's stop must be forced on all
alike."""
STOPS_OFF_RANK_0 = "rank 0, and the stops elsewhere"
"""Recorded by rank 0, and by the other ranks only for the requests a stop monitor of this
source watches in the sampler."""
RANKS = (RANK_0, EVERY_RANK, STOPS_OFF_RANK_0)


@dataclass(frozen=True)
class WorkerReadout:
    """One row of the table."""

    source: str
    """What exports ask the recorder by and stream messages are labelled with."""
    wire_key: str | None
    """The request wire's key listing what a request gets of it (probe or SAE names); None:
    what it gets follows the capture config (hidden rows, by layer)."""
    ranks: str
    """:data:`RANK_0`, :data:`EVERY_RANK` or :data:`STOPS_OFF_RANK_0`."""
    build: Callable[[Any, Any], StepRecorder | None]
    """``build(hook, banks)``: the recorder, from the step hook's tap buffers and what was
    allocated at load (None: this engine has no such readout)."""
    read_in_sampler: bool = False
    """Stop monitors read this step's rows before sampling (``keep_step_rows``)."""

    def records_on(self, reports: bool) -> bool:
        """Whether a rank records this source at all (``reports``: it answers exports)."""
        return reports or self.ranks != RANK_0

    def stops_only_on(self, reports: bool) -> bool:
        """Whether a rank records only the requests a stop monitor watches."""
        return not reports and self.ranks == STOPS_OFF_RANK_0


def _hidden(hook: Any, banks: Any) -> StepRecorder | None:
    layers = hook.config.layers
    return StepRecorder([hook.buffers[layer] for layer in layers], layers) if layers else None


def _scores(hook: Any, banks: Any) -> StepRecorder | None:
    if not banks.probes:
        return None
    probes = ProbeBank(banks.probes, hook.device)
    buffers = [hook.buffers[layer] for layer in probes.layers]
    return StepRecorder(buffers, probes.layers, transform=probes, source="scores")


READOUTS: dict[str, WorkerReadout] = {
    r.source: r
    for r in (
        WorkerReadout("hidden", None, RANK_0, _hidden),
        WorkerReadout("scores", "probes", EVERY_RANK, _scores, read_in_sampler=True),
    )
}
"""Every readout a worker knows, by source, in the order the step hook records them."""


def top_k_bank(readout: Any, instances: Any, k: int, model: Any) -> Any:
    """The worker's bank of a top-k readout, built at load by the factory the readout names
    (``TopKReadout.worker_bank``, ``"module:function"``; ``model``: the parts of the model
    readouts may need, ``ModelParts``)."""
    module, _, name = readout.worker_bank.partition(":")
    factory = getattr(importlib.import_module(module), name, None)
    if factory is None:
        raise ValueError(
            f"{type(readout).__name__}.worker_bank={readout.worker_bank!r} names no function "
            "(pass 'module:function')"
        )
    return factory(readout, instances, k, model)


def readout_row(source: str, ranks: str = RANK_0) -> WorkerReadout:
    """The table's row of ``source``: a built-in one, or the row of a top-k readout (its bank
    allocated at load), recorded on the ``ranks`` it declares (``TopKReadout.ranks``)."""
    row = READOUTS.get(source)
    if row is not None:
        return row
    if ranks not in RANKS:
        raise ValueError(f"readout {source!r}: ranks={ranks!r} is not one of {RANKS}")
    # Its step's rows stay readable in the sampler (a monitor's stop reads them).
    build = functools.partial(_top_k, source)
    return WorkerReadout(source, source, ranks, build, read_in_sampler=True)


def _top_k(source: str, hook: Any, banks: Any) -> StepRecorder | None:
    bank = hook.top_k_banks.get(source)
    if bank is None:
        return None
    # The site its rows are read at: the stream after each layer (the residual taps), or the
    # query at the layer's attention op (the query taps, ``attn_q``).
    taps = hook.query_buffers if getattr(bank, "site", "resid_post") == "attn_q" else hook.buffers
    buffers = [taps[layer] for layer in bank.layers]
    return StepRecorder(buffers, bank.layers, transform=bank, source=source)
