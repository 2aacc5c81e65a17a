"""Reading vLLM's V1 model runner (``v1/worker/gpu_model_runner.py``; the CPU runner subclasses
it) at the end of each forward pass: request order, query offsets, computed-token counts and
each request's sampling params.

Model Runner V2 (the default of CUDA builds with Triton) keeps none of these attributes;
``probehook`` selects V1 at construction (``engine_config.capture_engine_start``) and this module
refuses anything else with a clear error instead of an ``AttributeError`` mid-generation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from probehook.capture_config import CaptureConfig
from probehook.core.request_options import (
    EXTRA_ARGS_KEY,
    RequestWire,
    extra_field,
    raw_tag,
)
from probehook.core.spans import OPEN, KeepPlan, keep_plan, readout_config, score_config
from probehook.errors import CaptureConfigError
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.top_k_readout import top_k_readouts
from probehook.worker.readouts import READOUTS
from probehook.worker.recorder import RequestPlan, StepRecorder
from probehook.worker.steering_bank import Gate, RequestSteering, StepSteering, phase_range
from probehook.worker.step_context import StepContext
from probehook.worker.write_table import StepWrites

REQUIRED = ("input_batch", "requests", "query_start_loc")
PlanFor = Callable[[str], RequestPlan | None]
logger = logging.getLogger(__name__)


def check_runner(runner: Any) -> None:
    """Fail clearly when the worker runs a model runner probehook cannot read."""
    missing = [name for name in REQUIRED if not hasattr(runner, name)]
    if missing:
        raise CaptureConfigError(
            f"probehook reads vLLM's V1 model runner, but this worker runs "
            f"{type(runner).__module__}.{type(runner).__name__} (no {', '.join(missing)}): "
            "Model Runner V2 is not supported yet. Unset VLLM_USE_V2_MODEL_RUNNER (probehook "
            "then selects V1) or pass layers=None."
        )


def hand_hook_to_processors(runner: Any, hook: Any) -> None:
    """Give the step hook to this runner's probehook stop processors (vLLM builds logits
    processors from the config alone: the runner's persistent batch is where they live)."""
    from probehook.adapter.worker.monitor_processor import ProbeStopProcessor

    for processor in runner.input_batch.logitsprocs.all:
        if isinstance(processor, ProbeStopProcessor):
            processor.hook = hook


def step_context(runner: Any, sampled: torch.Tensor | None = None) -> StepContext:
    """This step's :class:`~probehook.worker.step_context.StepContext`, from the V1 runner's
    batch (``sampled``: after sampling, the step's sampled tokens in batch order)."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    return StepContext(
        tuple(batch.req_ids[:num_reqs]),
        runner.query_start_loc.np[: num_reqs + 1],
        batch.num_computed_tokens_cpu[:num_reqs],
        batch.token_ids_cpu,
        batch.num_tokens_no_spec[:num_reqs],
        runner.device,
        sampled,
        {"attention": attention_reader(runner)},
        functools.partial(request_terms, runner),
    )


def request_terms(runner: Any, batch_row: int, source: str) -> Mapping[str, Any] | None:
    """``StepContext.request_terms``: what the request at ``batch_row`` asks of top-k readout
    ``source``'s rows beyond its instances (its wire's ``readout_terms``, JSON the front end
    checked), None where nothing."""
    state = runner.requests.get(runner.input_batch.req_ids[batch_row])
    raw = extra_options(request_params(state)).get(EXTRA_ARGS_KEY) if state is not None else None
    terms = raw.get("readout_terms") if isinstance(raw, Mapping) else None
    return terms.get(source) if isinstance(terms, Mapping) else None


def attention_reader(runner: Any) -> AttentionReader:
    """The runner's :class:`AttentionReader` (one a runner: it holds the layers' attention
    modules once found)."""
    reader = getattr(runner, "_probehook_attention_reader", None)
    if reader is None:
        reader = runner._probehook_attention_reader = AttentionReader(runner)
    return reader


class AttentionReader:
    """``StepContext.parts["attention"]``: what an attention readout reads of decoder layer
    ``layer`` beyond its query rows, from the runner: a batch request's keys from the layer's
    paged cache (``keys``) and the kernel's terms (``terms``). The layers' attention modules
    are found once per runner."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._found: list[Any] | None = None
        self._terms: dict[int, Any] = {}

    def attention(self, layer: int) -> Any:
        if self._found is None:
            from probehook.adapter.worker.kv_cache import attention_of
            from probehook.adapter.worker.surgery import locate_layers

            self._found = [attention_of(m) for m in locate_layers(self.runner.get_model())[1]]
        return self._found[layer]

    def keys(self, layer: int, batch_row: Any, positions: torch.Tensor) -> torch.Tensor:
        """The keys at ``positions`` of one batch request (``[n]``), or of a list of them
        (``[R, n]`` positions; ``kv_cache.request_keys``)."""
        from probehook.adapter.worker.kv_cache import request_keys

        return request_keys(self.runner, self.attention(layer), batch_row, positions)

    def terms(self, layer: int) -> Any:
        terms = self._terms.get(layer)
        if terms is None:
            from probehook.adapter.worker.kv_cache import attention_terms

            terms = self._terms[layer] = attention_terms(self.attention(layer))
        return terms


def record_step(
    runner: Any,
    recorders: Sequence[tuple[StepRecorder, PlanFor]],
    defer: bool = False,
) -> None:
    """Record this step's rows. Recorders whose transform ``reads_next_token`` get each row's
    next token from the step's context (the batch's known tokens, -1 at a request's newest
    position, whose token is drawn after this); with ``defer`` they hold the step's rows for
    :func:`complete_step`, which fills those once sampling drew them (a pooling model
    samples nothing: not deferred)."""
    if runner.input_batch.num_reqs == 0:
        return
    context = step_context(runner)
    for recorder, plan_for in recorders:
        reads = getattr(recorder.transform, "reads_next_token", False)
        steps = reads or getattr(recorder.transform, "reads_step", False)
        recorder.record(context.req_ids, context.query_start, context.computed, plan_for,
                        context if steps else None, defer=reads and defer)  # fmt: skip


def complete_step(
    runner: Any, recorders: Sequence[tuple[StepRecorder, PlanFor]], sampled: torch.Tensor
) -> None:
    """Complete the deferred step of each recorder (:func:`record_step`) with the step's
    sampled tokens (``[num_reqs, >= 1]`` in batch order)."""
    context = step_context(runner, sampled)
    for recorder, _ in recorders:
        recorder.complete(context)


def prepare_steering(
    runner: Any, steering: StepSteering, plan_for: Callable[[str], RequestSteering | None]
) -> None:
    """Write this step's steering index (called right before the forward pass)."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    if num_reqs == 0:
        return
    steering.prepare(
        batch.req_ids[:num_reqs],
        runner.query_start_loc.np[: num_reqs + 1],
        batch.num_computed_tokens_cpu[:num_reqs],
        plan_for,
    )


def prepare_writes(
    runner: Any, writes: StepWrites, terms_for: Callable[[str], Mapping[str, Any] | None]
) -> None:
    """Write this step's write-table indexes and rows (called right before the forward
    pass)."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    if num_reqs == 0:
        return
    writes.prepare(batch.req_ids[:num_reqs], runner.query_start_loc.np[: num_reqs + 1], terms_for,
                   batch.num_computed_tokens_cpu[:num_reqs])  # fmt: skip


def writes_factory(runner: Any) -> Callable[[str], Mapping[str, Any] | None]:
    """Reads a request's write terms (``RequestWire.writes``) the first time the worker sees
    it; raises on a wire it cannot read (:class:`StepWrites` fails that request alone)."""

    def terms_for(req_id: str) -> Mapping[str, Any] | None:
        state = runner.requests.get(req_id)
        wire = RequestWire.from_wire(extra_options(request_params(state)).get(EXTRA_ARGS_KEY))
        return wire.writes if wire is not None else None

    return terms_for


def steering_factory(
    runner: Any, known: Callable[[str], bool]
) -> Callable[[str], RequestSteering | None]:
    """Reads a request's steering the first time the worker sees it. Never raises (it runs
    in the step): a request whose steering cannot be read is not steered, with a warning (the
    front end checked it, so only a wire that skipped the front end gets here)."""

    def plan_for(req_id: str) -> RequestSteering | None:
        try:
            state = runner.requests.get(req_id)
            wire = RequestWire.from_wire(extra_options(request_params(state)).get(EXTRA_ARGS_KEY))
            if wire is None:
                return None
            gates = [m for m in wire.monitors if m.monitor.action == "steer"]
            if not wire.steer and not gates:
                return None
            prompt_len = state.num_prompt_tokens
            if gates:
                monitor = gates[0].monitor
                terms = monitor.steer
                lo, hi = None, OPEN
                gate = Gate(gates[0].column, monitor.threshold, monitor.direction)
            else:
                terms, gate = wire.steer, None
                lo, hi = phase_range(wire.steer_phase, prompt_len)
            unknown = unsteerable(wire, known)
            if unknown:
                raise CaptureConfigError(f"unknown steering vector(s) {unknown}")
            return RequestSteering(tuple(terms), lo, hi, prompt_len, gate)
        except Exception as e:  # noqa: BLE001 - one bad request must not end the engine
            logger.warning("probehook: not steering request %s: %s", req_id, e)
            return None

    return plan_for


def unsteerable(wire: RequestWire, known: Callable[[str], bool]) -> list[str]:
    """The vectors a request's steering (its own, or a gate's) names that the bank lacks."""
    terms = list(wire.steer or ())
    for gate in wire.monitors:
        if gate.monitor.action == "steer":
            terms += list(gate.monitor.steer or ())
    return sorted({name for name, _ in terms if not known(name)})


def plan_factory(
    runner: Any,
    engine_config: CaptureConfig,
    source: str = "hidden",
    steerable: Callable[[str], bool] | None = None,
    slots: Sequence[Any] = (),
    stops_only: bool = False,
) -> PlanFor:
    """Builds the keep plan of a request the first time a recorder of ``source`` sees it:
    its hidden rows, its probe ``"scores"`` or a top-k readout's rows (``slots``: the
    instances the recorder computes: SAEs, lens instances). Never raises: it runs inside
    the step hook, where an exception ends the engine for every request, so a request
    whose options cannot be read gets a failed capture (its outputs carry the reason) and
    the others go on. ``steerable``
    (a steering engine's bank): a request that names a vector the bank lacks runs unsteered,
    so its capture fails too, naming them. ``stops_only``: keep only the requests whose stop
    monitors read this source in the sampler (a rank that answers no export)."""

    def plan_for(req_id: str) -> RequestPlan | None:
        raw = None
        try:
            state = runner.requests.get(req_id)
            params = request_params(state)
            raw = extra_options(params).get(EXTRA_ARGS_KEY)
            if stops_only and not _stops_on(raw, source):
                return None
            return _plan(req_id, state, params, raw, engine_config, source, steerable, slots)
        except Exception as e:  # noqa: BLE001 - one bad request must not end the engine
            return _failed_plan(req_id, raw, source, f"{type(e).__name__}: {e}")

    return plan_for


def _stops_on(raw: Any, source: str) -> bool:
    """Whether a request's wire has a stop monitor that reads ``source`` (a top-k readout's
    rows: SAE features) in the sampler."""
    wire = RequestWire.from_wire(raw)
    if wire is None:
        return False
    return any(m.action == "stop" and m.source == source for m, _ in wire.readout_monitors)


BUILT_IN_SOURCES = tuple(READOUTS)
"""Sources with a row of their own in the readout table; every other is a top-k readout's,
listed under the wire's ``readouts``."""
SOURCE_KEYS = {r.source: r.wire_key for r in READOUTS.values() if r.wire_key is not None}
"""The wire key that lists what a request gets of a transform source (the readout table's)."""


def _plan(
    req_id: str,
    state: Any,
    params: Any,
    raw: Any,
    engine_config: CaptureConfig,
    source: str,
    steerable: Callable[[str], bool] | None = None,
    slots: Sequence[Any] = (),
) -> RequestPlan | None:
    wire = RequestWire.from_wire(raw)
    if wire is None:
        return None  # not submitted through probehook: nobody will collect it
    unknown = unsteerable(wire, steerable) if steerable is not None else []
    if unknown:
        raise CaptureConfigError(
            f"it names steering vector(s) {unknown}, which the engine's bank does not hold, "
            "so it ran unsteered"
        )
    transformed = source != "hidden"
    if source == "scores" and not wire.probes:
        return None  # the front end lists the probes a request gets; none here
    instances = wire.readout(source) if source not in BUILT_IN_SOURCES else None
    if instances is not None and not instances:
        return None  # a top-k readout the request does not ask for
    if instances and not set(instances) <= set(slots):
        raise CaptureConfigError(
            f"it asks for {source} readout(s) {sorted(set(instances) - set(slots))}, which the "
            f"engine does not have (its {source} readouts: {list(slots)})"
        )
    # The front end narrowed the config; narrowing it again checks that it names only layers
    # this engine taps (a wire that skipped the front end may not).
    config = engine_config.narrow(wire.config.to_dict())
    if config is None or (not transformed and not config.layers):
        return None
    prompt_len = state.num_prompt_tokens  # also counts prompts given as embeddings
    index = completion_index(req_id, wire.n)
    if transformed:
        # A score or a feature list is a few bytes: every token of the request's phases.
        spans = score_config(config)
        if instances:  # a top-k readout's: its last-prompt-token rule
            spans = readout_config(config, _follows_last_prefill_token(source))
        keep = keep_plan(spans, prompt_len, index, end_known_in_worker=True)
    else:
        # Stop strings are matched in the front end, possibly steps after the worker
        # computed further positions; everything else that ends a request is decided in
        # the engine. A stream sends each row as it is computed, before the end is known.
        end_known = not getattr(params, "stop", None) and not wire.stream
        keep = keep_plan(config, prompt_len, index, end_known)
    layers = config.layers if source == "hidden" else instances
    one_pass = getattr(state, "sampling_params", None) is None  # a pooling request
    return RequestPlan(f"{wire.tag}/{index}", keep, wire.stream, layers, one_pass=one_pass)


def _follows_last_prefill_token(source: str) -> bool:
    readout = top_k_readouts(OUTPUT_PROCESSORS).get(source)
    return bool(readout is not None and readout.follows_last_prefill_token)


def _failed_plan(req_id: str, raw: Any, source: str, error: str) -> RequestPlan | None:
    """A plan that keeps nothing and fails the request's capture under its stream key (None
    when the options carry no usable tag, or ask nothing of ``source``: then no front end
    collects it)."""
    tag = raw_tag(raw)
    key = SOURCE_KEYS.get(source)
    asked = isinstance(raw, Mapping) and (
        raw.get(key) if key is not None or source == "hidden" else _asks_readout(raw, source)
    )
    if tag is None or (source != "hidden" and not asked):
        logger.warning("probehook: ignoring request %s with unreadable options: %s", req_id, error)
        return None
    reason = f"the worker could not read this request's probehook options ({error})"
    logger.warning("probehook: capture of request %s failed: %s", req_id, reason)
    n = raw.get("n") if isinstance(raw, Mapping) else None
    index = completion_index(req_id, n if isinstance(n, int) and n > 0 else 2)
    stream = isinstance(raw, Mapping) and raw.get("stream") is True
    return RequestPlan(f"{tag}/{index}", KeepPlan(None, None), stream, error=reason)


def _asks_readout(raw: Mapping[str, Any], source: str) -> bool:
    readouts = raw.get("readouts")
    return isinstance(readouts, Mapping) and bool(readouts.get(source))


def completion_index(req_id: str, n: int) -> int:
    """vLLM names the engine requests of n > 1 ``"<index>_<id>"``."""
    if n <= 1 or "_" not in req_id:
        return 0
    head = req_id.split("_", 1)[0]
    return int(head) if head.isdigit() else 0


def request_params(state: Any) -> Any:
    """A request's SamplingParams, or its PoolingParams for a pooling model."""
    params = getattr(state, "sampling_params", None)
    return params if params is not None else getattr(state, "pooling_params", None)


def extra_options(params: Any) -> dict[str, Any]:
    """The free-form per-request dict vLLM carries to the worker: ``SamplingParams.extra_args``
    or ``PoolingParams.extra_kwargs``."""
    return getattr(params, extra_field(params), None) or {}


def live_request_ids(runner: Any) -> set[str]:
    return set(runner.requests)
