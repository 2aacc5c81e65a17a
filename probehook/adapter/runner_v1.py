"""Reading vLLM's V1 model runner (``v1/worker/gpu_model_runner.py``; the CPU runner subclasses
it) at the end of each forward pass: request order, query offsets, computed-token counts and
each request's sampling params.

Model Runner V2 (the default of CUDA builds with Triton) keeps none of these attributes;
``probehook`` selects V1 at construction (``engine_config.v1_runner``) and this module
refuses anything else with a clear error instead of an ``AttributeError`` mid-generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from probehook.capture_config import EXTRA_ARGS_KEY, CaptureConfig, capture_options
from probehook.core.recorder import RequestPlan, StepRecorder
from probehook.core.spans import keep_plan, score_config
from probehook.errors import CaptureConfigError

REQUIRED = ("input_batch", "requests", "query_start_loc")
PlanFor = Callable[[str], RequestPlan | None]


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


def record_step(runner: Any, recorders: Sequence[tuple[StepRecorder, PlanFor]]) -> None:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    if num_reqs == 0:
        return
    req_ids = batch.req_ids[:num_reqs]
    query_start = runner.query_start_loc.np[: num_reqs + 1]
    computed = batch.num_computed_tokens_cpu[:num_reqs]
    for recorder, plan_for in recorders:
        recorder.record(req_ids, query_start, computed, plan_for)


def plan_factory(runner: Any, engine_config: CaptureConfig, scores: bool = False) -> PlanFor:
    """Builds the keep plan of a request the first time a recorder sees it: its hidden rows,
    or with ``scores`` its probe scores."""

    def plan_for(req_id: str) -> RequestPlan | None:
        state = runner.requests.get(req_id)
        params = request_params(state)
        extra = extra_options(params).get(EXTRA_ARGS_KEY)
        if not extra or "tag" not in extra:
            return None  # not submitted through probehook: nobody will collect it
        if scores and not extra.get("probes"):
            return None  # the front end lists the probes a request gets; none here
        config = engine_config.narrow(capture_options(extra))
        if config is None or (not scores and not config.layers):
            return None
        prompt_len = state.num_prompt_tokens  # also counts prompts given as embeddings
        # vLLM names the engine requests of n > 1 "<index>_<id>".
        index = int(req_id.split("_", 1)[0]) if extra.get("n", 1) > 1 else 0
        stream = bool(extra.get("stream"))
        if scores:
            keep = keep_plan(score_config(config), prompt_len, index, end_known_in_worker=True)
        else:
            # Stop strings are matched in the front end, possibly steps after the worker
            # computed further positions; everything else that ends a request is decided in
            # the engine. A stream sends each row as it is computed, before the end is known.
            end_known = not getattr(params, "stop", None) and not stream
            keep = keep_plan(config, prompt_len, index, end_known)
        layers = None if scores else config.layers
        return RequestPlan(f"{extra['tag']}/{index}", keep, stream, layers)

    return plan_for


def request_params(state: Any) -> Any:
    """A request's SamplingParams, or its PoolingParams for a pooling model."""
    params = getattr(state, "sampling_params", None)
    return params if params is not None else getattr(state, "pooling_params", None)


def extra_options(params: Any) -> dict[str, Any]:
    """The free-form per-request dict vLLM carries to the worker: ``SamplingParams.extra_args``
    or ``PoolingParams.extra_kwargs``."""
    extra = getattr(params, "extra_args", None)
    if extra is None:
        extra = getattr(params, "extra_kwargs", None)
    return extra or {}


def live_request_ids(runner: Any) -> set[str]:
    return set(runner.requests)
