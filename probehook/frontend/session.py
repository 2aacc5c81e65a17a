"""The front-end side of capture, shared by every front end (offline ``LLM``, and later
``AsyncLLM`` and the server): tag requests, map ids, export rows, discard, hand finished
requests to the store.

A front end owns one :class:`CaptureSession` and calls it at four points of its request path:
:meth:`~CaptureSession.tag` before a request enters the engine, :meth:`~CaptureSession.register`
once the engine has accepted it, :meth:`~CaptureSession.fill` with finished outputs (offline;
a stream fills through :class:`~probehook.frontend.request_stream.RequestStream`, with the
same algorithm, :mod:`probehook.frontend.fill`), and :meth:`~CaptureSession.abandon` when
requests will never be collected. vLLM itself is reached only through the callables it is
given (worker RPC and engine abort), so this module has no vLLM imports.

Ids (one word each, used across probehook):

- *request id*: vLLM's id of a user request, ``RequestOutput.request_id``.
- *engine id*: vLLM's internal id of the same request (the request id plus a random suffix);
  the engine's abort takes these.
- *tag*: probehook's id of a user request, unique in the process; it travels to the worker in
  ``SamplingParams.extra_args["probehook"]["tag"]``.
- *stream key*: ``"<tag>/<completion index>"``, one per completion: the worker keeps rows
  under it.

A :class:`TrackedRequest` is what the front end remembers of one captured request (its tag,
engine id, capture config, probes, steering, store record fields) until its output is filled.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from probehook.capture_config import CaptureConfig
from probehook.core.export_wire import ExportReply, SpanReport, StreamAsk, stream_id
from probehook.core.monitors import ProbeMonitor, TopKMonitor
from probehook.core.request_options import (
    EXTRA_ARGS_KEY,
    PLAN_KEY,
    POOLING_EXTRA,
    RECORD_KEY,
    RequestOptions,
    RequestWire,
    WireDict,
    WireMonitor,
    extra_field,
    with_wire,
)
from probehook.errors import CaptureConfigError, CaptureError
from probehook.frontend.fill import (
    FailedCapture,
    Need,
    OutputPlan,
    PooledFill,
    apply,
    is_pooled,
    plan,
    reset,
    source_attributes,
)
from probehook.frontend.probe_set import ProbeSet, RequestProbes
from probehook.frontend.readout_set import ReadoutSet, RequestReadout, without_unread
from probehook.frontend.sources import engine_sources
from probehook.frontend.steering_set import RequestSteer, SteeringSet
from probehook.frontend.tracked_request import TrackedRequest
from probehook.frontend.transport_reader import Spool, read_tensors
from probehook.frontend.write_set import WriteSet
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.intervention import interventions
from probehook.store.records import store_filled

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
)

POOLING_FIELDS = ("task", "dimensions", "use_activation")
"""What the store records of a pooling request's PoolingParams."""

Rpc = Callable[[str, tuple], list]


@dataclass(frozen=True)
class _TagTemplate:
    """What :meth:`CaptureSession.tag` worked out for a request without options."""

    config: CaptureConfig | None
    wire: WireDict | None
    """Its ``extra_args["probehook"]`` (None: nothing is written, nothing is captured)."""
    described: TrackedRequest | None
    """:meth:`CaptureSession.describe` of it."""
    stops: bool
    """A stop monitor applies: the model's EOS joins the request's stop tokens."""


class CaptureSession:
    """Per-front-end capture state: tags, id mapping, export, fill and discard."""

    def __init__(
        self,
        config: CaptureConfig,
        rpc: Rpc,
        abort: Callable[[list[str]], None],
        decorate: Callable[[Any], None] = lambda output: None,
        probes: ProbeSet | None = None,
        stop_token: int | None = None,
        steering: SteeringSet | None = None,
        readouts: Mapping[str, ReadoutSet] | None = None,
        writes: Mapping[str, WriteSet] | None = None,
    ) -> None:
        """
        Args:
            config: the engine's capture config (``layers`` may be empty with probes).
            rpc: calls a worker method on every worker; returns their replies.
            abort: aborts engine requests, given their engine ids.
            decorate: gives a finished output probehook's output class (aliases, docs).
            probes: the engine's probes and monitors, if any.
            stop_token: the token a stop monitor forces (the model's EOS).
            steering: the engine's steering vectors, if it steers.
            readouts: the engine's top-k readouts (SAE features, lenses, ...), by source.
            writes: the engine's write-table entries (SAE clamps, ...), by request option.
        """
        self.config = config
        self.probes = probes
        self.readouts = dict(readouts or {})
        self.writes = dict(writes or {})
        self.write_options = tuple(interventions(OUTPUT_PROCESSORS))
        """Every registered intervention's request option (accepted in a request; one the
        engine did not install is refused by name, with the engine option that installs it)."""
        self.readout_options = {
            option: source for source, r in self.readouts.items() for option in r.request_options
        }
        """Each top-k readout's request options -> its source (accepted in a request): its
        picking option first, then its further ones."""
        self.sources = engine_sources(probes, self.readouts)
        """What the engine records, by source name (:mod:`probehook.frontend.sources`)."""
        self.steering = steering
        self.stop_token = stop_token
        self._rpc = rpc
        self._abort = abort
        self._decorate = decorate
        self._prefix = uuid.uuid4().hex[:8]  # one random draw per session, not per request
        self._tags = (f"{self._prefix}-{i}" for i in itertools.count())
        self._plans = itertools.count()
        self.pending: dict[str, TrackedRequest] = {}  # by request id
        self._templates: dict[tuple[str, int, bool], _TagTemplate] = {}
        """The plan of requests without per-request options, by (field, n, stream): worked
        out for the first such request, reused for the rest (only the tag differs)."""
        self.spool = Spool()
        self.store: Any = None  # the ActivationStore being written, if any
        self.fill_ns = 0  # front-end time spent filling outputs with rows (for the benchmark)

    @property
    def row_format(self) -> tuple[int, torch.dtype]:
        """(hidden size, dtype) of captured rows, as the workers report them."""
        return self.sources["hidden"].row_format  # type: ignore[attr-defined]

    @row_format.setter
    def row_format(self, value: tuple[int, torch.dtype]) -> None:
        self.sources["hidden"].row_format = value  # type: ignore[attr-defined]

    # -- request path ---------------------------------------------------------------------

    def tag(self, params: Any, stream: bool = False) -> Any:
        """A copy of ``params`` marked for capture; per-request options are validated here,
        before anything reaches the engine. ``stream``: the worker pushes the request's rows
        through the data plane as they are computed (``AsyncLLM``) instead of holding them
        for an export."""
        field = extra_field(params)
        extra = dict(getattr(params, field, None) or {})
        memo = None
        if self.steering is None and extra.get(EXTRA_ARGS_KEY) is None and RECORD_KEY not in extra:
            # No per-request options: every such request gets the same plan but its tag.
            memo = (field, getattr(params, "n", 1), stream)
            template = self._templates.get(memo)
            if template is not None and (
                template.config is None or getattr(params, "prompt_logprob_token_ids", None) is None
            ):
                return self._tag_from(template, params, field, extra)
        asked = without_unread(extra.get(EXTRA_ARGS_KEY), self.readouts)
        options = RequestOptions.from_user(asked, self.readout_options, self.write_options)
        if field == POOLING_EXTRA and (options.steered() or options.writes):
            asked_writes = [o for o, _ in options.writes]
            raise CaptureConfigError(
                f"This request sets {' and '.join(['steer'] * options.steered() + asked_writes)},"
                " but it is a pooling request: probehook steers generative models only (and "
                "writes into them only). Drop them."
            )
        if field == POOLING_EXTRA and options.monitors:
            raise CaptureConfigError(
                "This request sets monitors, but it is a pooling request: nothing is generated, "
                "so nothing can be stopped or flagged. Drop monitors; probe scores still come "
                "back on output.probe_scores."
            )
        config = self.config.narrow(options.capture())
        probes = self.probes.for_request(options) if self.probes is not None else None
        probe_monitors = [m for m in options.monitors or () if isinstance(m, ProbeMonitor)]
        asks_for_probes = options.probes not in (None, False, ()) or probe_monitors
        if probes is None and asks_for_probes:
            raise CaptureConfigError(
                "This request sets probes/monitors, but the engine has no probes; build the LLM "
                "with probes={...}."
            )
        readouts = self._readouts(options)
        for monitor in options.monitors or ():
            if isinstance(monitor, TopKMonitor) and monitor.source not in self.readouts:
                raise CaptureConfigError(
                    f"This request sets {type(monitor).__name__}s, which watch "
                    f"{monitor.watches}, but the engine has no {monitor.watches}; build the "
                    "LLM with them."
                )
        if (
            config is not None
            and not config.layers
            and not (probes and probes.names)
            and not readouts
        ):
            config = None  # nothing to collect: no rows, scores or features
        if config is not None and getattr(params, "prompt_logprob_token_ids", None) is not None:
            raise CaptureConfigError(
                "prompt_logprob_token_ids needs vLLM's Model Runner V2, and capture runs the V1 "
                "runner. Use prompt_logprobs=k instead, switch capture off for this request "
                '(extra_args={"probehook": {"include_prefill": False, "include_decode": False}}), '
                "or build an LLM with layers=None."
            )
        steer = self._steer(options, probes, config)  # a gate without decode scores: refused
        writes = self._writes(options)
        tagged = copy.copy(params)
        if config is not None or steer is not None or writes:
            record = extra.pop(RECORD_KEY, None)
            wire = RequestWire(
                tag=next(self._tags),
                # A request that is steered but captures nothing: an empty capture config.
                config=config if config is not None else CaptureConfig(layers=()),
                n=getattr(params, "n", 1),
                stream=stream,
                probes=probes.names if probes is not None and config is not None else (),
                monitors=self._wire(probes, tagged)
                if probes is not None and config is not None
                else (),
                stop_token=self.stop_token if _stops(probes, readouts) else None,
                record=record,
                steer=steer.terms if steer is not None else (),
                steer_phase=steer.phase if steer is not None else "both",
                writes=writes or None,
                readouts=tuple((s, r.names) for s, r in readouts.items())
                if config is not None
                else (),
                readout_top_k=tuple(
                    (s, r.k) for s, r in readouts.items() if r.k != self.readouts[s].k
                )
                if config is not None
                else (),
                # every monitor of a top-k readout's rows (SAE features', lenses'), on one list
                readout_monitors=self._readout_wire(readouts, tagged) if config is not None else (),
                readout_terms={s: r.terms for s, r in readouts.items() if r.terms}
                if config is not None
                else None,
            )
            extra = with_wire(extra, wire.to_wire())
            setattr(tagged, field, extra)
            if config is not None and config.include_prefill:
                # Cached prompt blocks are never recomputed, so their rows would be missing.
                tagged.skip_reading_prefix_cache = True
        if memo is not None and steer is None and not writes:
            wired = extra.get(EXTRA_ARGS_KEY) if config is not None else None
            if wired is not None:  # lets the worker read one wire of the template, not each
                wired[PLAN_KEY] = f"{self._prefix}-plan{next(self._plans)}"
            self._templates[memo] = _TagTemplate(
                config,
                wired,
                self.describe(tagged) if wired is not None else None,
                stops=config is not None and _stops(probes, readouts),
            )
        return tagged

    def _readouts(self, options: RequestOptions) -> dict[str, RequestReadout]:
        """The top-k readouts a request gets (every instance of each, unless it picks)."""
        picked = dict(options.readouts)
        got = {}
        for source, readout_set in self.readouts.items():
            extras = {o: v for s, o, v in options.readout_extras if s == source}
            chosen = readout_set.for_request(picked.get(source), extras, options.monitors)
            if chosen is not None:
                got[source] = chosen
        return got

    def _tag_from(self, template: _TagTemplate, params: Any, field: str, extra: dict) -> Any:
        """:meth:`tag` for a request without options, from the plan of the first one: the
        same wire values (shared, never modified) under a new tag."""
        tagged = copy.copy(params)
        if template.wire is None:
            return tagged
        if template.stops:
            tagged.stop_token_ids = sorted({*(params.stop_token_ids or []), self.stop_token})
        wire = WireDict(template.wire)
        wire["tag"] = next(self._tags)
        wire.described = template.described
        setattr(tagged, field, with_wire(extra, wire))
        if template.config is not None and template.config.include_prefill:
            tagged.skip_reading_prefix_cache = True
        return tagged

    def _steer(
        self, options: RequestOptions, probes: RequestProbes | None, config: CaptureConfig | None
    ) -> RequestSteer | None:
        monitors = probes.monitors if probes is not None else ()
        if self.steering is None:
            if options.steered():
                raise CaptureConfigError(
                    "This request sets steer, but the engine has no steering vectors; build it "
                    "with steering={name: SteeringVector} (or steering_layers=[...] and "
                    "add_steering)."
                )
            return None
        decode_scores = config is not None and config.include_decode
        return self.steering.for_request(options, monitors, decode_scores)

    def _writes(self, options: RequestOptions) -> dict[str, dict[str, Any]]:
        """The request's write terms, each checked by its intervention, by request option."""
        writes = {}
        for option, value in options.writes:
            installed = self.writes.get(option)
            if installed is None:
                entry = interventions(OUTPUT_PROCESSORS)[option]
                raise entry.instance_error(
                    f"This request sets {option}, but the engine was built without it (its "
                    "terms are part of the compiled model); build it with "
                    f"{entry.engine_option}=... ({entry.name})."
                )
            writes[option] = installed.check(value)
        return writes

    def cache_salt(self, params: Any) -> str | None:
        """The prefix-cache salt of a request tagged by :meth:`tag` (None: it neither steers
        nor writes): its KV must never be reused by, or reuse, a request's that did not, or
        did otherwise."""
        if self.steering is None and not self.writes:
            return None
        wire = wire_of(params)
        steer = self._steering_of(wire)
        salts = [steer.salt] if steer is not None else []
        for option, terms in sorted((wire.writes or {}).items() if wire is not None else ()):
            salts.append(self.writes[option].entry.salt(terms))
        return "|".join(salts) or None

    def _steering_of(self, wire: RequestWire | None) -> RequestSteer | None:
        if wire is None or self.steering is None:
            return None
        gates = tuple(m.monitor for m in wire.monitors if m.monitor.action == "steer")
        if not wire.steer and not gates:
            return None
        return self.steering.request_steer(wire.steer, wire.steer_phase, gates)

    def _wire(self, probes: RequestProbes, params: Any) -> tuple[WireMonitor, ...]:
        """The request's monitors for the worker; a stop monitor also makes the model's EOS
        one of the request's stop tokens, so that vLLM ends it when the worker forces it."""
        assert self.probes is not None
        if probes.stops:
            self._add_stop_token(params)
        return self.probes.wire_monitors(probes)

    def _readout_wire(
        self, readouts: Mapping[str, RequestReadout], params: Any
    ) -> tuple[tuple[Any, int], ...]:
        """The request's monitors of top-k readouts (lens monitors) for the worker, each
        with its instance's slot in the worker's bank; a stop monitor makes the model's EOS a
        stop token of the request, as for probes."""
        if any(r.stops for r in readouts.values()):
            self._add_stop_token(params)
        return tuple(
            (m, self.readouts[source].slot(m.instance))
            for source, chosen in readouts.items()
            for m in chosen.monitors
        )

    def _add_stop_token(self, params: Any) -> None:
        if self.stop_token is None:
            raise CaptureConfigError(
                "A stop monitor needs the model's EOS token id, and this tokenizer has "
                "none; use action='flag'."
            )
        params.stop_token_ids = sorted({*(params.stop_token_ids or []), self.stop_token})

    def register(self, request_id: str, engine_id: str, params: Any) -> None:
        """Remember a request the engine accepted (``params`` as returned by :meth:`tag`)."""
        request = self.describe(params, engine_id)
        if request is not None:
            self.pending[request_id] = request

    def describe(self, params: Any, engine_id: str = "") -> TrackedRequest | None:
        """What the front end needs to collect a request tagged by :meth:`tag` (None: it
        captures nothing)."""
        field = extra_field(params)
        raw = (getattr(params, field, None) or {}).get(EXTRA_ARGS_KEY)
        names = POOLING_FIELDS if field == POOLING_EXTRA else SAMPLING_FIELDS
        known = getattr(raw, "described", None) if type(raw) is WireDict else None
        if known is not None:  # tagged from a template: only the tag and sampling differ
            return TrackedRequest(
                raw["tag"],
                engine_id,
                known.config,
                self._sampling(params, names),
                known.probes,
                known.stop_token,
                None,
                known.steering,
                known.readouts,
            )
        wire = RequestWire.from_wire(raw)
        if wire is None:
            return None
        sampling = self._sampling(params, names)
        probes = None
        if self.probes is not None:
            monitors = tuple(self.probes.check_monitor(m.monitor) for m in wire.monitors)
            probes = RequestProbes(wire.probes, monitors)
        readouts = {
            source: RequestReadout(
                names,
                dict(wire.readout_top_k).get(source, self.readouts[source].k),
                tuple(m for m, _ in wire.readout_monitors if m.source == source),
                (wire.readout_terms or {}).get(source),
            )
            for source, names in wire.readouts
            if source in self.readouts
        }
        captures = bool(wire.config.layers) or bool(wire.probes) or bool(readouts)
        return TrackedRequest(
            wire.tag,
            engine_id,
            wire.config if captures else None,
            sampling,
            probes,
            self.stop_token if _stops(probes, readouts) else None,
            dict(wire.record) if wire.record is not None else None,
            self._steering_of(wire),
            readouts or None,
            wire.writes,
        )

    def _sampling(self, params: Any, names: Sequence[str]) -> dict[str, Any]:
        """The request's sampling (or pooling) settings as its store record keeps them;
        nothing without a store, which is their only reader."""
        if self.store is None:
            return {}
        return {f: _jsonable(getattr(params, f, None)) for f in names}

    def fill(self, outputs: Sequence[Any]) -> None:
        """Fill finished outputs with their rows and scores (:mod:`probehook.frontend.fill`),
        every output's needs fetched in one export, pooled outputs planned and set together
        (:class:`~probehook.frontend.fill.PooledFill`); send captured requests to the store."""
        processors = list(OUTPUT_PROCESSORS)  # once per call, not per output
        attributes = source_attributes(processors)
        plans: list[OutputPlan] = []
        pooled = PooledFill(attributes, self.sources)
        for output in outputs:
            if not hasattr(output, "outputs") or not getattr(output, "finished", True):
                continue
            request = self.pending.pop(output.request_id, None)
            reset(output, request, processors)
            if request is None or request.config is None:
                continue
            if is_pooled(output):
                pooled.add(output, request)
            else:
                plans.append(plan(output, request, self.sources, None, attributes))
        if plans or pooled.filled:
            started = time.perf_counter_ns()
            got = self._export(plans, pooled)
            for planned in plans:
                apply(planned, got, self.sources)
            self.fill_ns += time.perf_counter_ns() - started
        for output in outputs:
            if hasattr(output, "outputs"):
                self._decorate(output)
        if self.store is not None:
            for planned in plans:
                store_filled(self.store, planned.output, planned.request)
            for output, request in pooled.filled:
                store_filled(self.store, output, request)

    def label(self, request_id: str, record: dict[str, Any]) -> None:
        """Extra fields for a pending request's store record (before :meth:`fill`)."""
        request = self.pending.get(request_id)
        if request is not None:
            request.record = record

    # -- the export: every need of a step's outputs in one RPC ------------------------------

    def _export(self, plans: Sequence[OutputPlan], pooled: PooledFill) -> dict[Need, Any]:
        """Fetch the needs of ``plans`` (a generation output's spans per stream) and of
        ``pooled`` (batched per source and layer set, one tensor each, set on the outputs
        here) from the workers in one export. Returns each need of ``plans``' value, or a
        :class:`FailedCapture`."""
        asks: list[StreamAsk] = []
        asked: list[tuple[list[Need], TrackedRequest]] = []  # per ask
        by_stream: dict[tuple[str, str], int] = {}
        for planned in plans:
            request = planned.request
            assert request.config is not None
            for need in planned.needs():
                index = by_stream.get((need.source, need.key))
                if index is None:
                    index = by_stream[(need.source, need.key)] = len(asks)
                    layers = self.sources[need.source].slots(request)
                    asks.append(StreamAsk(need.key, need.source, list(layers)))
                    asked.append(([], request))
                asks[index].spans.append([need.lo, need.hi])
                asked[index][0].append(need)
        args: tuple = (self.spool.new_paths(), [a.to_wire() for a in asks])
        if pooled.batches:
            args = (*args, [b.to_wire() for b in pooled.batches.values()])
        wire = next(r for r in self._rpc("probehook_export", args) if r is not None)
        reply = ExportReply.from_wire(wire)
        tensors: list[torch.Tensor] = []
        if reply.entries:
            if reply.path is None or not self.spool.owns(reply.path):
                raise CaptureError(f"The worker answered with a path outside the spool: {wire}")
            tensors = read_tensors(reply.path, reply.entries)
        failures = reply.failures
        by_stream_id: dict[str, list[SpanReport]] = {}
        for span in reply.spans:
            by_stream_id.setdefault(stream_id(span.source, span.key), []).append(span)
        _check_complete(by_stream_id, failures, pooled.incomplete(reply.batches))
        got: dict[Need, Any] = {}
        for (needs, request), ask in zip(asked, asks, strict=True):
            name = stream_id(ask.source, ask.key)
            if name in failures:
                failure = FailedCapture.of_stream(ask.key, failures[name])
                got.update((need, failure) for need in needs)
                continue
            for need, span in zip(needs, by_stream_id.get(name, []), strict=True):
                tensor = tensors[span.tensor_index]
                got[need] = self.sources[need.source].value(tensor, request)
        pooled.apply(tensors, reply.batches, failures)
        return got

    # -- requests that will never be collected --------------------------------------------

    def abandon(self, request_ids: Sequence[str] | None = None, *, abort: bool = True) -> None:
        """Forget pending requests (all when ``request_ids`` is None) and free their rows.

        With ``abort``, the engine requests are aborted too, so they stop running and never
        come back as outputs of a later call.
        """
        ids = list(self.pending) if request_ids is None else list(request_ids)
        requests = [self.pending.pop(i) for i in ids if i in self.pending]
        if not requests:
            return
        if abort:
            self._abort([r.engine_id for r in requests])
        self._rpc("probehook_forget", ([f"{r.tag}/" for r in requests],))

    def close(self) -> None:
        self.spool.remove()


def _stops(probes: RequestProbes | None, readouts: Mapping[str, RequestReadout]) -> bool:
    """Whether a stop monitor (of a probe, an SAE feature or a lens) watches the request."""
    return (probes is not None and probes.stops) or any(r.stops for r in readouts.values())


def options_of(params: Any, readout_options: Mapping[str, str] | None = None) -> RequestOptions:
    """The user's probehook options ``params`` carry (``extra_args`` of SamplingParams,
    ``extra_kwargs`` of PoolingParams), checked; empty when none."""
    return RequestOptions.from_user(
        (getattr(params, extra_field(params), None) or {}).get(EXTRA_ARGS_KEY),
        readout_options,
        tuple(interventions(OUTPUT_PROCESSORS)),
    )


def wire_of(params: Any) -> RequestWire | None:
    """The plan :meth:`CaptureSession.tag` wrote into ``params`` (None: untagged)."""
    return RequestWire.from_wire(
        (getattr(params, extra_field(params), None) or {}).get(EXTRA_ARGS_KEY)
    )


def marked(params: Any) -> bool:
    """Whether ``params`` carry probehook options."""
    return EXTRA_ARGS_KEY in (getattr(params, extra_field(params), None) or {})


def _check_complete(
    by_stream_id: dict[str, list[SpanReport]],
    failures: dict[str, str],
    pooled_incomplete: Sequence[SpanReport],
) -> None:
    """Raise if the export left rows out of a span of a stream that did not fail."""
    spans = [s for name, spans in by_stream_id.items() if name not in failures for s in spans]
    spans += [s for s in pooled_incomplete if stream_id(s.source, s.key) not in failures]
    broken = [s for s in spans if s.num_missing]
    if broken:
        s = broken[0]
        raise CaptureError(
            f"Stream {s.key} is missing {s.num_missing} captured {s.source} "
            f"row(s) at positions {s.missing} (asked for {s.lo}..{s.hi - 1}); "
            f"{len(broken)} span(s) are incomplete in all. This is a probehook bug: "
            "please report it with the engine arguments."
        )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)
