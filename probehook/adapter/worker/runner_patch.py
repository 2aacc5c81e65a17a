"""The patch of vLLM's V1 model runner that drives the step hook: ``execute_model`` arms it
(and counts steps), ``_model_forward`` (the batch order and query offsets of the step are final
there, and warm-up does not pass it) calls the steering and clamp tables' ``before_forward``,
and ``_sample`` hands the step's sampled tokens to ``after_sample`` (readouts that read each
row's next token record there)."""

from __future__ import annotations

import time
from typing import Any


def patch_runner(runner: Any, hook: Any) -> None:
    """Wrap ``runner.execute_model`` and ``runner._model_forward`` for ``hook`` (a
    :class:`~probehook.adapter.worker.step_hook.StepHook`: its callbacks are read at each
    call, so they may be replaced later)."""
    original = runner.execute_model
    scheduled_now: list[Any] = [None]

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        scheduled = args[0] if args else kwargs.get("scheduler_output")
        scheduled_now[0] = scheduled
        if hook.on_schedule is not None and scheduled is not None:
            hook.on_schedule(scheduled)
        if getattr(scheduled, "total_num_scheduled_tokens", 0) > 0:
            hook.forwards += 1
        hook.armed = True
        hook.recorded_step = False
        started = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            hook.armed = False
            scheduled_now[0] = None
            hook.steps += 1
            hook.step_ns += time.perf_counter_ns() - started

    runner.execute_model = execute_model
    # The V1 runner's override point for the forward call (``_model_forward``): the batch
    # order and query offsets of this step are final there, and warm-up does not pass it.
    model_forward = runner._model_forward

    def _model_forward(*args: Any, **kwargs: Any) -> Any:
        if hook.before_forward is not None and scheduled_now[0] is not None:
            hook.before_forward(scheduled_now[0])
        return model_forward(*args, **kwargs)

    runner._model_forward = _model_forward
    # The V1 runner's sampling call (``_sample``, in ``sample_tokens``): the step's sampled
    # tokens are known there, and the batch and the tap buffers are still this step's.
    sample = runner._sample

    def _sample(*args: Any, **kwargs: Any) -> Any:
        output = sample(*args, **kwargs)
        if hook.recorded_step:
            hook.recorded_step = False
            if hook.after_sample is not None:
                hook.after_sample(output.sampled_token_ids)
        return output

    runner._sample = _sample
