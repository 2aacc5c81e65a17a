"""Output processors: what a request returns besides text, decided in one place.

``OUTPUT_PROCESSORS`` holds probehook's own processors (``hidden_states``, ``probe_scores``,
``probe_flags``) and any a user or package registers; see docs/outputs.md.
"""

from __future__ import annotations

from probehook.outputs.captures import BUILTIN, HiddenStates, ProbeFlags, ProbeScores
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


def _register_segmentation() -> None:
    from probehook.segmentation.processor import SegmentationImage  # no vLLM imports

    OUTPUT_PROCESSORS.register(SegmentationImage)


_register_segmentation()

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
