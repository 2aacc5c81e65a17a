"""The front end's view of an engine's probes and monitors.

Validates them at construction (layer, hidden size, monitor names and thresholds), turns each
probe into the plain :class:`~probehook.core.probe_spec.ProbeSpec` the worker fuses, checks
the per-request ``probes``/``monitors`` options, and after a request finishes splits its score
rows into one tensor per probe, lists flag crossings and names the probe that stopped it.
No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from probehook.core.monitors import ProbeMonitor, crossings
from probehook.core.named import load_named, select_names
from probehook.core.probe_spec import ColumnRange, ProbeSpec, columns_of
from probehook.core.request_options import RequestOptions, WireMonitor
from probehook.errors import CaptureConfigError

ACTIVATION_OF_KIND = {"binary": "sigmoid", "multiclass": "softmax", "regression": "identity"}
PROBABILITY_KINDS = ("binary", "multiclass")


@dataclass(frozen=True)
class RequestProbes:
    """The probes and monitors one request gets (validated)."""

    names: tuple[str, ...]
    monitors: tuple[ProbeMonitor, ...]

    @property
    def stops(self) -> bool:
        return any(m.action == "stop" for m in self.monitors)


class ProbeSet:
    """An engine's probes (by name), their score columns, and its default monitors."""

    def __init__(
        self,
        probes: Mapping[str, Any],
        monitors: Sequence[Any],
        *,
        num_layers: int,
        hidden_size: int,
        model_fingerprint: str | None,
    ) -> None:
        self.probes = dict(probes)
        for name, probe in self.probes.items():
            if not 0 <= probe.layer < num_layers:
                raise CaptureConfigError(
                    f"Probe {name!r} reads layer {probe.layer}, but the model has {num_layers} "
                    f"layers (0..{num_layers - 1}). Use a probe trained on this model."
                )
            probe.check_model(hidden_size, model_fingerprint)
        self.specs = [_spec(name, probe) for name, probe in self.probes.items()]
        self.columns: dict[str, ColumnRange] = columns_of(self.specs)
        self.layers = tuple(sorted({p.layer for p in self.probes.values()}))
        self.monitors = tuple(self.check_monitor(m) for m in monitors)

    def check_monitor(self, value: Any) -> ProbeMonitor:
        monitor = ProbeMonitor.coerce(value)
        probe = self.probes.get(monitor.probe)
        if probe is None:
            raise CaptureConfigError(
                f"Monitor names probe {monitor.probe!r}, which this engine does not have; its "
                f"probes are {sorted(self.probes)}."
            )
        if probe.kind in PROBABILITY_KINDS and not 0.0 <= monitor.threshold <= 1.0:
            raise CaptureConfigError(
                f"Monitor threshold {monitor.threshold} is outside [0, 1], but probe "
                f"{monitor.probe!r} ({probe.kind}) scores probabilities: it would never fire."
            )
        if probe.kind == "multiclass":
            if monitor.label not in (probe.label_names or []):
                raise CaptureConfigError(
                    f"Monitor on multi-class probe {monitor.probe!r} needs label= naming one of "
                    f"its classes {probe.label_names}; got {monitor.label!r}."
                )
        elif monitor.label is not None:
            raise CaptureConfigError(
                f"Monitor label={monitor.label!r} only applies to multi-class probes; "
                f"{monitor.probe!r} is {probe.kind}."
            )
        return monitor

    def column(self, monitor: ProbeMonitor) -> int:
        """The score column a monitor watches."""
        cols = self.columns[monitor.probe]
        if monitor.label is None:
            return cols.lo
        return cols.lo + list(self.probes[monitor.probe].label_names).index(monitor.label)

    def for_request(self, options: RequestOptions | Mapping[str, Any]) -> RequestProbes:
        """Validate a request's ``probes`` (None: all; False or []: none; a list of names)
        and ``monitors`` (None: the engine's, for the probes it gets; a list replaces them)
        against this engine's probes; types were checked by :meth:`RequestOptions.from_user`."""
        options = RequestOptions.from_user(options)
        names = select_names(
            options.probes, list(self.probes), "probes", "probe", CaptureConfigError
        )
        if options.monitors is None:
            monitors = tuple(m for m in self.monitors if m.probe in names)
        else:
            monitors = tuple(
                self.check_monitor(m) for m in options.monitors if isinstance(m, ProbeMonitor)
            )
            missing = sorted({m.probe for m in monitors} - set(names))
            if missing:
                raise CaptureConfigError(
                    f"This request's monitors watch probe(s) {missing}, which the request "
                    f"switched off (probes={list(names)}); add them to its probes."
                )
        return RequestProbes(names, monitors)

    def wire_monitors(self, request: RequestProbes) -> tuple[WireMonitor, ...]:
        """The monitors as the worker's stop processor reads them: with their score column."""
        return tuple(WireMonitor(m, self.column(m)) for m in request.monitors)

    def split(self, scores: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """``[rows, width]`` score rows -> one tensor per probe: ``[rows]`` (binary,
        regression) or ``[rows, n_classes]`` (multi-class)."""
        out = {}
        for name in names:
            cols = self.columns[name]
            part = scores[:, cols.lo : cols.hi]
            out[name] = part[:, 0].clone() if cols.hi - cols.lo == 1 else part.clone()
        return out

    def flags_and_stop(
        self,
        request: RequestProbes,
        decode_scores: Mapping[str, torch.Tensor],
        stopped_by_token: bool,
    ) -> tuple[dict[str, list[int]], str | None]:
        """Decode rows where each flagged probe crosses, and ``"probe:<name>"`` when the
        request ended on the stop token a stop monitor forces and its last row crosses."""
        flags: dict[str, list[int]] = {}
        stop_reason = None
        for monitor in request.monitors:
            scores = decode_scores.get(monitor.probe)
            if scores is None or len(scores) == 0:
                continue
            values = self._watched(monitor, scores).numpy()
            if monitor.action == "flag":
                found = crossings(values, monitor.threshold, monitor.direction)
                flags[monitor.probe] = sorted(set(flags.get(monitor.probe, [])) | set(found))
            elif (
                monitor.action == "stop"
                and stopped_by_token
                and stop_reason is None
                and crossings(values[-1:], monitor.threshold, monitor.direction)
            ):
                stop_reason = monitor.stop_reason
        return flags, stop_reason

    def first_crossing(self, monitor: ProbeMonitor, scores: torch.Tensor) -> int | None:
        """The first decode row whose score crosses (None: none does)."""
        if len(scores) == 0:
            return None
        values = self._watched(monitor, scores).numpy()
        found = crossings(values, monitor.threshold, monitor.direction)
        return found[0] if found else None

    def _watched(self, monitor: ProbeMonitor, scores: torch.Tensor) -> torch.Tensor:
        if monitor.label is None:
            return scores
        return scores[:, list(self.probes[monitor.probe].label_names).index(monitor.label)]


def load_probes(probes: Any) -> dict[str, Any]:
    """``probes=`` as given to an engine: a dict name -> probe (or path to a saved probe), or
    a list of probes named by their ``name``."""
    from probehook.probes import LinearProbe

    return load_named(probes, "probes", LinearProbe, LinearProbe.load, "probe")


def _spec(name: str, probe: Any) -> ProbeSpec:
    weight, bias = probe.linear()
    return ProbeSpec(
        name,
        int(probe.layer),
        weight.detach().float().cpu().numpy(),
        bias.detach().float().cpu().numpy(),
        ACTIVATION_OF_KIND[probe.kind],
    )
