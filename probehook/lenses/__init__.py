"""Lenses: what the model would say next at a layer, for every token (logit, tuned and
Jacobian lenses), read in the engine as one entry of the readout table (docs/lenses.md).

``LLM(model, lenses={"logit": "logit", "j": JacobianLens.load("j.pt")}, lens_layers=[2, 4])``
puts ``out.lens[name][layer]`` (:class:`probehook.LensRows`) on every output. This package
holds the lens files (:mod:`~probehook.lenses.artifacts`) and the J-lens fit; the readout is
:mod:`probehook.outputs.lens`, the worker's bank :mod:`probehook.worker.lens_bank`.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "JacobianLens": ("probehook.lenses.artifacts", "JacobianLens"),
    "TunedLens": ("probehook.lenses.artifacts", "TunedLens"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'probehook.lenses' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
