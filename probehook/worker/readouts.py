"""The worker's readout table: one row per capture source (``"hidden"`` rows, probe
``"scores"``, ``"sae"`` features, and the readouts to come), saying how its recorder is built
from what the loader allocated, which wire key lists what a request gets of it, and which
ranks record it. The step hook, the plan factory and the RPC surface read the table instead of
naming sources; a new readout adds its row here (and its bank to the loader).

No vLLM imports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probehook.worker.probe_bank import ProbeBank
from probehook.worker.recorder import StepRecorder
from probehook.worker.top_k_bank import TopKBank

RANK_0 = "rank 0"
"""Recorded by the rank that answers exports alone (the other ranks hold the same data)."""
EVERY_RANK = "every rank"
"""Recorded by every rank: each rank samples, so a stop monitor's stop must be forced on all
alike."""
STOPS_OFF_RANK_0 = "rank 0, and the stops elsewhere"
"""Recorded by rank 0, and by the other ranks only for the requests a stop monitor of this
source watches in the sampler."""


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


def _sae(hook: Any, banks: Any) -> StepRecorder | None:
    if hook.sae_bank is None:  # read from the SAEs' folders by the loader, before this
        return None
    buffers = [hook.buffers[layer] for layer in hook.sae_bank.layers]
    return StepRecorder(buffers, hook.sae_bank.layers, transform=hook.sae_bank, source="sae")


READOUTS: dict[str, WorkerReadout] = {
    r.source: r
    for r in (
        WorkerReadout("hidden", None, RANK_0, _hidden),
        WorkerReadout("scores", "probes", EVERY_RANK, _scores, read_in_sampler=True),
        WorkerReadout("sae", "saes", STOPS_OFF_RANK_0, _sae, read_in_sampler=True),
    )
}
"""Every readout a worker knows, by source, in the order the step hook records them."""


def _lens_bank(readout: Any, instances: Any, k: int, model: Any) -> Any:
    from probehook.errors import UnsupportedModelError
    from probehook.worker.lens_bank import LensBank

    if model.head is None:
        raise UnsupportedModelError(
            "lenses read the model's final norm and unembedding, and this model has none "
            "probehook can call: a final norm of a name it does not know, or, run as a pooling "
            "model (capture_only=True), an untied LM head that is not in a safetensors file of "
            "the checkpoint."
        )
    return LensBank(instances, k, model.head, model.token_logits, model.shard).to(model.device)


def _generic_bank(readout: Any, instances: Any, k: int, model: Any) -> Any:
    return TopKBank(readout, instances, k)


TOP_K_BANKS: dict[str, Callable[[Any, Any, int, Any], Any]] = {"lens": _lens_bank}
"""The bank of each top-k readout that needs more than its ``read`` (lenses: the model's
head), by source; every other top-k readout gets the generic
:class:`~probehook.worker.top_k_bank.TopKBank`."""


SHARDED_READOUTS = frozenset({"lens"})
"""Top-k readouts every rank reads in step under tensor parallelism (a lens: each rank holds a
shard of the vocabulary, and the partial readings are merged by a collective); every rank
samples, so each also forces a lens monitor's stop alike."""


def top_k_bank(source: str, readout: Any, instances: Any, k: int, model: Any) -> Any:
    """The worker's bank of top-k readout ``source``, built at load (``model``: the parts of
    the model readouts may need, ``ModelParts``)."""
    return TOP_K_BANKS.get(source, _generic_bank)(readout, instances, k, model)


def readout_row(source: str) -> WorkerReadout:
    """The table's row of ``source``: a built-in one, or the generic row of a top-k readout
    (:class:`~probehook.worker.top_k_bank.TopKBank`, allocated at load; rank 0 records it)."""
    row = READOUTS.get(source)
    if row is not None:
        return row
    # Its step's rows stay readable in the sampler (a lens monitor's stop reads them).
    build = functools.partial(_top_k, source)
    ranks = EVERY_RANK if source in SHARDED_READOUTS else RANK_0
    return WorkerReadout(source, source, ranks, build, read_in_sampler=True)


def _top_k(source: str, hook: Any, banks: Any) -> StepRecorder | None:
    bank = hook.top_k_banks.get(source)
    if bank is None:
        return None
    buffers = [hook.buffers[layer] for layer in bank.layers]
    return StepRecorder(buffers, bank.layers, transform=bank, source=source)
