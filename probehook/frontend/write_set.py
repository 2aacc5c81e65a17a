"""One write-table entry of an engine, as the front end checks requests against it: the
intervention and its instances (checked at construction, installed in the workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probehook.outputs.intervention import Intervention


@dataclass(frozen=True)
class WriteSet:
    entry: Intervention
    instances: dict[str, dict[str, Any]]
    """``{instance: settings}``, each with its ``"layer"`` and ``"site"``."""

    def check(self, value: Any) -> dict[str, Any]:
        """A request's value of the entry's option as ``{instance: terms}`` (JSON)."""
        return self.entry.check_terms(value, self.instances)
