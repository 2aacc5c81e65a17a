"""What the code that reads an output sees of its shape: a generation's completions or a
pooled result, and the stand-in of a capture that failed (:class:`FailedCapture`).

Shared by the fill path (frontend/fill.py) and the store (store/records.py), whose folders must
not import each other. Knows nothing about vLLM.
"""

from __future__ import annotations

from typing import Any

from probehook.core.stream_frames import failure_message
from probehook.errors import CaptureError


class FailedCapture(dict):
    """Stands in for the rows of a request whose capture failed: empty, and any lookup raises
    :class:`~probehook.errors.CaptureError` with the reason, so the failure is never silent."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def __getitem__(self, key: Any) -> Any:
        raise CaptureError(self.reason)

    def __repr__(self) -> str:
        return f"FailedCapture({self.reason!r})"

    @classmethod
    def of_stream(cls, key: str, reason: str) -> FailedCapture:
        """The failure of stream ``key``, as the worker reported it."""
        return cls(failure_message(key, reason))


def is_pooled(output: Any) -> bool:
    """Whether ``output`` is a pooling model's (one ``outputs`` object, not completions)."""
    return not isinstance(getattr(output, "outputs", None), list)


def completions(output: Any) -> list[Any]:
    """A generation output's completions; none for a pooling output."""
    return [] if is_pooled(output) else list(output.outputs)


def failed(output: Any) -> bool:
    """Whether any of an output's captures failed (:class:`FailedCapture`): the attributes of
    every registered output processor that reads a capture source (rows, scores, SAE
    features and any readout registered later), on the output and on each completion."""
    from probehook.outputs import OUTPUT_PROCESSORS  # the package imports this module

    captured = [p for p in OUTPUT_PROCESSORS if p.source]
    on_request = [a for p in captured for a in p.request_attributes]
    on_completion = [a for p in captured for a in p.completion_attributes]
    return any(isinstance(getattr(output, a, None), FailedCapture) for a in on_request) or any(
        isinstance(getattr(c, a, None), FailedCapture)
        for c in completions(output)
        for a in on_completion
    )
