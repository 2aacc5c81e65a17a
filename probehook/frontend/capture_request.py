"""What a user asks a front end to capture (the capture keyword arguments of ``LLM`` and
``AsyncLLM``), declared once and checked at once: :class:`CaptureRequest`. Everything here
runs before vLLM is asked anything; engine preparation (``adapter/frontend/setup.py``) takes
it from there. No vLLM.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from probehook.capture_config import LayerSpec
from probehook.core.monitors import TopKMonitor, top_k_monitor_of
from probehook.core.named import load_named
from probehook.core.request_options import user_monitor
from probehook.core.steering_wire import DEFAULT_CAPACITY
from probehook.errors import CaptureConfigError
from probehook.frontend.probe_set import load_probes
from probehook.frontend.steering_set import check_capacity
from probehook.outputs import OUTPUT_PROCESSORS, registered_readouts
from probehook.outputs.intervention import interventions
from probehook.store.features import check_values


@dataclass
class CaptureRequest:
    """What the user asked a front end to capture (the keyword arguments of ``LLM``)."""

    layers: LayerSpec | None = None
    include_prefill: bool | None = None
    """None: True for a capture-only engine, False otherwise."""
    include_decode: bool | None = None
    """None: False for a capture-only engine, True otherwise."""
    last_prefill_token: bool = False
    last_decode_token: bool = False
    store: str | os.PathLike[str] | None = None
    store_options: dict[str, Any] | None = None
    max_request_capture_bytes: int | None = None
    probes: Any = None
    monitors: Sequence[Any] | None = None
    steering: Any = None
    steering_layers: LayerSpec | None = None
    steering_capacity: int | None = None
    """None: :data:`DEFAULT_CAPACITY` where the engine steers (set without steering: refused)."""
    capture_only: bool = False
    """One forward pass per prompt, prompt rows only, stopping after the deepest tapped layer."""
    readouts: dict[str, Any] | None = None
    """Top-k readouts by source: ``{source: {name: spec}}`` (each registered readout's
    engine option, e.g. ``norms={...}``, lands here)."""
    readout_top_k: dict[str, int] | None = None
    """Entries kept per token, by source (each readout's ``<option>_top_k``)."""
    readout_extras: dict[str, dict[str, Any]] | None = None
    """Each readout's further engine options, by source (a lens's ``lens_layers``)."""
    writes: dict[str, Any] | None = None
    """The write table's entries, by request option: each registered intervention's engine
    option as given (``sae_clamping=True`` lands here as ``{"clamp": True}``)."""

    def __post_init__(self) -> None:
        # Checked at once, so that a plain engine is built without probehook's runner choice.
        if self.capture_only:
            _check_capture_only(self)
        # What only configures capture or steering: refused below where nothing is captured
        # or steered (the front end would be plain vLLM and drop it without a word).
        configuring = {
            name: getattr(self, name)
            for name in CONFIGURING_ARGUMENTS
            if getattr(self, name) is not None
        }
        if self.include_prefill is None:
            self.include_prefill = self.capture_only
        if self.include_decode is None:
            self.include_decode = not self.capture_only
        if self.probes is not None:
            self.probes = load_probes(self.probes) or None  # bad paths fail before start-up
        registered = registered_readouts()
        if self.readouts:  # checked as given (an SAE folder's config read), before start-up
            self.readouts = {
                source: registered[source].named_specs(specs) if source in registered else specs
                for source, specs in self.readouts.items()
            }
        if "sae_values" in (self.store_options or {}):
            check_values(self.store_options["sae_values"])  # type: ignore[index]
        self.steering = load_steering(self.steering)
        self.steering_capacity = check_capacity(
            DEFAULT_CAPACITY if self.steering_capacity is None else self.steering_capacity
        )
        if len(self.steering) > self.steering_capacity:
            raise CaptureConfigError(
                f"steering= has {len(self.steering)} vectors, more than steering_capacity="
                f"{self.steering_capacity}; raise steering_capacity."
            )
        if self.monitors is not None:  # a top-k monitor's dict form, as in a request
            self.monitors = [
                user_monitor(i, m) if top_k_monitor_of(m) is not None else m
                for i, m in enumerate(self.monitors)
            ]
        kinds = {type(m) for m in self.monitors or ()}
        if any(not issubclass(k, TopKMonitor) for k in kinds) and self.probes is None:
            raise CaptureConfigError(
                "monitors= watch probes, but no probes were given; pass probes={...}."
            )
        read = set(self.readouts or {})
        for kind in sorted((k for k in kinds if issubclass(k, TopKMonitor)), key=str):
            if kind.source not in read:
                raise CaptureConfigError(
                    f"monitors= has {kind.__name__}s, which watch {kind.watches}, but no "
                    f"{kind.watches} were given; pass {_engine_option(kind.source)}."
                )
        if self.layers is None and self.probes is None and not self.readouts:
            if self.store is not None:
                raise CaptureConfigError(
                    f"store={os.fspath(self.store)!r} needs something to store: pass "
                    f"layers=[...], probes={{...}} or {_readout_options()}."
                )
            if self.include_prefill or self.last_prefill_token or self.last_decode_token:
                raise CaptureConfigError(
                    "Capture options were given but layers=None captures nothing; pass "
                    "layers=[...] or layers='all'."
                )
        if configuring and not self.captures:
            given = ", ".join(f"{name}={value!r}" for name, value in configuring.items())
            raise CaptureConfigError(
                f"{given} configure{'s' if len(configuring) == 1 else ''} capture or steering, "
                "but this engine captures and steers nothing; pass layers=[...], probes={...}, "
                f"{_readout_options()} or steering={{...}} too, or drop "
                f"{'it' if len(configuring) == 1 else 'them'}."
            )

    def worker_bytes(self) -> int:
        """What the engine's readouts will hold in each worker (SAEs: their encoders)."""
        registered = registered_readouts()
        return sum(
            registered[source].worker_bytes(specs)
            for source, specs in (self.readouts or {}).items()
            if source in registered
        )

    @property
    def steers(self) -> bool:
        return bool(self.steering) or bool(self.steering_layers)

    @property
    def captures(self) -> bool:
        """False: the front end is plain vLLM."""
        return (
            self.layers is not None
            or self.probes is not None
            or bool(self.readouts)
            or self.steers
            or bool(self.writes)
        )


def _engine_option(source: str) -> str:
    """The engine option that gives readout ``source`` its instances, for messages."""
    readout = registered_readouts().get(source)
    if readout is None:
        return f"readouts={{{source!r}: {{...}}}}"
    extras = "".join(f" and {o}=[...]" for o in readout.extra_engine_options[:1])
    return f"{readout.engine_option}={{...}}{extras}"


def _readout_options() -> str:
    """The registered top-k readouts' engine options, for messages (``lenses={...}``)."""
    options = [f"{r.engine_option}={{...}}" for r in registered_readouts().values()]
    return " or ".join(options) if options else "readouts={...}"


CONFIGURING_ARGUMENTS = (
    "include_decode",
    "store_options",
    "max_request_capture_bytes",
    "steering_capacity",
)
"""Capture arguments that only configure what others ask for (None: not given)."""

CAPTURE_ARGUMENTS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CaptureRequest))
"""The capture keyword arguments every front end takes (``LLM``, ``AsyncLLM``): the fields
of :class:`CaptureRequest`, declared there once."""


def take_capture_arguments(kwargs: dict[str, Any]) -> CaptureRequest:
    """The capture arguments out of a front end's keyword arguments, checked; what is left in
    ``kwargs`` goes to vLLM."""
    given = {name: kwargs.pop(name) for name in CAPTURE_ARGUMENTS if name in kwargs}
    readouts = dict(given.pop("readouts", None) or {})
    top_k = dict(given.pop("readout_top_k", None) or {})
    extras = {s: dict(e) for s, e in (given.pop("readout_extras", None) or {}).items()}
    writes = dict(given.pop("writes", None) or {})
    for option, entry in interventions(OUTPUT_PROCESSORS).items():
        value = kwargs.pop(entry.engine_option, None)
        if value is not None and value is not False:  # False: the entry is not installed
            writes[option] = value
    registered = registered_readouts()
    for source, readout in registered.items():
        if readout.engine_option in kwargs:  # a registered readout's own keyword
            readouts[source] = kwargs.pop(readout.engine_option)
        if readout.k_option in kwargs:
            top_k[source] = kwargs.pop(readout.k_option)
        for option in readout.extra_engine_options:
            if option in kwargs:
                extras.setdefault(source, {})[option] = kwargs.pop(option)
    unused = {source: list(options) for source, options in extras.items()}
    for source in top_k:  # a k for a readout the engine does not read would go unused too
        k_option = registered[source].k_option if source in registered else "readout_top_k"
        unused.setdefault(source, []).append(k_option)
    for source, options in unused.items():
        if source not in readouts:
            given = ", ".join(f"{o}={extras.get(source, {}).get(o, top_k.get(source))!r}"
                              for o in options)  # fmt: skip
            owner = registered.get(source)
            what = f"the {owner.name} readout" if owner is not None else f"readout {source!r}"
            fix = f"{owner.engine_option}={{...}}" if owner is not None else "its instances"
            raise CaptureConfigError(
                f"{given} configure{'s' if len(options) == 1 else ''} {what}, which the engine "
                f"does not read; pass {fix} too (or drop {'it' if len(options) == 1 else 'them'})."
            )
    return CaptureRequest(
        **given, readouts=readouts or None, readout_top_k=top_k or None,
        readout_extras=extras or None, writes=writes or None,
    )  # fmt: skip


def front_end_signature(
    leading: Sequence[inspect.Parameter], refused: Sequence[str] = ()
) -> inspect.Signature:
    """A front end's ``__init__`` signature: ``leading`` (self, model, ...), every capture
    argument as a keyword with its default (but ``refused``), then vLLM's ``**kwargs``; what
    ``help()`` and editors show of the one declaration."""
    fields = {f.name: f for f in dataclasses.fields(CaptureRequest)}
    capture = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=fields[name].default,
                          annotation=fields[name].type)
        for name in CAPTURE_ARGUMENTS
        if name not in refused
    ]  # fmt: skip
    # Each registered top-k readout's engine options (lenses=..., SAEs') and each registered
    # intervention's (sae_clamping=...), taken by name.
    entries = interventions(OUTPUT_PROCESSORS).values()
    for readout in [*registered_readouts().values(), *entries]:
        for name in readout.engine_options:
            if name not in refused:
                capture.append(
                    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
                )
    rest = inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation="Any")
    return inspect.Signature([*leading, *capture, rest])


def _check_capture_only(request: CaptureRequest) -> None:
    """``capture_only=True`` reads prompts in one pass: refuse what needs generated tokens."""
    if request.layers is None and request.probes is None and not request.readouts:
        raise CaptureConfigError(
            "capture_only=True needs something to capture: pass layers=[...], probes={...} "
            f"or {_readout_options()}."
        )
    refused = [
        (request.include_decode is True, "include_decode=True"),
        (request.last_decode_token, "last_decode_token=True"),
        (request.include_prefill is False, "include_prefill=False"),
        (bool(request.monitors), "monitors="),
        (request.steers, "steering= / steering_layers="),
        (bool(request.writes), " and ".join(f"{o!r} interventions" for o in request.writes or ())),
    ]
    for bad, name in refused:
        if bad:
            raise CaptureConfigError(
                f"capture_only=True with {name}: a capture-only engine reads each prompt in "
                "one forward pass and generates nothing, so it keeps prompt rows (and prompt "
                f"probe scores) only. Drop {name}, or build an engine without capture_only to "
                "generate."
            )


def load_steering(steering: Any) -> dict[str, Any]:
    """``steering=`` as given to an engine: a dict name -> vector (or path to a saved one), or
    a list of vectors named by their ``name``."""
    from probehook.steering import SteeringVector

    if steering is None:
        return {}
    return load_named(steering, "steering", SteeringVector, SteeringVector.load, "steering vector")
