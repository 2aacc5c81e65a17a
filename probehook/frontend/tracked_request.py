"""What the front end remembers of one captured request, from its tagging until its output
is filled (the session's pending requests, a stream's request)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from probehook.capture_config import CaptureConfig
from probehook.frontend.probe_set import RequestProbes
from probehook.frontend.readout_set import RequestReadout
from probehook.frontend.steering_set import RequestSteer


@dataclass(slots=True)
class TrackedRequest:
    """What the front end remembers of one captured request until its output is filled."""

    tag: str
    engine_id: str
    config: CaptureConfig | None
    sampling: dict[str, Any]
    probes: RequestProbes | None = None
    stop_token: int | None = None
    record: dict[str, Any] | None = None
    """Extra fields of the request's store record (a one-pass input's request and patch)."""
    steering: RequestSteer | None = None
    """The request's steering (None: not steered)."""
    readouts: dict[str, RequestReadout] | None = None
    """The top-k readouts it gets, by source (None: none)."""
    writes: Mapping[str, Mapping[str, Any]] | None = None
    """The write table's terms it applies (``RequestWire.writes``; None: none)."""
