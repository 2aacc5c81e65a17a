"""The per-request wire format, defined once: what a user may put under
``SamplingParams.extra_args["probehook"]`` (``PoolingParams.extra_kwargs`` for pooling), and
the resolved plan the front end writes there for the worker.

Two objects, two directions:

- :class:`RequestOptions`: the user's options. :meth:`RequestOptions.from_user` is the one
  parser every front end calls (offline ``LLM``, ``AsyncLLM``, the server's routes), so a bad
  value gets the same :class:`~probehook.errors.CaptureConfigError` wherever it was sent.
- :class:`RequestWire`: what the worker and the monitor processor read, already narrowed and
  checked by the front end (tag, fan-out, the capture config, probe names, monitors with their
  score columns). :meth:`RequestWire.from_wire` checks it again, because the worker must not
  trust a dict that may have skipped the front end: the worker fails such a request alone.

No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from probehook.capture_config import CaptureConfig, as_int
from probehook.core.monitors import (
    ProbeMonitor,
    TopKMonitor,
    steer_terms,
    top_k_monitor_class,
    top_k_monitor_of,
)
from probehook.errors import CaptureConfigError

EXTRA_ARGS_KEY = "probehook"
"""Key under ``SamplingParams.extra_args`` / ``PoolingParams.extra_kwargs``."""
SAMPLING_EXTRA = "extra_args"
POOLING_EXTRA = "extra_kwargs"
"""The free-form per-request dict of ``SamplingParams`` and of ``PoolingParams``."""
RECORD_KEY = "probehook_record"
"""Key beside it where probehook's own pooling server puts extra store-record fields of a
request (a one-pass input's user request and patch); never a user option."""

CAPTURE_KEYS = (
    "layers",
    "include_prefill",
    "include_decode",
    "last_prefill_token",
    "last_decode_token",
)
PROBE_KEYS = ("probes", "monitors")
STEER_KEYS = ("steer", "steer_phase")
PLAN_KEY = "plan"
"""A wire key the front end sets on every request tagged from one template: wires with the
same value differ only in their tag, so the worker reads one of them and reuses its plan."""
STEER_PHASES = ("both", "prefill", "decode")
USER_KEYS = CAPTURE_KEYS + PROBE_KEYS + STEER_KEYS
"""Every key a user may set; anything else is refused."""
FLAG_KEYS = CAPTURE_KEYS[1:]
Monitor = ProbeMonitor | TopKMonitor
"""A monitor of any kind: a probe's, or a top-k readout's (its class registered in
:data:`~probehook.core.monitors.TOP_K_MONITORS`)."""
MONITOR_FIELDS = ("probe", "threshold", "action", "direction", "label")
EXAMPLE = '{"layers": [3], "probes": ["truth"]}'


def show(value: Any) -> str:
    """A bad value for an error message: its repr, cut short, and its type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _bad(key: str, value: Any, valid: str) -> CaptureConfigError:
    return CaptureConfigError(f"probehook option {key}={show(value)} is not valid: {valid}.")


def is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


@dataclass(frozen=True)
class RequestOptions:
    """A user's per-request options; None everywhere means "the engine's default"."""

    layers: tuple[int, ...] | str | None = None
    """Layer indices (a subset of the engine's), or ``"all"``: the engine's layers."""
    include_prefill: bool | None = None
    include_decode: bool | None = None
    last_prefill_token: bool | None = None
    last_decode_token: bool | None = None
    probes: tuple[str, ...] | bool | None = None
    """None or True: all engine probes; False: none; names: those."""
    monitors: tuple[Monitor, ...] | None = None
    """None: the engine's monitors of the probes and readouts the request gets; a tuple
    replaces them."""
    steer: tuple[tuple[str, float], ...] | None = None
    """Steering vector names and scales, as sorted ``(name, scale)`` pairs."""
    steer_phase: str | None = None
    """``"both"`` (None), ``"prefill"`` or ``"decode"``."""
    writes: tuple[tuple[str, Any], ...] = ()
    """The write table's request options set (``clamp``, a registered intervention's):
    ``(option, value)`` as given, lists as tuples; checked by the intervention
    (``Intervention.check_terms``)."""
    readouts: tuple[tuple[str, tuple[str, ...] | bool], ...] = ()
    """Top-k readouts picked by their request options: ``(source, names or True/False)``."""
    readout_extras: tuple[tuple[str, str, Any], ...] = ()
    """The top-k readouts' further request options (a lens's ``lens_layers``): ``(source,
    option, value)``, lists as tuples; checked by the readout (``TopKReadout.pick``)."""

    @classmethod
    def from_user(
        cls,
        value: Any,
        readout_options: Mapping[str, str] | None = None,
        write_options: Collection[str] = (),
    ) -> RequestOptions:
        """Check the types of a user's options object (None: no options). Engine-dependent
        checks (which layers and probes exist, narrowing) come after, with the engine.
        ``readout_options``: the request options of each top-k readout the engine has
        (option -> source; a source's first option picks its instances, the others are its
        further options); ``write_options``: each registered intervention's; both accepted
        beside the built-in keys."""
        if value is None:
            return cls()
        if isinstance(value, RequestOptions):
            return value
        if not isinstance(value, Mapping):
            raise CaptureConfigError(
                f"probehook options must be a dict (a JSON object) such as {EXAMPLE}, not "
                f"{show(value)}; valid keys are {list(USER_KEYS)}."
            )
        extra = dict(readout_options or {})
        unknown = [k for k in value if k not in USER_KEYS and k not in extra
                   and k not in write_options]  # fmt: skip
        if unknown:
            raise CaptureConfigError(
                f"Unknown probehook option(s) {', '.join(sorted(map(repr, unknown)))}; valid "
                f"options are "
                f"{[*USER_KEYS, *extra, *write_options]}."
            )
        parsed: dict[str, Any] = {}
        picking = picking_options(extra)
        readouts = [
            (source, _user_names(option, value[option], "readout"))
            for option, source in extra.items()
            if picking[source] == option and value.get(option) is not None
        ]
        if readouts:
            parsed["readouts"] = tuple(readouts)
        further = [
            (source, option, _hashable(value[option]))
            for option, source in extra.items()
            # None only: 0 is a value (layer 0), though 0 == False
            if picking[source] != option and value.get(option) is not None
        ]
        if further:
            parsed["readout_extras"] = tuple(further)
        if "layers" in value:
            parsed["layers"] = _user_layers(value["layers"])
        for key in FLAG_KEYS:
            if key in value:
                if not isinstance(value[key], bool):
                    raise _bad(key, value[key], "pass True or False")
                parsed[key] = value[key]
        # None is their default, so it may be written out (layers=None is refused: it reads
        # as "no layers", which [] says).
        if value.get("probes") is not None:
            parsed["probes"] = _user_probes(value["probes"])
        if value.get("monitors") is not None:
            parsed["monitors"] = _user_monitors(value["monitors"])
        writes = [(o, _hashable(value[o])) for o in write_options if value.get(o) is not None]
        if writes:
            parsed["writes"] = tuple(writes)
        if value.get("steer") is not None:
            parsed["steer"] = steer_terms(value["steer"], "probehook option steer")
        if value.get("steer_phase") is not None:
            if value["steer_phase"] not in STEER_PHASES:
                raise _bad("steer_phase", value["steer_phase"], f"choose one of {STEER_PHASES}")
            if "steer" not in parsed:
                raise CaptureConfigError(
                    f"probehook option steer_phase={value['steer_phase']!r} needs steer "
                    '(such as {"steer": {"name": 4.0}, "steer_phase": "decode"}).'
                )
            parsed["steer_phase"] = value["steer_phase"]
        return cls(**parsed)

    def steered(self) -> bool:
        """Whether the request asks for steering (its own vectors, or a steer monitor)."""
        return bool(self.steer) or any(m.action == "steer" for m in self.monitors or ())

    def capture(self) -> dict[str, Any]:
        """The capture options set, as :meth:`CaptureConfig.narrow` takes them."""
        out: dict[str, Any] = {}
        for key in CAPTURE_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if key == "layers" and value != "all" else value
        return out

    def asked(self) -> list[str]:
        """The keys that ask for something (not None, False or empty)."""
        return [f.name for f in fields(self) if getattr(self, f.name) not in (None, False, ())]


def _hashable(value: Any) -> Any:
    """A JSON-like value with its lists (and arrays) as tuples and its dicts as
    :class:`FrozenDict`: options are hashed."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenDict({k: _hashable(v) for k, v in value.items()})
    return value


class FrozenDict(dict):
    """A dict of a request's options (``attention_spans``) that hashes, by its items in
    order: equal options memoise alike."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))


def _user_layers(value: Any) -> tuple[int, ...] | str:
    valid = "pass a list of layer indices (ints) from the engine's layers, [] for none, or 'all'"
    if hasattr(value, "tolist") and not isinstance(value, str):  # numpy arrays, tensors
        value = value.tolist()
    if isinstance(value, str) and value == "all" or (is_list(value) and list(value) == ["all"]):
        return "all"
    if not is_list(value):
        raise _bad("layers", value, valid)
    layers = []
    for item in value:
        layer = as_int(item)
        if layer is None:
            raise _bad("layers", value, f"layer {show(item)} is not an int; {valid}")
        layers.append(layer)
    return tuple(layers)


def _user_probes(value: Any) -> tuple[str, ...] | bool:
    return _user_names("probes", value, "probe")


def _user_names(key: str, value: Any, what: str) -> tuple[str, ...] | bool:
    valid = f"pass a list of {what} names, True for all or False for none"
    if isinstance(value, bool):
        return value
    if not is_list(value):
        raise _bad(key, value, valid)
    for item in value:
        if not isinstance(item, str) or not item:
            raise _bad(key, value, f"{show(item)} is not a {what} name; {valid}")
    return tuple(value)


def _user_monitors(value: Any) -> tuple[Monitor, ...]:
    if isinstance(value, Mapping | ProbeMonitor | TopKMonitor):
        value = [value]
    if not is_list(value):
        # the same words in every process, whatever readouts it has registered
        raise _bad(
            "monitors",
            value,
            "pass a list of monitors (probehook.ProbeMonitor / FeatureMonitor / LensMonitor, "
            "or a registered readout's) or their dicts: 'probe' (or the readout's field: "
            "'sae', 'lens', ...) and 'threshold'",
        )
    return tuple(user_monitor(i, item) for i, item in enumerate(value))


def user_monitor(i: int, item: Any) -> Monitor:
    """``monitors[i]`` of a request or an engine: a monitor or its dict form, checked; a dict
    is a top-k readout's monitor where it has that monitor's marker field (a lens monitor's
    ``lens``, a feature monitor's ``sae``), else a probe's."""
    where = f"probehook option monitors[{i}]"
    kind = top_k_monitor_of(item)
    if kind is not None:
        return kind.coerce(item, where)
    if isinstance(item, Mapping):
        missing = [f for f in ("probe", "threshold") if f not in item]
        if missing:
            raise CaptureConfigError(
                f"{where}={show(dict(item))} lacks {missing}; a monitor has fields "
                f"{list(MONITOR_FIELDS)} ('probe' and 'threshold' required)."
            )
    try:
        return ProbeMonitor.coerce(item)
    except CaptureConfigError as e:
        raise CaptureConfigError(f"{where}: {e}") from None


# -- what the worker receives -----------------------------------------------------------------


@dataclass(frozen=True)
class WireMonitor:
    """A monitor as the worker's stop processor reads it: the score column it watches."""

    monitor: ProbeMonitor
    column: int


class WireDict(dict):
    """A request's ``extra_args["probehook"]`` as the front end writes it. Nothing changes it
    after tagging, so a deep copy is the object itself: vLLM deep-copies a request's params
    (three times for a pooling request), which for a nested wire cost more than the rest of
    probehook's per-request work. ``described`` lets the front end that wrote it find what it
    already worked out for it; it does not travel (the worker receives a plain dict)."""

    __slots__ = ("described",)

    def __deepcopy__(self, memo: dict[int, Any]) -> WireDict:
        return self


class WireOnly(dict):
    """A request's extra args (``extra_args`` / ``extra_kwargs``) that hold nothing but
    probehook's wire: shared on deep copy like the wire itself, so vLLM's copies of the
    params do not copy the dict around it either. Extra args with other keys stay a plain
    dict (their values are the user's)."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> WireOnly:
        return self


def with_wire(extra: dict[str, Any], wire: WireDict) -> dict[str, Any]:
    """``extra`` with the wire under :data:`EXTRA_ARGS_KEY` (a :class:`WireOnly` when the
    wire is all it holds)."""
    extra[EXTRA_ARGS_KEY] = wire
    return WireOnly(extra) if len(extra) == 1 else extra


@dataclass(frozen=True)
class RequestWire:
    """The resolved plan of one captured request, as the front end writes it for the worker."""

    tag: str
    """probehook's id of the request (stream keys are ``"<tag>/<completion index>"``)."""
    config: CaptureConfig
    """The request's capture config, already narrowed from the engine's."""
    n: int = 1
    stream: bool = False
    """Rows are pushed as they are computed (``AsyncLLM``) instead of held for an export."""
    probes: tuple[str, ...] = ()
    monitors: tuple[WireMonitor, ...] = ()
    stop_token: int | None = None
    """The token a stop monitor forces (the model's EOS); set when a monitor stops."""
    record: Mapping[str, Any] | None = None
    """Extra fields of the request's store record."""
    steer: tuple[tuple[str, float], ...] = ()
    """Steering vector names and scales applied from the start of the phase."""
    steer_phase: str = "both"
    writes: Mapping[str, Mapping[str, Any]] | None = None
    """The write table's terms, ``{request option: {instance: terms}}`` (JSON, as the
    intervention's ``check_terms`` gave them)."""
    readouts: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """The top-k readouts the request gets: ``(source, instance names)``."""
    readout_top_k: tuple[tuple[str, int], ...] = ()
    """Entries the request keeps per token of a readout, where fewer than the engine's:
    ``(source, k)`` (the worker computes the engine's k; the front end cuts them)."""
    readout_monitors: tuple[tuple[TopKMonitor, int], ...] = ()
    """Monitors of the top-k rows the request reads (feature monitors, lens monitors), each
    with its instance's slot in the worker's bank of that source (where the stop processor
    finds the watched value)."""
    readout_terms: Mapping[str, Mapping[str, Any]] | None = None
    """What the request's further readout options ask of the rows, ``{source: terms}`` (JSON,
    as ``TopKReadout.request_terms`` gave them: attention's heads and spans)."""

    def to_wire(self) -> WireDict:
        wire = WireDict(
            {
                "tag": self.tag,
                "n": self.n,
                "stream": self.stream,
                **self.config.to_dict(),
                "probes": list(self.probes),
                "monitors": [{**m.monitor.to_dict(), "column": m.column} for m in self.monitors],
            }
        )
        if self.stop_token is not None:
            wire["stop_token"] = self.stop_token
        if self.record is not None:
            wire["record"] = dict(self.record)
        if self.steer:
            wire["steer"] = [[name, scale] for name, scale in self.steer]  # in order
            wire["steer_phase"] = self.steer_phase
        if self.writes:
            wire["writes"] = {o: dict(t) for o, t in self.writes.items()}
        if self.readouts:
            wire["readouts"] = {source: list(names) for source, names in self.readouts}
        if self.readout_top_k:
            wire["readout_top_k"] = dict(self.readout_top_k)
        if self.readout_monitors:
            wire["readout_monitors"] = [
                {"source": m.source, **m.to_dict(), "slot": slot}
                for m, slot in self.readout_monitors
            ]
        if self.readout_terms:
            wire["readout_terms"] = {s: dict(t) for s, t in self.readout_terms.items()}
        return wire

    def readout(self, source: str) -> tuple[str, ...]:
        """The instances of top-k readout ``source`` the request gets (none: ``()``)."""
        return next((names for s, names in self.readouts if s == source), ())

    @classmethod
    def from_wire(cls, value: Any) -> RequestWire | None:
        """The plan in a request's ``extra_args["probehook"]``; None for a request the front
        end did not tag (no ``tag``: nobody will collect it). :class:`CaptureConfigError`
        for a malformed one."""
        if not isinstance(value, Mapping) or "tag" not in value:
            return None
        known = {"tag", "n", "stream", "probes", "monitors", "stop_token", "record", PLAN_KEY}
        known.add("writes")
        known.add("readouts")
        known.add("readout_top_k")
        known.add("readout_monitors")
        known.add("readout_terms")
        known.update(STEER_KEYS)
        unknown = [k for k in value if k not in known and k not in CAPTURE_KEYS]
        if unknown:
            raise CaptureConfigError(f"unknown key(s) {', '.join(sorted(map(repr, unknown)))}")
        tag = value["tag"]
        if not isinstance(tag, str) or not tag:
            raise CaptureConfigError(f"tag={show(tag)} is not a non-empty string")
        if not isinstance(value.get(PLAN_KEY, ""), str):
            raise CaptureConfigError(f"plan={show(value[PLAN_KEY])} is not a string")
        n = as_int(value.get("n", 1))
        if n is None or n < 1:
            raise CaptureConfigError(f"n={show(value.get('n'))} is not a positive int")
        stream = value.get("stream", False)
        if not isinstance(stream, bool):
            raise CaptureConfigError(f"stream={show(stream)} is not a bool")
        layers = value.get("layers")
        if not is_list(layers) or any(as_int(x) is None or as_int(x) < 0 for x in layers):  # type: ignore[operator]
            raise CaptureConfigError(f"layers={show(layers)} is not a list of layer indices")
        flags = {}
        for key in FLAG_KEYS:
            if not isinstance(value.get(key), bool):
                raise CaptureConfigError(f"{key}={show(value.get(key))} is not a bool")
            flags[key] = value[key]
        config = CaptureConfig(layers=tuple(int(x) for x in layers), **flags)  # type: ignore[union-attr]
        probes = value.get("probes", [])
        if not is_list(probes) or not all(isinstance(p, str) for p in probes):
            raise CaptureConfigError(f"probes={show(probes)} is not a list of names")
        monitors = value.get("monitors", [])
        if not is_list(monitors):
            raise CaptureConfigError(f"monitors={show(monitors)} is not a list")
        wired = []
        for m in monitors:
            if not isinstance(m, Mapping):
                raise CaptureConfigError(f"monitor {show(m)} is not a dict")
            column = as_int(m.get("column"))
            if column is None or column < 0:
                raise CaptureConfigError(f"monitor column={show(m.get('column'))} is not valid")
            rest = {k: v for k, v in m.items() if k != "column"}
            # ProbeMonitor checks the threshold (monitors.monitor_threshold).
            wired.append(WireMonitor(ProbeMonitor.coerce(rest), column))
        stop_token = value.get("stop_token")
        if stop_token is not None and (as_int(stop_token) is None or stop_token < 0):
            raise CaptureConfigError(f"stop_token={show(stop_token)} is not a token id")
        record = value.get("record")
        if record is not None and not isinstance(record, Mapping):
            raise CaptureConfigError(f"record={show(record)} is not a dict")
        readouts = value.get("readouts", {})
        if not isinstance(readouts, Mapping) or not all(
            isinstance(source, str)
            and is_list(names)
            and all(isinstance(n, str) and n for n in names)
            for source, names in readouts.items()
        ):
            raise CaptureConfigError(f"readouts={show(readouts)} is not a dict of name lists")
        readout_top_k = value.get("readout_top_k", {})
        if not isinstance(readout_top_k, Mapping) or not all(
            isinstance(source, str) and not isinstance(k, bool) and as_int(k) is not None and k > 0
            for source, k in readout_top_k.items()
        ):
            raise CaptureConfigError(f"readout_top_k={show(readout_top_k)} is not a dict of ks")
        readout_monitors = []
        for m in value.get("readout_monitors", []):
            if not isinstance(m, Mapping):
                raise CaptureConfigError(f"readout monitor {show(m)} is not a dict")
            slot = as_int(m.get("slot"))
            kind = top_k_monitor_class(m.get("source"))
            if slot is None or slot < 0 or kind is None:
                raise CaptureConfigError(f"readout monitor {show(m)}: no slot or source")
            fields_ = {k: v for k, v in m.items() if k not in ("slot", "source")}
            try:
                readout_monitors.append((kind(**fields_), slot))
            except TypeError as e:
                raise CaptureConfigError(f"readout monitor {show(m)}: {e}") from None
        readout_terms = value.get("readout_terms")
        if readout_terms is not None and not (
            isinstance(readout_terms, Mapping)
            and all(isinstance(s, str) and isinstance(t, Mapping) for s, t in readout_terms.items())
        ):
            raise CaptureConfigError(f"readout_terms={show(readout_terms)} is not a dict of dicts")
        writes = value.get("writes")
        if writes is not None and not (
            isinstance(writes, Mapping)
            and all(isinstance(o, str) and isinstance(t, Mapping) for o, t in writes.items())
        ):
            raise CaptureConfigError(f"writes={show(writes)} is not a dict of dicts")
        steer = steer_terms(value["steer"], "steer") if "steer" in value else ()
        phase = value.get("steer_phase", "both")
        if phase not in STEER_PHASES:
            raise CaptureConfigError(f"steer_phase={show(phase)} is not one of {STEER_PHASES}")
        return cls(
            tag,
            config,
            n,
            stream,
            tuple(probes),
            tuple(wired),
            None if stop_token is None else int(stop_token),
            record,
            steer,
            phase,
            writes or None,
            tuple((source, tuple(names)) for source, names in readouts.items() if names),
            tuple(sorted((source, int(k)) for source, k in readout_top_k.items())),
            tuple(readout_monitors),
            readout_terms or None,
        )


def raw_tag(value: Any) -> str | None:
    """The tag of a wire object that :meth:`RequestWire.from_wire` refused, if it has a
    usable one (the worker then fails that request's capture under its stream keys)."""
    tag = value.get("tag") if isinstance(value, Mapping) else None
    return tag if isinstance(tag, str) and tag else None


def extra_field(params: Any) -> str:
    """Where ``params`` carry per-request options: ``"extra_args"`` (SamplingParams) or
    ``"extra_kwargs"`` (PoolingParams)."""
    return SAMPLING_EXTRA if hasattr(params, SAMPLING_EXTRA) else POOLING_EXTRA


def picking_options(readout_options: Mapping[str, str]) -> dict[str, str]:
    """Each top-k readout's picking option (its first: ``lenses``, before its further ones such
    as ``lens_layers``), by source, from the engine's ``{option: source}``."""
    picking: dict[str, str] = {}
    for option, source in readout_options.items():
        picking.setdefault(source, option)
    return picking
