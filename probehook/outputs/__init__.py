"""Output processors: what a request returns besides text, decided in one place.

``OUTPUT_PROCESSORS`` holds probehook's own processors (``hidden_states``, ``probe_scores``,
``probe_flags``) and any a user or package registers, including those of installed packages'
``probehook.output_processors`` entry points (probehook's bundled segmenter's
``segmentation_image`` comes that way); lenses (``lens``, :mod:`probehook.lenses`) are a
top-k readout registered here (:mod:`probehook.outputs.lens`); SAE features
(``sae_features``, :mod:`probehook.saes.readout`) come through the entry point, as a third
party's readout would. See docs/outputs.md.
"""

from __future__ import annotations

from probehook.core.monitors import load_top_k_monitors_with
from probehook.outputs.attention import AttentionReadout
from probehook.outputs.captures import BUILTIN, HiddenStates, ProbeFlags, ProbeScores
from probehook.outputs.lens import LensReadout
from probehook.outputs.patching import Patching
from probehook.outputs.registry import (
    ENTRY_POINT_GROUP,
    OnePassProcessor,
    OutputProcessor,
    OutputProcessorError,
    OutputProcessorRegistry,
)
from probehook.outputs.top_k_readout import TopKReadout, top_k_readouts

OUTPUT_PROCESSORS = OutputProcessorRegistry()
# A monitor's dict form is parsed by its class, which its readout registers: the registry's
# entry points are loaded before any lookup of one.
load_top_k_monitors_with(OUTPUT_PROCESSORS.names)
for _processor in BUILTIN:
    OUTPUT_PROCESSORS.register(_processor)
OUTPUT_PROCESSORS.register(LensReadout)  # lenses: a top-k readout like any other
OUTPUT_PROCESSORS.register(AttentionReadout)  # attention per head: one more
OUTPUT_PROCESSORS.register(Patching)  # activation patching: a write-table entry


def registered_readouts() -> dict[str, TopKReadout]:
    """Every top-k readout ``OUTPUT_PROCESSORS`` holds (its entry points loaded), by source."""
    return top_k_readouts(OUTPUT_PROCESSORS)


__all__ = [
    "ENTRY_POINT_GROUP",
    "OUTPUT_PROCESSORS",
    "HiddenStates",
    "OnePassProcessor",
    "OutputProcessor",
    "OutputProcessorError",
    "OutputProcessorRegistry",
    "ProbeFlags",
    "ProbeScores",
    "registered_readouts",
]
