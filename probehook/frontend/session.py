"""The front-end side of capture, shared by every front end (offline ``LLM``, and later
``AsyncLLM`` and the server): tag requests, map ids, export rows, attach them, discard.

A front end owns one :class:`CaptureSession` and calls it at four points of its request path:
:meth:`~CaptureSession.tag` before a request enters the engine, :meth:`~CaptureSession.register`
once the engine has accepted it, :meth:`~CaptureSession.attach` with finished outputs, and
:meth:`~CaptureSession.abandon` when requests will never be collected. vLLM itself is reached
only through the callables it is given (worker RPC and engine abort), so this module has no
vLLM imports.

Ids (one word each, used across probehook):

- *request id*: vLLM's id of a user request, ``RequestOutput.request_id``.
- *engine id*: vLLM's internal id of the same request (the request id plus a random suffix);
  the engine's abort takes these.
- *tag*: probehook's id of a user request, unique in the process; it travels to the worker in
  ``SamplingParams.extra_args["probehook"]["tag"]``.
- *stream key*: ``"<tag>/<completion index>"``, one per completion: the worker keeps rows
  under it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from probehook.capture_config import CaptureConfig
from probehook.core.request_options import (
    EXTRA_ARGS_KEY,
    RECORD_KEY,
    RequestOptions,
    RequestWire,
    WireDict,
    WireMonitor,
)
from probehook.core.spans import completion_spans, score_config
from probehook.errors import CaptureConfigError, CaptureError
from probehook.frontend.probe_set import ProbeSet, RequestProbes
from probehook.frontend.steering_set import RequestSteer, SteeringSet
from probehook.frontend.transport_reader import Spool, read_tensors
from probehook.outputs import OUTPUT_PROCESSORS

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
POOLING_EXTRA = "extra_kwargs"
"""Where PoolingParams carry free-form options (SamplingParams: ``extra_args``)."""

Rpc = Callable[[str, tuple], list]


@dataclass(frozen=True)
class RequestTag:
    """What the front end remembers of one captured request until its output is attached."""

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


@dataclass(frozen=True)
class _TagTemplate:
    """What :meth:`CaptureSession.tag` worked out for a request without options."""

    config: CaptureConfig | None
    wire: WireDict | None
    """Its ``extra_args["probehook"]`` (None: nothing is written, nothing is captured)."""
    described: RequestTag | None
    """:meth:`CaptureSession.describe` of it."""
    stops: bool
    """A stop monitor applies: the model's EOS joins the request's stop tokens."""


@dataclass
class _Batch:
    """The final spans of many pooled outputs, asked from one source in one export."""

    source: str
    layers: list[Any]
    keys: list[str] = dataclasses.field(default_factory=list)
    spans: list[int] = dataclasses.field(default_factory=list)
    """lo, hi, lo, hi, ...: one span per key."""
    items: list[tuple[Any, RequestTag]] = dataclasses.field(default_factory=list)

    def add(self, key: str, lo: int, hi: int, output: Any, tag: RequestTag) -> None:
        self.keys.append(key)
        self.spans += (lo, hi)
        self.items.append((output, tag))

    def wire(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "layers": self.layers,
            "keys": self.keys,
            "spans": self.spans,
        }


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


class CaptureSession:
    """Per-front-end capture state: tags, id mapping, export, attach and discard."""

    def __init__(
        self,
        config: CaptureConfig,
        rpc: Rpc,
        abort: Callable[[list[str]], None],
        decorate: Callable[[Any], None] = lambda output: None,
        probes: ProbeSet | None = None,
        stop_token: int | None = None,
        steering: SteeringSet | None = None,
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
        """
        self.config = config
        self.probes = probes
        self.steering = steering
        self.stop_token = stop_token
        self._rpc = rpc
        self._abort = abort
        self._decorate = decorate
        prefix = uuid.uuid4().hex[:8]  # one random draw per session, not per request
        self._tags = (f"{prefix}-{i}" for i in itertools.count())
        self.pending: dict[str, RequestTag] = {}  # by request id
        self._templates: dict[tuple[str, int, bool], _TagTemplate] = {}
        """The plan of requests without per-request options, by (field, n, stream): worked
        out for the first such request, reused for the rest (only the tag differs)."""
        self.spool = Spool()
        self.store: Any = None  # the ActivationStore being written, if any
        self.attach_ns = 0  # front-end time spent attaching rows (for the benchmark)
        self.row_format: tuple[int, torch.dtype] = (0, torch.float32)
        """(hidden size, dtype) of captured rows, as the workers report them."""

    # -- request path ---------------------------------------------------------------------

    def tag(self, params: Any, stream: bool = False) -> Any:
        """A copy of ``params`` marked for capture; per-request options are validated here,
        before anything reaches the engine. ``stream``: the worker pushes the request's rows
        through the data plane as they are computed (``AsyncLLM``) instead of holding them
        for an export."""
        field = _extra_field(params)
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
        options = RequestOptions.from_user(extra.get(EXTRA_ARGS_KEY))
        if field == POOLING_EXTRA and options.steered():
            raise CaptureConfigError(
                "This request sets steer, but it is a pooling request: probehook steers "
                "generative models only. Drop steer."
            )
        if field == POOLING_EXTRA and options.monitors:
            raise CaptureConfigError(
                "This request sets monitors, but it is a pooling request: nothing is generated, "
                "so nothing can be stopped or flagged. Drop monitors; probe scores still come "
                "back on output.probe_scores."
            )
        config = self.config.narrow(options.capture())
        probes = self.probes.for_request(options) if self.probes is not None else None
        asks_for_probes = options.probes not in (None, False, ()) or options.monitors
        if probes is None and asks_for_probes:
            raise CaptureConfigError(
                "This request sets probes/monitors, but the engine has no probes; build the LLM "
                "with probes={...}."
            )
        if config is not None and not config.layers and not (probes and probes.names):
            config = None  # nothing to collect: neither rows nor scores
        if config is not None and getattr(params, "prompt_logprob_token_ids", None) is not None:
            raise CaptureConfigError(
                "prompt_logprob_token_ids needs vLLM's Model Runner V2, and capture runs the V1 "
                "runner. Use prompt_logprobs=k instead, switch capture off for this request "
                '(extra_args={"probehook": {"include_prefill": False, "include_decode": False}}), '
                "or build an LLM with layers=None."
            )
        steer = self._steer(options, probes, config)  # a gate without decode scores: refused
        tagged = copy.copy(params)
        if config is not None or steer is not None:
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
                stop_token=self.stop_token if probes is not None and probes.stops else None,
                record=record,
                steer=steer.terms if steer is not None else (),
                steer_phase=steer.phase if steer is not None else "both",
            )
            extra[EXTRA_ARGS_KEY] = wire.to_wire()
            setattr(tagged, field, extra)
            if config is not None and config.include_prefill:
                # Cached prompt blocks are never recomputed, so their rows would be missing.
                tagged.skip_reading_prefix_cache = True
        if memo is not None and steer is None:
            wired = extra.get(EXTRA_ARGS_KEY) if config is not None else None
            self._templates[memo] = _TagTemplate(
                config,
                wired,
                self.describe(tagged) if wired is not None else None,
                stops=config is not None and probes is not None and probes.stops,
            )
        return tagged

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
        extra[EXTRA_ARGS_KEY] = wire
        setattr(tagged, field, extra)
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

    def cache_salt(self, params: Any) -> str | None:
        """The prefix-cache salt of a request tagged by :meth:`tag` (None: not steered)."""
        if self.steering is None:
            return None
        steer = self._steering_of(wire_of(params))
        return steer.salt if steer is not None else None

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
            if self.stop_token is None:
                raise CaptureConfigError(
                    "A stop monitor needs the model's EOS token id, and this tokenizer has "
                    "none; use action='flag'."
                )
            params.stop_token_ids = sorted({*(params.stop_token_ids or []), self.stop_token})
        return self.probes.wire_monitors(probes)

    def register(self, request_id: str, engine_id: str, params: Any) -> None:
        """Remember a request the engine accepted (``params`` as returned by :meth:`tag`)."""
        tag = self.describe(params, engine_id)
        if tag is not None:
            self.pending[request_id] = tag

    def describe(self, params: Any, engine_id: str = "") -> RequestTag | None:
        """What the front end needs to collect a request tagged by :meth:`tag` (None: it
        captures nothing)."""
        field = _extra_field(params)
        raw = (getattr(params, field, None) or {}).get(EXTRA_ARGS_KEY)
        names = POOLING_FIELDS if field == POOLING_EXTRA else SAMPLING_FIELDS
        known = getattr(raw, "described", None) if type(raw) is WireDict else None
        if known is not None:  # tagged from a template: only the tag and sampling differ
            return RequestTag(
                raw["tag"],
                engine_id,
                known.config,
                {f: _jsonable(getattr(params, f, None)) for f in names},
                known.probes,
                known.stop_token,
                None,
                known.steering,
            )
        wire = RequestWire.from_wire(raw)
        if wire is None:
            return None
        sampling = {f: _jsonable(getattr(params, f, None)) for f in names}
        probes = None
        if self.probes is not None:
            monitors = tuple(self.probes.check_monitor(m.monitor) for m in wire.monitors)
            probes = RequestProbes(wire.probes, monitors)
        captures = bool(wire.config.layers) or bool(wire.probes)
        return RequestTag(
            wire.tag,
            engine_id,
            wire.config if captures else None,
            sampling,
            probes,
            self.stop_token if probes is not None and probes.stops else None,
            dict(wire.record) if wire.record is not None else None,
            self._steering_of(wire),
        )

    def attach(self, outputs: Sequence[Any]) -> None:
        """Fetch the rows and scores of finished outputs in one export and hang them on the
        outputs; name the probe that stopped a request; send captured requests to the store."""
        requests: list[dict[str, Any]] = []
        targets: list[list[tuple[Any, str]]] = []  # per export request: (object, attribute)
        captured: list[tuple[Any, RequestTag]] = []
        processors = list(OUTPUT_PROCESSORS)  # once per call, not per output
        batches: dict[tuple[str, tuple[Any, ...]], _Batch] = {}  # pooled outputs
        for output in outputs:
            if not hasattr(output, "outputs") or not getattr(output, "finished", True):
                continue
            clear_outputs(output, processors)
            tag = self.pending.pop(output.request_id, None)
            if tag is not None and tag.steering is not None:
                note_steering(output, tag.steering)
            if tag is None or tag.config is None:
                continue
            captured.append((output, tag))
            prompt_len = len(output.prompt_token_ids or [])
            if is_pooled(output):
                # One pass over the input: its rows and scores are prompt rows.
                self._ask_pooled(output, tag, prompt_len, requests, targets, batches)
                continue
            for completion in output.outputs:
                key = f"{tag.tag}/{completion.index}"
                n_out = len(completion.token_ids)
                if tag.config.layers:
                    spans = completion_spans(tag.config, prompt_len, n_out, completion.index)
                    requests.append(_export(key, "hidden", spans, list(tag.config.layers)))
                    targets.append(_slots(spans, output, completion, "hidden"))
                if tag.probes is not None and tag.probes.names:
                    spans = completion_spans(
                        _score_config(tag.config), prompt_len, n_out, completion.index
                    )
                    requests.append(_export(key, "scores", spans, ["scores"]))
                    targets.append(_slots(spans, output, completion, "scores"))
        if requests or batches:
            started = time.perf_counter_ns()
            self._fetch(requests, targets, dict(_tags_by_name(captured)), list(batches.values()))
            self.attach_ns += time.perf_counter_ns() - started
        for output, tag in captured:
            if tag.probes is not None and tag.probes.monitors:
                self._act_on_scores(output, tag)
            if tag.steering is not None and tag.steering.gates:
                gate_starts(output, tag.steering, self.probes)
        for output in outputs:
            if hasattr(output, "outputs"):
                mirror_first_completion(output)
                self._decorate(output)
        if self.store is not None:
            for output, tag in captured:
                self.store_output(output, tag)

    def _ask_pooled(
        self,
        output: Any,
        tag: RequestTag,
        prompt_len: int,
        requests: list[dict[str, Any]],
        targets: list[list[tuple[Any, str]]],
        batches: dict[tuple[str, tuple[Any, ...]], _Batch],
    ) -> None:
        """A pooled output's rows and scores: its prompt span, asked in one batch per source
        and layer set with the other pooled outputs of the call."""
        config = tag.config
        assert config is not None
        key = f"{tag.tag}/0"
        asks = []
        if config.layers:
            asks.append(("hidden", config.layers, completion_spans(config, prompt_len, 0)))
        if tag.probes is not None and tag.probes.names:
            spans = completion_spans(_score_config(config), prompt_len, 0)
            asks.append(("scores", ("scores",), spans))
        for source, layers, spans in asks:
            span = spans[0]
            if span is None:  # nothing to ask (never for a pooling request): as generation
                requests.append(_export(key, source, spans[:1], list(layers)))
                targets.append([(output, attributes_of(source)[0])])
                continue
            batch = batches.get((source, layers))
            if batch is None:
                batch = batches[(source, layers)] = _Batch(source, list(layers))
            batch.add(key, span.lo, span.hi, output, tag)

    def label(self, request_id: str, record: dict[str, Any]) -> None:
        """Extra fields for a pending request's store record (before :meth:`attach`)."""
        tag = self.pending.get(request_id)
        if tag is not None:
            self.pending[request_id] = dataclasses.replace(tag, record=record)

    def store_output(self, output: Any, tag: RequestTag) -> None:
        """Add a finished output, rows attached, to the store; set its ``store_id``. A
        request whose capture failed is logged and not stored."""
        from probehook.store.records import pending_request

        assert self.store is not None and tag.config is not None
        if failed(output):
            logger.error("probehook: request %s is not stored.", output.request_id)
            return
        # vLLM's request_id stays as it is; the store names the request itself.
        pending = pending_request(output, tag.sampling, tag.config, tag.record)
        output.store_id = self.store.add(pending)

    def _act_on_scores(self, output: Any, tag: RequestTag) -> None:
        assert self.probes is not None and tag.probes is not None
        for completion in output.outputs:
            if isinstance(completion.probe_scores, FailedCapture):
                continue
            stopped = ended_on_stop_token(tag, completion)
            flags, stop_reason = self.probes.flags_and_stop(
                tag.probes, completion.probe_scores, stopped
            )
            completion.probe_flags = flags
            if stop_reason is not None:
                completion.stop_reason = stop_reason

    def _fetch(
        self,
        requests: list[dict[str, Any]],
        targets: list[list[tuple[Any, str]]],
        tags: dict[str, RequestTag],
        batches: Sequence[_Batch] = (),
    ) -> None:
        args: tuple = (self.spool.new_paths(), requests)
        if batches:
            args = (*args, [b.wire() for b in batches])
        reply = next(r for r in self._rpc("probehook_export", args) if r is not None)
        tensors: list[torch.Tensor] = []
        if reply["entries"]:
            if not self.spool.owns(reply["path"]):
                raise CaptureError(f"The worker answered with a path outside the spool: {reply}")
            tensors = read_tensors(reply["path"], reply["entries"])
        failures: dict[str, str] = reply["failures"]
        by_key: dict[str, list[dict[str, Any]]] = {}
        for span in reply["spans"]:
            by_key.setdefault(f"{span['source']}:{span['key']}", []).append(span)
        broken = [
            s
            for key, spans in by_key.items()
            if key not in failures
            for s in spans
            if s["num_missing"]
        ]
        batch_reports = reply.get("batches") or []
        for batch, report in zip(batches, batch_reports, strict=True):
            for index, num_missing, missing in report["incomplete"]:
                key = batch.keys[index]
                if f"{batch.source}:{key}" not in failures:
                    lo, hi = batch.spans[2 * index], batch.spans[2 * index + 1]
                    broken.append(
                        {
                            "key": key,
                            "source": batch.source,
                            "num_missing": num_missing,
                            "missing": missing,
                            "lo": lo,
                            "hi": hi,
                        }
                    )
        if broken:
            s = broken[0]
            raise CaptureError(
                f"Stream {s['key']} is missing {s['num_missing']} captured {s['source']} "
                f"row(s) at positions {s['missing']} (asked for {s['lo']}..{s['hi'] - 1}); "
                f"{len(broken)} span(s) are incomplete in all. This is a probehook bug: "
                "please report it with the engine arguments."
            )
        for request, slots in zip(requests, targets, strict=True):
            key = f"{request['source']}:{request['key']}"
            if key in failures:
                self._fail(slots, f"Capture of stream {request['key']} failed: {failures[key]}")
                continue
            for (target, attribute), span in zip(slots, by_key.get(key, []), strict=True):
                tensor = tensors[span["tensor_index"]]
                if request["source"] == "scores":
                    assert self.probes is not None
                    tag = tags[request["key"].rsplit("/", 1)[0]]
                    assert tag.probes is not None
                    value = self.probes.split(tensor[0], tag.probes.names)
                else:
                    value = dict(zip(request["layers"], tensor, strict=True))
                setattr(target, attribute, value)

        for batch, report in zip(batches, batch_reports, strict=True):
            self._hand_out(batch, tensors[report["tensor_index"]], failures)

    def _hand_out(self, batch: _Batch, tensor: torch.Tensor, failures: dict[str, str]) -> None:
        """Give each output of a batch its rows (or scores): views of the batch's tensor,
        ``[len(layers), total, width]``, the outputs' spans back to back."""
        attribute = attributes_of(batch.source)[0]
        if batch.source == "hidden":
            per_layer = list(zip(batch.layers, tensor, strict=True))
        else:
            assert self.probes is not None
            scores = tensor[0]
            split: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        offset = 0
        for index, (output, tag) in enumerate(batch.items):
            n = batch.spans[2 * index + 1] - batch.spans[2 * index]
            lo, offset = offset, offset + n
            key = batch.keys[index]
            failure = failures.get(f"{batch.source}:{key}")
            if failure is not None:
                self._fail([(output, attribute)], f"Capture of stream {key} failed: {failure}")
                continue
            if batch.source == "hidden":
                value = {layer: rows[lo:offset] for layer, rows in per_layer}
            else:
                assert tag.probes is not None
                names = tag.probes.names
                columns = split.get(names)
                if columns is None:
                    columns = split[names] = self.probes.split(scores, names)  # type: ignore[union-attr]
                value = {name: column[lo:offset] for name, column in columns.items()}
            setattr(output, attribute, value)

    def no_rows(self, source: str, tag: RequestTag) -> dict[Any, torch.Tensor]:
        """The value of ``source`` for positions an output does not hold: every layer (or
        probe) the request asked for, with 0 rows, so outputs keep their shape."""
        if source == "hidden":
            assert tag.config is not None
            hidden, dtype = self.row_format
            return {layer: torch.empty((0, hidden), dtype=dtype) for layer in tag.config.layers}
        assert self.probes is not None and tag.probes is not None
        width = max((c.hi for c in self.probes.columns.values()), default=0)
        return self.probes.split(torch.empty((0, width)), tag.probes.names)

    def _fail(self, slots: list[tuple[Any, str]], reason: str) -> None:
        logger.error("probehook: %s", reason)
        for target, attribute in slots:
            setattr(target, attribute, FailedCapture(reason))
            target.capture_error = reason

    # -- requests that will never be collected --------------------------------------------

    def abandon(self, request_ids: Sequence[str] | None = None, *, abort: bool = True) -> None:
        """Forget pending requests (all when ``request_ids`` is None) and free their rows.

        With ``abort``, the engine requests are aborted too, so they stop running and never
        come back as outputs of a later call.
        """
        ids = list(self.pending) if request_ids is None else list(request_ids)
        tags = [self.pending.pop(i) for i in ids if i in self.pending]
        if not tags:
            return
        if abort:
            self._abort([t.engine_id for t in tags])
        self._rpc("probehook_forget", ([f"{t.tag}/" for t in tags],))

    def close(self) -> None:
        self.spool.remove()


def _extra_field(params: Any) -> str:
    return "extra_args" if hasattr(params, "extra_args") else POOLING_EXTRA


def options_of(params: Any) -> RequestOptions:
    """The user's probehook options ``params`` carry (``extra_args`` of SamplingParams,
    ``extra_kwargs`` of PoolingParams), checked; empty when none."""
    return RequestOptions.from_user(
        (getattr(params, _extra_field(params), None) or {}).get(EXTRA_ARGS_KEY)
    )


def wire_of(params: Any) -> RequestWire | None:
    """The plan :meth:`CaptureSession.tag` wrote into ``params`` (None: untagged)."""
    return RequestWire.from_wire(
        (getattr(params, _extra_field(params), None) or {}).get(EXTRA_ARGS_KEY)
    )


def marked(params: Any) -> bool:
    """Whether ``params`` carry probehook options."""
    return EXTRA_ARGS_KEY in (getattr(params, _extra_field(params), None) or {})


def is_pooled(output: Any) -> bool:
    """Whether ``output`` is a pooling model's (one ``outputs`` object, not completions)."""
    return not isinstance(getattr(output, "outputs", None), list)


def completions(output: Any) -> list[Any]:
    """A generation output's completions; none for a pooling output."""
    return [] if is_pooled(output) else list(output.outputs)


def _tags_by_name(captured: list[tuple[Any, RequestTag]]) -> list[tuple[str, RequestTag]]:
    return [(tag.tag, tag) for _, tag in captured]


def _export(key: str, source: str, spans: tuple[Any, Any], slots: list[Any]) -> dict[str, Any]:
    return {
        "key": key,
        "source": source,
        "spans": [[s.lo, s.hi] for s in spans if s is not None],
        "layers": slots,
        "final": True,
    }


def attributes_of(source: str) -> tuple[str, str]:
    """The (request, completion) attributes that rows of capture ``source`` fill: the
    output processor registered for that source decides."""
    processor = OUTPUT_PROCESSORS.for_source(source)
    return processor.request_attributes[0], processor.completion_attributes[0]


@functools.lru_cache(maxsize=256)
def _score_config(config: CaptureConfig) -> CaptureConfig:
    """:func:`score_config`, once per distinct config (it builds and checks a new one)."""
    return score_config(config)


def _slots(spans: tuple[Any, Any], output: Any, completion: Any, source: str) -> list:
    """Where each asked span goes: prefill on the request, decode on the completion."""
    prefill, decode = spans
    slots = []
    if prefill is not None:
        slots.append((output, attributes_of(source)[0]))
    if decode is not None:
        slots.append((completion, attributes_of(source)[1]))
    return slots


def ended_on_stop_token(tag: RequestTag, completion: Any) -> bool:
    """Whether a finished completion ended on the token a stop monitor forces."""
    return (
        tag.stop_token is not None
        and completion.finish_reason == "stop"
        and bool(completion.token_ids)
        and completion.token_ids[-1] == tag.stop_token
    )


def note_steering(output: Any, steer: RequestSteer) -> None:
    """Each completion's ``steering``: the vectors, scales and phase, and ``start``, the first
    steered position (None while a gate has not crossed; :func:`gate_starts` fills it in)."""
    prompt_len = len(output.prompt_token_ids or [])
    start = None if steer.gates else (prompt_len if steer.phase == "decode" else 0)
    for completion in output.outputs:
        completion.steering = {**steer.describe(), "start": start}


def gate_starts(output: Any, steer: RequestSteer, probes: ProbeSet | None) -> None:
    """Where probe-gated steering started in each completion, from the same float32 scores
    the worker watched: the position after the first decode row that crossed."""
    if probes is None:
        return
    gate = steer.gates[0]
    prompt_len = len(output.prompt_token_ids or [])
    for completion in output.outputs:
        scores = completion.probe_scores
        if isinstance(scores, FailedCapture) or gate.probe not in scores:
            continue
        start = probes.first_crossing(gate, scores[gate.probe])
        if completion.steering is not None:
            completion.steering["start"] = None if start is None else prompt_len + start


def clear_outputs(output: Any, processors: Sequence[Any] | None = None) -> None:
    """Every probehook attribute exists on every output, empty until filled (also on the
    outputs of an engine without capture, so code works either way). ``processors``: the
    registry's processors, when the caller listed them already."""
    for processor in OUTPUT_PROCESSORS if processors is None else processors:
        for attribute in processor.request_attributes:
            setattr(output, attribute, processor.empty())
        for completion in completions(output):
            for attribute in processor.completion_attributes:
                setattr(completion, attribute, processor.empty())
    mirror_first_completion(output)
    output.store_id = None
    output.processor_errors = {}


def derive(output: Any) -> None:
    """Let every registered output processor fill its values on ``output``. A processor that
    raises is logged with its name and the request id, and named in the output's
    ``processor_errors``; its values stay empty and nothing else is affected."""
    for processor in OUTPUT_PROCESSORS:
        try:
            processor.fill(output)
        except Exception as exc:
            message = (
                f"output processor {processor.name!r} failed on request "
                f"{getattr(output, 'request_id', '?')}: {type(exc).__name__}: {exc}"
            )
            logger.error("probehook: %s", message)
            errors = getattr(output, "processor_errors", None) or {}
            output.processor_errors = {**errors, processor.name: message}


def copy_captures(source: Any, target: Any) -> None:
    """Give ``target`` (a new object vLLM built from a pooled output) the captures of
    ``source``: every registered processor's request attributes, and the store id."""
    for processor in OUTPUT_PROCESSORS:
        for attribute in processor.request_attributes:
            setattr(target, attribute, getattr(source, attribute))
    mirror_first_completion(target)
    target.store_id = getattr(source, "store_id", None)
    target.processor_errors = getattr(source, "processor_errors", None) or {}


def mirror_first_completion(output: Any) -> None:
    """``output.hidden_states`` / ``probe_scores``: the first completion's; for a pooling
    output, which reads its input in one pass, its (prompt) rows and scores."""
    if is_pooled(output):
        output.hidden_states = output.prefill_hidden_states
        output.probe_scores = output.prefill_probe_scores
        return
    first = output.outputs[0] if output.outputs else None
    output.hidden_states = first.hidden_states if first is not None else {}
    output.probe_scores = first.probe_scores if first is not None else {}


def failed(output: Any) -> bool:
    attributes = ("prefill_hidden_states", "prefill_probe_scores")
    return any(isinstance(getattr(output, a), FailedCapture) for a in attributes) or any(
        isinstance(c.hidden_states, FailedCapture) or isinstance(c.probe_scores, FailedCapture)
        for c in completions(output)
    )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)
