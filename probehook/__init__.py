"""probehook: vLLM generation with residual-stream capture, activation stores and probes.

``from probehook import LLM, SamplingParams`` is a drop-in for ``from vllm import ...``.
Heavy imports (vLLM, torch) are deferred until a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from probehook._version import __version__
from probehook.errors import (
    CaptureConfigError,
    CaptureError,
    DuplicateStoreIdError,
    MissingExtraError,
    ProbeError,
    ProbehookError,
    StoreCorruptError,
    StoreError,
    StoreFormatError,
    StoreLockedError,
    UnsupportedModelError,
)
from probehook.models import tiny_model_path, tiny_sae_path

if TYPE_CHECKING:
    from vllm import SamplingParams

    from probehook.adapter.frontend.async_engine import AsyncLLM
    from probehook.adapter.frontend.offline import LLM
    from probehook.capture_config import CaptureConfig
    from probehook.core.monitors import ProbeMonitor
    from probehook.frontend.fill import FailedCapture
    from probehook.frontend.patch_sweep import PatchSweep
    from probehook.lenses.artifacts import JacobianLens, TunedLens
    from probehook.outputs.array_codec import decode_array
    from probehook.outputs.lens import LensMonitor, LensRows
    from probehook.probes import LinearProbe
    from probehook.saes import SAE, SAEFeatures
    from probehook.saes.readout import FeatureMonitor
    from probehook.steering import SteeringVector
    from probehook.store import ActivationStore, LayerMatrix, StoredRequest

_LAZY = {
    "LLM": ("probehook.adapter.frontend.offline", "LLM"),
    "AsyncLLM": ("probehook.adapter.frontend.async_engine", "AsyncLLM"),
    "SamplingParams": ("vllm", "SamplingParams"),
    "CaptureConfig": ("probehook.capture_config", "CaptureConfig"),
    "FailedCapture": ("probehook.frontend.fill", "FailedCapture"),
    "ActivationStore": ("probehook.store", "ActivationStore"),
    "LayerMatrix": ("probehook.store", "LayerMatrix"),
    "StoredRequest": ("probehook.store", "StoredRequest"),
    "LinearProbe": ("probehook.probes", "LinearProbe"),
    "ProbeMonitor": ("probehook.core.monitors", "ProbeMonitor"),
    "FeatureMonitor": ("probehook.saes.readout", "FeatureMonitor"),
    "LensMonitor": ("probehook.outputs.lens", "LensMonitor"),
    "SteeringVector": ("probehook.steering", "SteeringVector"),
    "PatchSweep": ("probehook.frontend.patch_sweep", "PatchSweep"),
    "SAE": ("probehook.saes", "SAE"),
    "SAEFeatures": ("probehook.saes", "SAEFeatures"),
    "SAEError": ("probehook.saes", "SAEError"),
    "JacobianLens": ("probehook.lenses.artifacts", "JacobianLens"),
    "TunedLens": ("probehook.lenses.artifacts", "TunedLens"),
    "LensRows": ("probehook.outputs.lens", "LensRows"),
    "decode_array": ("probehook.outputs.array_codec", "decode_array"),
    "view": ("probehook.viewer", "view"),
    "View": ("probehook.viewer", "View"),
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "CaptureConfig",
    "ActivationStore",
    "LayerMatrix",
    "StoredRequest",
    "LinearProbe",
    "ProbeMonitor",
    "FeatureMonitor",
    "LensMonitor",
    "SteeringVector",
    "PatchSweep",
    "SAE",
    "SAEFeatures",
    "SAEError",
    "JacobianLens",
    "TunedLens",
    "LensRows",
    "decode_array",
    "view",
    "View",
    "FailedCapture",
    "CaptureConfigError",
    "CaptureError",
    "DuplicateStoreIdError",
    "MissingExtraError",
    "ProbeError",
    "ProbehookError",
    "StoreError",
    "StoreFormatError",
    "StoreLockedError",
    "StoreCorruptError",
    "UnsupportedModelError",
    "tiny_model_path",
    "tiny_sae_path",
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


def __dir__() -> list[str]:
    # Tab completion shows the lazy names too.
    return sorted(set(globals()) | set(__all__))
