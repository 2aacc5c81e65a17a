"""``probehook serve``'s own flags, parsed without starting anything."""

from __future__ import annotations

import argparse

import pytest

from probehook.adapter.server import capture_kwargs, parse_monitor
from probehook.core.monitors import ProbeMonitor
from probehook.errors import CaptureConfigError


def flags(**overrides: object) -> argparse.Namespace:
    values = dict(
        layers="1,5",
        probe=["truth=probes/truth.safetensors"],
        monitor=[],
        include_prefill=False,
        store=None,
        max_capture_response_mb=64.0,
        store_flush_interval=5.0,
    )
    return argparse.Namespace(**{**values, **overrides})


def test_flags_become_async_llm_arguments() -> None:
    kwargs = capture_kwargs(flags(monitor=["truth:stop:0.9"], include_prefill=True))
    assert kwargs["layers"] == [1, 5] and kwargs["include_prefill"] is True
    assert kwargs["probes"] == {"truth": "probes/truth.safetensors"}
    assert kwargs["monitors"] == [ProbeMonitor("truth", 0.9, "stop")]
    assert capture_kwargs(flags(layers=None, probe=[]))["probes"] is None


def test_monitor_specs() -> None:
    assert parse_monitor("truth:flag:0.2:below") == ProbeMonitor("truth", 0.2, "flag", "below")
    assert parse_monitor('{"probe": "topic", "threshold": 0.5, "label": "b"}').label == "b"
    for bad, message in [
        ("truth:0.9", "PROBE:ACTION:THRESHOLD"),
        ("truth:stop:high", "not a number"),
        ("truth:explode:0.9", "action"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(CaptureConfigError, match=message):
            parse_monitor(bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"probe": ["truth"]}, "must be NAME=PATH"),
        ({"probe": ["a=x", "a=y"]}, "given twice"),
        ({"monitor": ["truth:stop"]}, "PROBE:ACTION:THRESHOLD"),
        ({"max_capture_response_mb": 0.0}, "must be positive"),
        ({"layers": "1,x"}, "comma-separated ints"),
        ({"store_flush_interval": -1.0}, "store-flush-interval"),
    ],
)
def test_bad_flags_exit_with_a_message(overrides: dict, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        capture_kwargs(flags(**overrides))
