"""Unit tests of capture options: resolution, validation and per-request narrowing."""

from __future__ import annotations

import numpy as np
import pytest

from probehook.capture_config import CaptureConfig, resolve_layers
from probehook.core.spans import OPEN, KeepPlan, Span, completion_spans, keep_plan
from probehook.errors import CaptureConfigError, ProbehookError


def test_resolve_layers() -> None:
    assert resolve_layers([1, -1], 4) == (1, 3)
    assert resolve_layers("all", 3) == (0, 1, 2)
    assert resolve_layers([2, 2, -2], 4) == (2,)
    assert resolve_layers(["all"], 3) == (0, 1, 2)
    assert resolve_layers([np.int64(1), np.int32(-1)], 4) == (1, 3)
    assert resolve_layers(np.arange(2), 4) == (0, 1)


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
    ("options", "index", "end_known", "expected"),
    [
        (dict(), 0, True, KeepPlan(Span(4, OPEN), None)),
        (dict(include_prefill=True), 0, True, KeepPlan(Span(0, OPEN), None)),
        (dict(include_prefill=True), 1, True, KeepPlan(Span(4, OPEN), None)),
        (dict(include_prefill=True, include_decode=False), 0, True, KeepPlan(Span(0, 5), None)),
        (dict(include_prefill=True, include_decode=False), 1, True, KeepPlan(None, None)),
        (
            dict(include_prefill=True, include_decode=False, last_prefill_token=True),
            0,
            True,
            KeepPlan(Span(4, 5), None),
        ),
        (dict(last_decode_token=True), 0, True, KeepPlan(None, 4)),
        (dict(last_decode_token=True), 0, False, KeepPlan(Span(4, OPEN), None)),
        (dict(include_prefill=True, last_decode_token=True), 0, True, KeepPlan(Span(0, 5), 4)),
    ],
)
def test_keep_plan(options, index, end_known, expected) -> None:
    # A 5-token prompt: decode row 0 is position 4 (the last prompt token).
    config = CaptureConfig(layers=(0,), **options)
    assert keep_plan(config, 5, index, end_known) == expected


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(), (None, Span(4, 7))),
        (dict(include_prefill=True), (Span(0, 5), Span(4, 7))),
        (dict(include_prefill=True, last_prefill_token=True), (Span(4, 5), Span(4, 7))),
        (dict(last_decode_token=True), (None, Span(6, 7))),
        (dict(include_prefill=True, include_decode=False), (Span(0, 5), None)),
    ],
)
def test_completion_spans(options, expected) -> None:
    # 5 prompt tokens, 3 generated: decode rows are positions 4, 5, 6.
    assert completion_spans(CaptureConfig(layers=(0,), **options), 5, 3) == expected
