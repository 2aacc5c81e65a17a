"""The top-level names a user types, and tab completion for the lazy ones."""

from __future__ import annotations

import dataclasses

import probehook

PUBLIC = [
    "LLM",
    "SamplingParams",
    "CaptureConfig",
    "ActivationStore",
    "LayerMatrix",
    "StoredRequest",
    "LinearProbe",
    "ProbeMonitor",
    "SteeringVector",
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
]


def test_every_public_name_imports_from_the_top_level() -> None:
    from probehook import ActivationStore, FailedCapture, StoreError  # noqa: F401

    for name in PUBLIC:
        assert getattr(probehook, name) is not None, name
        assert name in probehook.__all__, name


def test_tab_completion_lists_the_lazy_names() -> None:
    listed = dir(probehook)
    for name in PUBLIC:
        assert name in listed, name


def test_unknown_name_is_a_clear_attribute_error() -> None:
    import pytest

    with pytest.raises(AttributeError, match="has no attribute 'ActivationStor'"):
        probehook.ActivationStor  # noqa: B018


def test_errors_are_one_family() -> None:
    for name in PUBLIC:
        value = getattr(probehook, name)
        if name.endswith("Error"):
            assert issubclass(value, probehook.ProbehookError), name


def test_the_capture_arguments_are_declared_once() -> None:
    """``LLM`` and ``AsyncLLM`` take the capture arguments of ``CaptureRequest`` (declared
    there once), and their signatures show each with its default."""
    import inspect

    from probehook import LLM, AsyncLLM
    from probehook.frontend.capture_request import CAPTURE_ARGUMENTS, CaptureRequest

    fields = {f.name: f.default for f in dataclasses.fields(CaptureRequest)}
    assert set(CAPTURE_ARGUMENTS) == set(fields)
    # Each registered readout's engine options too (SAE features', lenses'), default None.
    readout_options = ("saes", "sae_top_k", "sae_clamping", "sae_dtype", "lenses", "lens_layers")
    for front_end, refused in ((LLM, set()), (AsyncLLM, {"capture_only"})):
        shown = inspect.signature(front_end.__init__).parameters
        assert {n: p.default for n, p in shown.items() if n in fields} == {
            n: d for n, d in fields.items() if n not in refused
        }
        assert all(shown[o].default is None for o in readout_options)
        assert "kwargs" in shown
