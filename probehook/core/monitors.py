"""Acting on probe scores: :class:`ProbeMonitor` stops, flags or steers generation when a
probe's score crosses a threshold.

A monitor is checked against the score of each decode row, i.e. the state that produces the
next token. ``stop`` and ``steer`` are carried out in the worker (``stop``: the processor in
``probehook.adapter.worker.monitor_processor`` forces the request's stop token in the same step;
``steer``: the worker's steering starts at the next position); ``flag`` is computed in the
front end from the returned scores. All use :func:`crossings` on the same float32 scores, so
the front end can name the probe that stopped a request, and where steering started, without
another message from the worker.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from probehook.errors import CaptureConfigError

ACTIONS = ("stop", "flag", "steer")
DIRECTIONS = ("above", "below")
STOP_REASON_PREFIX = "probe:"
FEATURE_STOP_PREFIX = "feature:"
FEATURE_ACTIONS = ("stop", "flag")


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
            generation goes on; ``"steer"`` adds the vectors of ``steer`` from the position
            after the first crossing row to the end (``CompletionOutput.steering["start"]``
            says where it started).
        direction: ``"above"`` (score > threshold) or ``"below"`` (score < threshold).
        label: for a multi-class probe, the class whose probability is watched.
        steer: for ``action="steer"``: engine steering vector names and their scales,
            ``{"name": scale}``.
    """

    probe: str
    threshold: float
    action: str = "flag"
    direction: str = "above"
    label: str | None = None
    steer: Any = None
    """``action="steer"``: ``{name: scale}`` (kept as sorted ``(name, scale)`` pairs)."""

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
        object.__setattr__(
            self, "threshold", monitor_threshold(self.threshold, f"ProbeMonitor({self.probe!r})")
        )
        if self.action == "steer":
            object.__setattr__(self, "steer", steer_terms(self.steer, "ProbeMonitor steer"))
        elif self.steer is not None:
            raise CaptureConfigError(
                f"ProbeMonitor steer={self.steer!r} is only used with action='steer' (this "
                f"monitor's action is {self.action!r})."
            )

    @property
    def stop_reason(self) -> str:
        return STOP_REASON_PREFIX + self.probe

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.steer is None:
            del out["steer"]  # the dict form of stop and flag monitors stays as it was
        else:
            out["steer"] = dict(self.steer)
        return out

    @classmethod
    def coerce(cls, value: Any) -> ProbeMonitor:
        """A monitor from a ProbeMonitor or its dict form (as a JSON request body has it)."""
        if isinstance(value, ProbeMonitor):
            return value
        if isinstance(value, Mapping):
            known = {"probe", "threshold", "action", "direction", "label", "steer"}
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


class TopKMonitor:
    """Base of the monitors of a top-k readout's rows (SAE features, a lens's tokens, a
    third party's readout): each watches one entry of one readout instance and stops or flags
    generation where its value crosses a threshold. A subclass is a frozen dataclass with
    ``threshold``, ``action`` and ``direction`` fields among its own; it declares the readout it
    watches (``source``), its value where the entry is outside the engine's top k
    (``outside``), the field that marks its dict form (``marker``: a lens monitor's ``lens``), and
    defines ``instance``, ``entry`` and ``key``. Registered with :func:`top_k_monitor`, it is
    parsed from requests, sent to the worker and read back there by that registration alone.
    """

    source: ClassVar[str]
    """The top-k readout it watches (a readout's ``source``)."""
    outside: ClassVar[float] = 0.0
    """Its value where the entry is not among the engine's top k."""
    marker: ClassVar[str]
    """The field whose presence marks its dict form in a request's ``monitors``."""
    required: ClassVar[tuple[str, ...]]
    """The fields its dict form must have."""
    watches: ClassVar[str]
    """What it watches, for messages (``"lenses"``)."""
    stop_prefix: ClassVar[str]
    """Its stop reason's prefix (``"lens:"``): the stop reason is the prefix and its key."""
    threshold: float
    action: str
    direction: str

    def _check_action(self, what: str) -> None:
        """The checks every top-k monitor shares: action, direction, a finite threshold."""
        name = type(self).__name__
        if self.action not in FEATURE_ACTIONS:
            raise CaptureConfigError(
                f"{name} action={self.action!r} is not valid; choose one of {FEATURE_ACTIONS}."
            )
        if self.direction not in DIRECTIONS:
            raise CaptureConfigError(
                f"{name} direction={self.direction!r} is not valid; choose one of {DIRECTIONS}."
            )
        object.__setattr__(self, "threshold", monitor_threshold(self.threshold, what))

    @property
    def instance(self) -> str:
        """The readout instance it watches."""
        raise NotImplementedError

    @property
    def entry(self) -> int:
        """The entry of the instance's top-k rows it watches."""
        raise NotImplementedError

    @property
    def key(self) -> str:
        """Its name in its readout's flags attribute."""
        raise NotImplementedError

    @property
    def stop_reason(self) -> str:
        return self.stop_prefix + self.key

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def coerce(cls, item: Any, where: str) -> TopKMonitor:
        """A monitor from an instance or its dict form, checked (``where``: its place in
        messages, ``"probehook option monitors[0]"``)."""
        if isinstance(item, cls):
            return item
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(map(str, set(item) - set(names)))
        missing = [f for f in cls.required if f not in item]
        if unknown or missing:
            raise CaptureConfigError(
                f"{where}={_short(dict(item))}: a {cls.__name__} has fields {names} "
                f"({', '.join(map(repr, cls.required))} required)."
            )
        try:
            return cls(**item)
        except (CaptureConfigError, TypeError) as e:
            raise CaptureConfigError(f"{where}: {e}") from None


TOP_K_MONITORS: dict[str, type[TopKMonitor]] = {}
"""Every registered top-k monitor class, by the source of the readout it watches."""


def top_k_monitor(cls: type[TopKMonitor]) -> type[TopKMonitor]:
    """Register a top-k monitor class (a class decorator): requests' monitors of its dict form
    are parsed to it, and the worker reads it back from the wire. One class a source."""
    known = TOP_K_MONITORS.get(cls.source)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise CaptureConfigError(
            f"{cls.__name__} watches readout {cls.source!r}, which {known.__name__} watches "
            "already: one monitor class a readout."
        )
    clash = [
        k for k in TOP_K_MONITORS.values() if k.marker == cls.marker and k.source != cls.source
    ]
    if clash:
        raise CaptureConfigError(
            f"{cls.__name__}'s dict form is marked by {cls.marker!r}, as {clash[0].__name__}'s "
            "is: pick another marker field."
        )
    TOP_K_MONITORS[cls.source] = cls  # a module imported again replaces its class
    return cls


_LOADERS: list[Callable[[], Any]] = []


def load_top_k_monitors_with(loader: Callable[[], Any]) -> None:
    """Have ``loader`` run before the registry is looked up: it registers the monitors of the
    readouts registered later (the output-processor registry's entry points: a readout
    registered through one registers its monitor)."""
    _LOADERS.append(loader)


def _loaded() -> dict[str, type[TopKMonitor]]:
    for loader in _LOADERS:
        loader()
    return TOP_K_MONITORS


def top_k_monitor_class(source: Any) -> type[TopKMonitor] | None:
    """The registered monitor class of the top-k readout ``source`` (None: none)."""
    return _loaded().get(source) if isinstance(source, str) else None


def top_k_monitor_of(item: Any) -> type[TopKMonitor] | None:
    """The registered top-k monitor class of a monitor or of its dict form (None: neither,
    a probe monitor's)."""
    if isinstance(item, TopKMonitor):
        return type(item)
    if isinstance(item, Mapping):
        _loaded()
        return next((k for k in TOP_K_MONITORS.values() if k.marker in item), None)
    return None


def _short(value: Any) -> str:
    return reprlib.repr(value)


def top_k_value(
    packed: np.ndarray, entry: int, outside: float, entries: int | None = None
) -> float:
    """The value of ``entry`` in one packed top-k row (``entries`` ids as int32 bits, as many
    values, then the scalar and any further columns; None: the three-column ``[2k + 1]``),
    ``outside`` where it is not among them: what the worker's stop processor reads. With lead
    axes (a top-k per head), the largest of its values among them."""
    n = (len(packed) - 1) // 2 if entries is None else entries
    ids = np.ascontiguousarray(packed[:n], dtype=np.float32).view(np.int32)  # int32 bits
    hit = np.flatnonzero(ids == entry)
    return float(packed[n + hit].max()) if len(hit) else outside


def crosses(values: np.ndarray, threshold: float, direction: str) -> np.ndarray:
    """Which scores cross the threshold (strictly)."""
    return values > threshold if direction == "above" else values < threshold


def crossings(values: np.ndarray, threshold: float, direction: str) -> list[int]:
    """Indices of the scores that cross the threshold."""
    return np.flatnonzero(crosses(np.asarray(values), threshold, direction)).tolist()


def steer_terms(value: Any, what: str) -> tuple[tuple[str, float], ...]:
    """``{name: scale}`` checked: vector names and finite numbers, at least one; returned as
    ``(name, scale)`` pairs in the order given (hashable; the order is the order the ops
    apply in, which matters for every op but ``add``)."""
    example = '{"name": 4.0}'
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        with contextlib.suppress(TypeError, ValueError):
            value = dict(value)  # the pair form this function returns
    if not isinstance(value, Mapping) or not value:
        raise CaptureConfigError(
            f"{what}={value!r} is not valid: pass a non-empty dict of steering vector names "
            f"and scales, such as {example}."
        )
    terms = []
    for name, scale in value.items():
        if not isinstance(name, str) or not name:
            raise CaptureConfigError(
                f"{what}: {name!r} is not a steering vector name; pass {{name: scale}} such as "
                f"{example}."
            )
        scale = finite_number(
            scale, f"{what}: the scale of {name!r}", f"pass {{name: scale}} such as {example}"
        )
        terms.append((name, scale))
    return tuple(terms)


def monitor_threshold(value: Any, monitor: str) -> float:
    """A monitor's ``threshold`` checked by :func:`finite_number` (the one check every
    threshold gets: numbers of any type, numpy's too, as a finite float; an int too large
    for a float, NaN, infinities, bools and non-numbers are a :class:`CaptureConfigError`
    naming the monitor, the field and the value)."""
    return finite_number(
        value, f"{monitor} threshold", "pass the score to cross, such as threshold=0.5"
    )


def finite_number(value: Any, what: str, hint: str) -> float:
    """``value`` (a real number, not a bool) as a finite float; else a
    :class:`CaptureConfigError` that says what it is and, after it, ``hint``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise CaptureConfigError(f"{what} is {reprlib.repr(value)}, not a number; {hint}.")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise CaptureConfigError(
            f"{what} is {reprlib.repr(value)}; it must be a finite number ({hint})."
        )
    return number
