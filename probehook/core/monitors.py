"""Acting on probe scores: :class:`ProbeMonitor` stops or flags generation when a probe's
score crosses a threshold.

A monitor is checked against the score of each decode row, i.e. the state that produces the
next token. ``stop`` is carried out in the worker (``probehook.adapter.monitor_processor``
forces the request's stop token in the same step); ``flag`` is computed in the front end from
the returned scores. Both use :func:`crossings` on the same float32 scores, so the front end
can name the probe that stopped a request without another message from the worker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from probehook.errors import CaptureConfigError

ACTIONS = ("stop", "flag")
DIRECTIONS = ("above", "below")
STOP_REASON_PREFIX = "probe:"


@dataclass(frozen=True)
class ProbeMonitor:
    """Stop or flag generation when probe ``probe`` crosses ``threshold``.

    Args:
        probe: name of an engine probe (``LLM(probes={name: ...})``).
        threshold: the score to cross. Probabilities (binary and multi-class probes) are in
            [0, 1]; a regression probe's raw values are unbounded.
        action: ``"stop"`` ends the completion at the first decode row that crosses (its
            ``finish_reason`` is ``"stop"``, ``stop_reason`` is ``"probe:<name>"``);
            ``"flag"`` lists every crossing row in ``CompletionOutput.probe_flags[name]`` and
            generation goes on.
        direction: ``"above"`` (score > threshold) or ``"below"`` (score < threshold).
        label: for a multi-class probe, the class whose probability is watched.
    """

    probe: str
    threshold: float
    action: str = "flag"
    direction: str = "above"
    label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.probe, str) or not self.probe:
            raise CaptureConfigError(f"ProbeMonitor probe={self.probe!r} must be a probe name.")
        if self.action not in ACTIONS:
            raise CaptureConfigError(
                f"ProbeMonitor action={self.action!r} is not valid; choose one of {ACTIONS}."
            )
        if self.direction not in DIRECTIONS:
            raise CaptureConfigError(
                f"ProbeMonitor direction={self.direction!r} is not valid; choose one of "
                f"{DIRECTIONS}."
            )
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float):
            raise CaptureConfigError(f"ProbeMonitor threshold={self.threshold!r} must be a number.")
        try:
            finite = math.isfinite(self.threshold)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            raise CaptureConfigError(f"ProbeMonitor threshold={self.threshold!r} must be finite.")

    @property
    def stop_reason(self) -> str:
        return STOP_REASON_PREFIX + self.probe

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def coerce(cls, value: Any) -> ProbeMonitor:
        """A monitor from a ProbeMonitor or its dict form (as a JSON request body has it)."""
        if isinstance(value, ProbeMonitor):
            return value
        if isinstance(value, Mapping):
            known = {"probe", "threshold", "action", "direction", "label"}
            unknown = sorted(map(str, set(value) - known))
            if unknown:
                raise CaptureConfigError(
                    f"Unknown ProbeMonitor field(s) {unknown}; valid fields are {sorted(known)}."
                )
            try:
                return cls(**value)
            except TypeError as e:
                raise CaptureConfigError(f"Bad ProbeMonitor {dict(value)!r}: {e}") from None
        raise CaptureConfigError(
            f"{value!r} is not a monitor: pass probehook.ProbeMonitor(...) or a dict with "
            "'probe' and 'threshold'."
        )


def crosses(values: np.ndarray, threshold: float, direction: str) -> np.ndarray:
    """Which scores cross the threshold (strictly)."""
    return values > threshold if direction == "above" else values < threshold


def crossings(values: np.ndarray, threshold: float, direction: str) -> list[int]:
    """Indices of the scores that cross the threshold."""
    return np.flatnonzero(crosses(np.asarray(values), threshold, direction)).tolist()
