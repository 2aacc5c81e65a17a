"""Filling outputs with captured rows: the one algorithm of every front end.

Offline outputs (:meth:`CaptureSession.fill <probehook.frontend.session.CaptureSession.fill>`),
streamed ones (:meth:`RequestStream.fill <probehook.frontend.request_stream.RequestStream.fill>`),
pooled and served ones are all filled in the same three steps:

1. :func:`reset`: every probehook attribute exists, empty; a steered request's ``steering``;
2. :func:`plan`: which rows the output needs. Each of its slots (the prompt's rows on the
   request output, each completion's rows on the completion) gets a :class:`Need`, rows
   ``lo..hi`` of one source (``"hidden"`` rows or probe ``"scores"``) of one stream key, from
   the request's capture config and what was already yielded (:class:`Progress`; None: the
   whole request, as offline);
3. the caller fetches the needs (offline: one export RPC for every output of a step, pooled
   outputs batched; a stream: ``Receiver.take`` per need), turns rows into values with
   with its source's ``value`` (or ``batch_values``: :mod:`probehook.frontend.sources`), and
   :func:`apply` sets them on the output, with
   what they imply: ``probe_flags``, a stop monitor's ``stop_reason``, where probe-gated
   steering started, and :class:`FailedCapture` for a stream that failed.

The output-shape helpers live here too (which attributes exist, their empty values, the first
completion mirrored on the request output). Nothing here knows vLLM or how rows travel.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from probehook.capture_config import CaptureConfig
from probehook.core.export_wire import BatchAsk, BatchReport, SpanReport, stream_id
from probehook.core.monitors import crossings
from probehook.core.spans import completion_spans
from probehook.frontend.sources import Sources
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.intervention import interventions
from probehook.outputs.shapes import FailedCapture, completions, is_pooled

if TYPE_CHECKING:
    from probehook.frontend.probe_set import ProbeSet
    from probehook.frontend.steering_set import RequestSteer
    from probehook.frontend.tracked_request import TrackedRequest

logger = logging.getLogger(__name__)


class Need(NamedTuple):
    """Rows ``lo..hi`` of capture ``source`` of stream ``key``, which an output needs."""

    source: str
    key: str
    lo: int
    hi: int


class Destination(NamedTuple):
    """Where one source's rows of one stream go: ``target.attribute``."""

    target: Any
    attribute: str
    source: str
    key: str
    need: Need | None
    """None: the output holds none of these positions; every layer (probe) with 0 rows."""
    completion: Any
    """The completion whose stream this is (None on a pooled output)."""


@dataclasses.dataclass(slots=True)
class Scored:
    """A completion whose probe scores are acted on: flags, stop reason, gate start."""

    completion: Any
    before: int
    """Tokens already yielded (a delta stream): flags before them went out already."""
    decode: Any
    """Its decode span of scores to date (None: decode is not captured)."""
    flags: Need | None
    """Every decode score to date, when the output holds only the new ones."""


@dataclasses.dataclass
class Progress:
    """What a stream already yielded of one request."""

    delta: bool
    """Each output holds only what is new (vLLM's DELTA output kind)."""
    seen: dict[int, int] = dataclasses.field(default_factory=dict)
    """Completion index -> tokens yielded so far."""
    prefill_sent: bool = False
    gate_started: dict[int, int] = dataclasses.field(default_factory=dict)
    """Completion index -> first steered position, once a gate crossed."""
    monitor_state: dict[tuple[int, Any], tuple[int, list[int]]] = dataclasses.field(
        default_factory=dict
    )
    """(completion index, top-k monitor) -> decode rows checked so far and the rows that
    crossed: a cumulative stream checks only the rows each output adds."""


@dataclasses.dataclass(slots=True)
class OutputPlan:
    """What :func:`plan` worked out for one output, and what :func:`apply` sets."""

    output: Any
    request: TrackedRequest
    prompt_len: int
    destinations: list[Destination]
    scored: list[Scored]
    gate_started: dict[int, int]
    monitor_state: dict[tuple[int, Any], tuple[int, list[int]]] | None = None
    """The stream's :attr:`Progress.monitor_state` (None: the output is the whole request)."""
    before: dict[int, int] = dataclasses.field(default_factory=dict)
    """Completion index -> tokens earlier outputs of a delta stream already held."""

    def needs(self) -> Iterator[Need]:
        """Every row range to fetch, destinations first (in output order), then flag scores."""
        for destination in self.destinations:
            if destination.need is not None:
                yield destination.need
        for scored in self.scored:
            if scored.flags is not None:
                yield scored.flags


def reset(
    output: Any, request: TrackedRequest | None, processors: Sequence[Any] | None = None
) -> None:
    """Start filling ``output``: every probehook attribute empty (:func:`clear_outputs`), and
    the steering of a steered request noted on each completion."""
    clear_outputs(output, processors)
    if request is not None and (request.steering is not None or request.writes):
        note_steering(output, request.steering, request.writes)


def plan(
    output: Any,
    request: TrackedRequest,
    sources: Sources,
    progress: Progress | None = None,
    attributes: Mapping[str, tuple[str, str]] | None = None,
) -> OutputPlan:
    """The rows ``output`` needs of each of the engine's ``sources`` the request captures.
    ``progress``: what a stream already yielded (advanced here); None: the output is the
    whole request (offline, or a stream's output for the store). ``attributes``:
    :func:`source_attributes`, when the caller has them already."""
    config = request.config
    assert config is not None
    prompt_len = len(output.prompt_token_ids or [])
    started = progress.gate_started if progress is not None else {}
    planned = OutputPlan(output, request, prompt_len, [], [], started)
    if progress is not None and not progress.delta:
        planned.monitor_state = progress.monitor_state
    if attributes is None:
        attributes = source_attributes()
    captured = _sources(request, sources)
    if is_pooled(output):
        # One pass over the input: its rows and scores are prompt rows.
        key = f"{request.tag}/0"
        for source, span in _pooled_spans(captured, prompt_len):
            need = Need(source, key, *span) if span is not None else None
            planned.destinations.append(
                Destination(output, attributes[source][0], source, key, need, None)
            )
        return planned
    delta = progress is not None and progress.delta
    carries_prefill = not delta or not progress.prefill_sent  # type: ignore[union-attr]
    for completion in output.outputs:
        index = completion.index
        before = progress.seen.get(index, 0) if delta else 0  # type: ignore[union-attr]
        total = before + len(completion.token_ids)
        planned.before[index] = before
        if progress is not None:
            progress.seen[index] = total
        # total == 0: an early abort; the output holds nothing computed, so no rows are
        # asked for, but it keeps its shape (every asked layer and probe, 0 rows).
        taken = total > 0
        key = f"{request.tag}/{index}"
        for source, spans_config in captured:
            prefill, decode = completion_spans(spans_config, prompt_len, total, index)
            on_request, on_completion = attributes[source]
            if prefill is not None:
                need = Need(source, key, prefill.lo, prefill.hi)
                wanted = need if carries_prefill and taken else None
                planned.destinations.append(
                    Destination(output, on_request, source, key, wanted, completion)
                )
            if decode is not None:
                # Only the rows of tokens this output adds, in delta mode.
                lo = max(decode.lo, prompt_len - 1 + before)
                need = Need(source, key, lo, decode.hi)
                planned.destinations.append(
                    Destination(completion, on_completion, source, key, need, completion)
                )
            if source == "scores" and taken:
                flags = None
                assert request.probes is not None
                if before and request.probes.monitors and decode is not None and len(decode):
                    flags = Need(source, key, decode.lo, decode.hi)
                planned.scored.append(Scored(completion, before, decode, flags))
        if progress is not None and config.include_prefill and index == 0 and taken:
            progress.prefill_sent = True
    return planned


def apply(planned: OutputPlan, got: Mapping[Need, Any], sources: Sources) -> None:
    """Set what ``planned`` asked for on its output. ``got``: each fetched need's value
    (its source's ``value``) or a :class:`FailedCapture`; a need not in it (an empty range) gets
    0 rows. A failed stream fails every slot of it, and names the reason on
    ``capture_error``. Then flags, stop reason and steering start from the scores."""
    output, request = planned.output, planned.request
    failures: dict[tuple[str, str], FailedCapture] = {}
    for slot in planned.destinations:
        value = got.get(slot.need) if slot.need is not None else None
        if value is None:
            value = sources[slot.source].empty(request)
        elif isinstance(value, FailedCapture) and (slot.source, slot.key) not in failures:
            failures[(slot.source, slot.key)] = value
            logger.error("probehook: %s", value.reason)
        setattr(slot.target, slot.attribute, value)
    for slot in planned.destinations if failures else ():
        failure = failures.get((slot.source, slot.key))
        if failure is not None:  # every slot of a failed stream fails
            setattr(slot.target, slot.attribute, failure)
            slot.target.capture_error = failure.reason
            if slot.completion is not None:
                slot.completion.capture_error = failure.reason
    probes = _probes(sources)
    for scored in planned.scored:
        _act_on_scores(planned, scored, got, probes)
        _gate_start(planned, scored, probes)
    for source, chosen in (request.readouts or {}).items():
        if chosen.monitors:
            _act_on_readout(planned, sources[source].readouts.readout, chosen.monitors)  # type: ignore[attr-defined]
    mirror_first_completion(output)


def _probes(sources: Sources) -> ProbeSet | None:
    source = sources.get("scores")
    return source.probes if source is not None else None  # type: ignore[attr-defined]


@dataclasses.dataclass
class PooledBatch(BatchAsk):
    """The final spans of many pooled outputs from one source and layer set: asked in one
    export (a :class:`~probehook.core.export_wire.BatchAsk`), answered with one tensor
    (:meth:`PooledFill.apply`)."""

    targets: list[tuple[Any, TrackedRequest, str]] = dataclasses.field(default_factory=list)
    """Each item's (output, request, attribute)."""


class PooledFill:
    """:func:`plan` and :func:`apply` for many pooled (one-pass) outputs at once, as an
    offline fill gets them (a pooling batch, the patches of an image): one recipe per request
    shape (:func:`_pooled_spans`, the same :func:`plan` follows for one output), every
    output's spans batched per source and layer set, values cut from one tensor per batch and
    set on the outputs. No :class:`OutputPlan`, :class:`Need` or :class:`Destination` per output:
    a pooled output has no completions, scores to act on or steering."""

    def __init__(self, attributes: Mapping[str, tuple[str, str]], sources: Sources) -> None:
        self.attributes = attributes
        self.sources = sources
        self.batches: dict[tuple[str, tuple[Any, ...]], PooledBatch] = {}
        self.empty: list[tuple[Any, TrackedRequest, str, str]] = []
        """(output, request, attribute, source) of sources an output keeps no rows of."""
        self.filled: list[tuple[Any, TrackedRequest]] = []

    def add(self, output: Any, request: TrackedRequest) -> None:
        """Plan ``output`` (pooled, reset, with a capturing ``request``)."""
        config = request.config
        assert config is not None
        key = f"{request.tag}/0"
        prompt_len = len(output.prompt_token_ids or [])
        for source, span in _pooled_spans(_sources(request, self.sources), prompt_len):
            attribute = self.attributes[source][0]
            if span is None:
                self.empty.append((output, request, attribute, source))
                continue
            layers = tuple(self.sources[source].slots(request))
            batch = self.batches.get((source, layers))
            if batch is None:
                batch = self.batches[(source, layers)] = PooledBatch(source, list(layers))
            batch.keys.append(key)
            batch.spans += span
            batch.targets.append((output, request, attribute))
        self.filled.append((output, request))

    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        reports: Sequence[BatchReport],
        failures: Mapping[str, str],
    ) -> None:
        """Set each output's values from its batch's tensor (``reports``: the export's batch
        reports, in :attr:`batches` order); a failed stream's output gets a
        :class:`FailedCapture` and ``capture_error``."""
        for batch, report in zip(self.batches.values(), reports, strict=True):
            spans = batch.spans
            sizes = [spans[i + 1] - spans[i] for i in range(0, len(spans), 2)]
            requests = [request for _, request, _ in batch.targets]
            tensor = tensors[report.tensor_index]
            rest = tensor.shape[1] - sum(sizes)
            if rest > 0:  # rows past the needs (none in an export's reply): unused
                sizes.append(rest)
            source = self.sources[batch.source]
            values = source.batch_values(batch.layers, tensor, sizes, requests)
            for (output, _, attribute), value in zip(batch.targets, values, strict=True):
                setattr(output, attribute, value)
            for index, key in enumerate(batch.keys) if failures else ():
                reason = failures.get(stream_id(batch.source, key))
                if reason is not None:
                    failure = FailedCapture.of_stream(key, reason)
                    logger.error("probehook: %s", failure.reason)
                    output, _, attribute = batch.targets[index]
                    setattr(output, attribute, failure)
                    output.capture_error = failure.reason
        for output, request, attribute, source in self.empty:
            setattr(output, attribute, self.sources[source].empty(request))
        for output, _ in self.filled:
            mirror_first_completion(output)

    def incomplete(self, reports: Sequence[BatchReport]) -> list[SpanReport]:
        """The export's incomplete batch items, as span reports."""
        broken = []
        for batch, report in zip(self.batches.values(), reports, strict=True):
            for index, num_missing, missing in report.incomplete:
                lo, hi = batch.spans[2 * index], batch.spans[2 * index + 1]
                key = batch.keys[index]
                broken.append(SpanReport(key, batch.source, lo, hi, -1, num_missing, missing))
        return broken


def _sources(request: TrackedRequest, sources: Sources) -> tuple[tuple[str, CaptureConfig], ...]:
    """The sources a request captures, each with the config its spans follow."""
    assert request.config is not None
    return tuple(
        (name, source.spans_of(request.config))
        for name, source in sources.items()
        if source.active(request)
    )


@functools.lru_cache(maxsize=1024)
def _pooled_spans(
    captured: tuple[tuple[str, CaptureConfig], ...], prompt_len: int
) -> tuple[tuple[str, tuple[int, int] | None], ...]:
    """Each source of a pooled output with its prompt rows (None: it keeps none), once per
    distinct request shape: a pooling batch asks it for every output."""
    spans = []
    for source, spans_config in captured:
        prefill, _ = completion_spans(spans_config, prompt_len, 0)
        spans.append((source, (prefill.lo, prefill.hi) if prefill is not None else None))
    return tuple(spans)


def _act_on_scores(
    planned: OutputPlan, scored: Scored, got: Mapping[Need, Any], probes: ProbeSet | None
) -> None:
    """Flags over every score to date (only new crossings when earlier outputs went out); the
    probe's name on ``stop_reason`` when a stop monitor ended the completion."""
    request, completion = planned.request, scored.completion
    assert probes is not None and request.probes is not None
    if not request.probes.monitors or scored.decode is None or len(scored.decode) == 0:
        return
    scores = completion.probe_scores
    if isinstance(scores, FailedCapture):
        return
    if scored.flags is not None:
        scores = got.get(scored.flags)
        if scores is None or isinstance(scores, FailedCapture):
            return
    finished = getattr(planned.output, "finished", True)
    stopped = finished and ended_on_stop_token(request, completion)
    flags, stop_reason = probes.flags_and_stop(request.probes, scores, stopped)
    if scored.before:
        flags = {name: [p for p in where if p >= scored.before] for name, where in flags.items()}
    completion.probe_flags = flags
    if stop_reason is not None:
        completion.stop_reason = stop_reason


def _act_on_readout(planned: OutputPlan, readout: Any, monitors: Sequence[Any]) -> None:
    """A top-k readout's monitors (feature monitors, lens monitors): flags on the readout's
    ``flags_attribute`` and the stop reason (:func:`_act_on_monitors`)."""
    attribute = readout.completion_attributes[0]

    def rows_of(completion: Any) -> Any:
        value = getattr(completion, attribute, None)
        return value if isinstance(value, FailedCapture) or not value else readout.flat(value)

    _act_on_monitors(planned, monitors, rows_of, readout.flags_attribute)


def _act_on_monitors(
    planned: OutputPlan,
    monitors: Sequence[Any],
    rows_of: Callable[[Any], Any],
    flags_attribute: str,
) -> None:
    """The one rule of every top-k monitor (SAE features, lenses): flags (rows of the whole
    decode, only this output's in a delta stream) and the stop reason of a completion a stop
    monitor ended, from the rows at the engine's k (``watched``: the values the worker
    watched, whatever k the request keeps; ``outside`` where the entry is not among them).
    A cumulative stream checks only the rows each output adds."""
    finished = getattr(planned.output, "finished", True)
    for completion in planned.output.outputs:
        rows = rows_of(completion)
        if isinstance(rows, FailedCapture) or not rows:
            continue
        before = planned.before.get(completion.index, 0)
        stopped = finished and ended_on_stop_token(planned.request, completion)
        flags: dict[str, list[int]] = {}
        for monitor in monitors:
            got = rows.get(monitor.instance)  # an SAE's name, a lens's "<lens>@<layer>"
            if got is None or len(got) == 0:
                continue
            watched = got.watched
            if monitor.action == "flag":
                found = _monitor_flags(planned, completion.index, monitor, watched)
                # monitors on one entry share its key: their rows' union (as probe monitors')
                rows_found = {before + i for i in found} | set(flags.get(monitor.key, ()))
                flags[monitor.key] = sorted(rows_found)
            elif (
                stopped
                and not isinstance(completion.stop_reason, str)  # another monitor named it
                and crossings(
                    watched.rows(len(watched) - 1).value_of(monitor.entry, monitor.outside).numpy(),
                    monitor.threshold,
                    monitor.direction,
                )
            ):
                completion.stop_reason = monitor.stop_reason
        setattr(completion, flags_attribute, flags)


def _monitor_flags(planned: OutputPlan, index: int, monitor: Any, watched: Any) -> list[int]:
    """The rows of ``watched`` where a flag monitor's entry (an SAE feature, a lens's token)
    crosses; a cumulative stream's earlier rows come from what it found before
    (:attr:`Progress.monitor_state`)."""
    state = planned.monitor_state
    # keyed by the monitor itself: two monitors on one entry (other thresholds) keep apart
    checked, found = (0, []) if state is None else state.get((index, monitor), (0, []))
    if checked > len(watched):  # not the stream it checked before: start over
        checked, found = 0, []
    values = watched.rows(checked).value_of(monitor.entry, monitor.outside).numpy()
    found = found + [checked + i for i in crossings(values, monitor.threshold, monitor.direction)]
    if state is not None:
        state[(index, monitor)] = (len(watched), found)
    return found


def _gate_start(planned: OutputPlan, scored: Scored, probes: ProbeSet | None) -> None:
    """Where probe-gated steering started: the position after the first decode row that
    crossed, from the same float32 scores the worker watched (remembered across a stream's
    outputs)."""
    steer = planned.request.steering
    if steer is None or not steer.gates or probes is None:
        return
    completion, index = scored.completion, scored.completion.index
    started = planned.gate_started
    if index not in started:
        scores = completion.probe_scores
        gate = steer.gates[0]
        if not isinstance(scores, FailedCapture) and gate.probe in scores:
            first = probes.first_crossing(gate, scores[gate.probe])
            if first is not None:
                started[index] = planned.prompt_len + scored.before + first
    if completion.steering is not None:
        completion.steering["start"] = started.get(index)


# -- the shape of outputs ------------------------------------------------------------------


def attributes_of(source: str, processors: Sequence[Any] | None = None) -> tuple[str, str]:
    """The (request, completion) attributes that rows of capture ``source`` fill: the
    output processor registered for that source decides (``processors``: the registry's,
    when the caller listed them already)."""
    if processors is None:
        processor = OUTPUT_PROCESSORS.for_source(source)
    else:
        processor = next((p for p in processors if p.source == source), None)
        if processor is None:
            processor = OUTPUT_PROCESSORS.for_source(source)  # raises, naming the source
    return processor.request_attributes[0], processor.completion_attributes[0]


def source_attributes(processors: Sequence[Any] | None = None) -> dict[str, tuple[str, str]]:
    """:func:`attributes_of` every capture source (the processors that name one)."""
    listed = OUTPUT_PROCESSORS if processors is None else processors
    return {p.source: attributes_of(p.source, processors) for p in listed if p.source}


def ended_on_stop_token(request: TrackedRequest, completion: Any) -> bool:
    """Whether a finished completion ended on the token a stop monitor forces."""
    return (
        request.stop_token is not None
        and completion.finish_reason == "stop"
        and bool(completion.token_ids)
        and completion.token_ids[-1] == request.stop_token
    )


def note_steering(
    output: Any, steer: RequestSteer | None, writes: Mapping[str, Mapping[str, Any]] | None = None
) -> None:
    """Each completion's ``steering``: the vectors, scales and phase, and ``start``, the first
    steered position (None while a gate has not crossed; :func:`apply` fills it in); and under
    each write-table entry's request option what it applied on every token (``clamp``: the SAE
    features held, ``{sae: {"feature": value}}``; ``Intervention.applied``)."""
    prompt_len = len(output.prompt_token_ids or [])
    if steer is not None:
        start = None if steer.gates else (prompt_len if steer.phase == "decode" else 0)
        described = {**steer.describe(), "start": start}
    else:  # clamped only: every token, prompt and generated
        described = {"vectors": {}, "phase": "both", "start": 0}
    if writes:
        entries = interventions(OUTPUT_PROCESSORS)
        for option, terms in writes.items():
            described[option] = entries[option].applied(terms)
    for completion in output.outputs:
        completion.steering = dict(described)


def clear_outputs(output: Any, processors: Sequence[Any] | None = None) -> None:
    """Every probehook attribute exists on every output, empty until filled (also on the
    outputs of an engine without capture, so code works either way). ``processors``: the
    registry's processors, when the caller listed them already."""
    listed = completions(output)
    for processor in OUTPUT_PROCESSORS if processors is None else processors:
        for attribute in processor.request_attributes:
            setattr(output, attribute, processor.empty())
        for completion in listed:
            for attribute in processor.completion_attributes:
                setattr(completion, attribute, processor.empty())
    mirror_first_completion(output)
    output.store_id = None
    output.processor_errors = {}


def mirror_first_completion(output: Any) -> None:
    """Each capture source's completion attributes on the request output too
    (``output.hidden_states``, ``probe_scores``, ``sae_features``, ...): the first
    completion's; for a pooling output, which reads its input in one pass, its (prompt)
    values. Driven by the output processors that read a capture source, so a new readout's
    attributes are mirrored with no edit here."""
    pooled = is_pooled(output)
    first = None if pooled or not output.outputs else output.outputs[0]
    for processor in _captured_processors():
        for on_request, on_completion in zip(
            processor.request_attributes, processor.completion_attributes, strict=False
        ):
            if pooled:
                value = getattr(output, on_request)
            else:
                value = getattr(first, on_completion) if first is not None else {}
            setattr(output, on_completion, value)


def _captured_processors() -> list[Any]:
    """The registered output processors that read a capture source."""
    return [p for p in OUTPUT_PROCESSORS if p.source]


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
