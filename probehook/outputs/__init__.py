"""Output processors: what a request returns besides text, decided in one place.

``OUTPUT_PROCESSORS`` holds probehook's own processors (``hidden_states``, ``probe_scores``,
``probe_flags``) and any a user or package registers, including those of installed packages'
``probehook.output_processors`` entry points (probehook's bundled segmenter's
``segmentation_image`` comes that way); lenses (``lens``, :mod:`probehook.lenses`) are a
top-k readout registered here (:mod:`probehook.outputs.lens`). See docs/outputs.md.
"""

from __future__ import annotations

from probehook.outputs.captures import BUILTIN, HiddenStates, ProbeFlags, ProbeScores
from probehook.outputs.lens import LensReadout
from probehook.outputs.registry import (
    ENTRY_POINT_GROUP,
    OnePassProcessor,
    OutputProcessor,
    OutputProcessorError,
    OutputProcessorRegistry,
)

OUTPUT_PROCESSORS = OutputProcessorRegistry()
for _processor in BUILTIN:
    OUTPUT_PROCESSORS.register(_processor)
OUTPUT_PROCESSORS.register(LensReadout)  # lenses: a top-k readout like any other

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
]
