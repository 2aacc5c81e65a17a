"""Unit tests of capture options: resolution, validation and per-request narrowing."""

from __future__ import annotations

import pytest

from probehook.capture_config import CaptureConfig, resolve_layers
from probehook.errors import CaptureConfigError, ProbehookError
from probehook.recorder import NO_END, keep_interval


def test_resolve_layers() -> None:
    assert resolve_layers([1, -1], 4) == (1, 3)
    assert resolve_layers("all", 3) == (0, 1, 2)
    assert resolve_layers([2, 2, -2], 4) == (2,)


@pytest.mark.parametrize("bad", [[4], [-5], ["1"], [], "some", [True], 3])
def test_bad_layers_name_the_valid_range(bad) -> None:
    with pytest.raises(CaptureConfigError) as err:
        resolve_layers(bad, 4)
    assert "0..3" in str(err.value) or "'all'" in str(err.value)
    assert isinstance(err.value, ProbehookError) and isinstance(err.value, ValueError)


def test_nothing_to_capture_is_rejected() -> None:
    with pytest.raises(CaptureConfigError, match="include_prefill and include_decode"):
        CaptureConfig(layers=(0,), include_prefill=False, include_decode=False)


def test_request_may_narrow_but_not_widen() -> None:
    engine = CaptureConfig(layers=(1, 3), include_prefill=True)
    assert engine.narrow(None) is engine
    assert engine.narrow({"layers": [3]}).layers == (3,)
    assert engine.narrow({"include_prefill": False, "include_decode": False}) is None
    with pytest.raises(CaptureConfigError, match=r"layers=\[1, 3\]"):
        engine.narrow({"layers": [2]})
    with pytest.raises(CaptureConfigError, match="Unknown per-request"):
        engine.narrow({"layer": [1]})
    decode_only = CaptureConfig(layers=(1,))
    with pytest.raises(CaptureConfigError, match="include_prefill=True"):
        decode_only.narrow({"include_prefill": True})


def test_round_trip() -> None:
    config = CaptureConfig(layers=(0, 2), include_prefill=True, last_decode_token=True)
    assert CaptureConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(), (4, NO_END)),
        (dict(include_prefill=True), (0, NO_END)),
        (dict(include_prefill=True, include_decode=False), (0, 5)),
        (dict(include_prefill=True, include_decode=False, last_prefill_token=True), (4, 5)),
        (dict(include_prefill=True, last_prefill_token=True), (4, NO_END)),
    ],
)
def test_keep_interval(options, expected) -> None:
    # A 5-token prompt: decode row 0 is position 4 (the last prompt token).
    assert keep_interval(CaptureConfig(layers=(0,), **options), 5) == expected
