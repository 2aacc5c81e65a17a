"""probehook: vLLM generation with residual-stream capture, activation stores and probes.

``from probehook import LLM, SamplingParams`` is a drop-in for ``from vllm import ...``.
Heavy imports (vLLM, torch) are deferred until a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from probehook.errors import (
    CaptureConfigError,
    CaptureError,
    ProbehookError,
    UnsupportedModelError,
)
from probehook.models import tiny_model_path

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vllm import SamplingParams

    from probehook.capture_config import CaptureConfig
    from probehook.llm import LLM

_LAZY = {
    "LLM": ("probehook.llm", "LLM"),
    "SamplingParams": ("vllm", "SamplingParams"),
    "CaptureConfig": ("probehook.capture_config", "CaptureConfig"),
}

__all__ = [
    "LLM",
    "SamplingParams",
    "CaptureConfig",
    "CaptureConfigError",
    "CaptureError",
    "ProbehookError",
    "UnsupportedModelError",
    "tiny_model_path",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'probehook' has no attribute {name!r}")
