"""Every use of vLLM internals lives here, so a vLLM upgrade touches one file.

Extension points used (all public in vLLM 0.32):
- ``register_model_loader``: the ``probehook`` load format wraps the user's own loader and
  installs the taps after the weights are loaded and before vLLM compiles the model.
- ``vllm.general_plugins`` entry point (``probehook._vllm_plugin``): registers that loader in
  every vLLM process.
- ``worker_extension_cls`` + ``collective_rpc``: control messages to the workers.
- ``additional_config``: carries the capture config to the workers and into vLLM's compile
  cache hash, so graphs compiled with different taps (or none) are never shared.
- ``SamplingParams.extra_args``: per-request capture options.

Internal details read here (version-sensitive): the runner's persistent batch (request order,
query offsets, computed-token counts) at the end of each forward pass, the runner's request
states, and the offline ``LLM``'s request-adding and engine-loop methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from probehook.capture_config import EXTRA_ARGS_KEY, INTERNAL_KEYS, CaptureConfig
from probehook.errors import UnsupportedModelError
from probehook.recorder import RequestPlan, StepRecorder, keep_interval
from probehook.tap_op import tap

logger = logging.getLogger(__name__)

LOAD_FORMAT = "probehook"
"""The load format probehook.LLM selects; it wraps the user's own load format."""
LOADER_EXTRA_KEY = "probehook_inner_load_format"
"""Key in ``model_loader_extra_config`` naming the user's load format."""
ADDITIONAL_CONFIG_KEY = "probehook"
"""Key in ``additional_config`` holding the engine's CaptureConfig."""
RECORDER_ATTR = "probehook_recorder"

# Where decoder layers live, per model family. Paths are relative to the vLLM model.
LAYER_PATHS: tuple[str, ...] = (
    "model.layers",  # Llama, Mistral, Qwen2, Qwen3, Gemma, Phi3, ...
    "model.decoder.layers",  # OPT
    "transformer.h",  # GPT-2, GPT-J, Bloom
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "language_model.model.layers",  # multimodal wrappers
    "model.language_model.layers",
)
SUPPORTED_FAMILIES = "Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT, GPT-NeoX and similar"


# --- loading: taps go in before compilation ------------------------------------------------


def register_loader() -> None:
    """Register the ``probehook`` load format (idempotent; called in every vLLM process)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not None:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_make_loader_class())


def _make_loader_class() -> type:
    from vllm.model_executor.model_loader import BaseModelLoader, get_model_loader

    class ProbehookModelLoader(BaseModelLoader):
        """Loads with the user's loader, then installs capture taps on the decoder layers."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            inner_format = extra.pop(LOADER_EXTRA_KEY, None)
            if inner_format is None:
                raise UnsupportedModelError(
                    f"load_format={LOAD_FORMAT!r} is reserved for probehook.LLM; pass your "
                    "own load_format to probehook.LLM instead."
                )
            self.inner = get_model_loader(
                replace(load_config, load_format=inner_format, model_loader_extra_config=extra)
            )

        def download_model(self, model_config: Any) -> None:
            self.inner.download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            self.inner.load_weights(model, model_config)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            model = self.inner.load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
            settings = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
            if settings is None:
                raise UnsupportedModelError(
                    "The probehook loader ran without a capture config; build the engine "
                    "with probehook.LLM."
                )
            install_taps(
                model,
                CaptureConfig.from_dict(settings),
                vllm_config.scheduler_config.max_num_batched_tokens,
            )
            return model

    return ProbehookModelLoader


def locate_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the decoder layer list of a vLLM model, or say which families are supported."""
    for path in LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return path, obj
    raise UnsupportedModelError(
        f"Cannot find the decoder layers of {type(model).__name__}: none of "
        f"{list(LAYER_PATHS)} is a layer list. probehook supports {SUPPORTED_FAMILIES} "
        "models; open an issue with the architecture name to add yours."
    )


def _split_layer_output(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Most vLLM decoder layers return (hidden, residual) with the add deferred to the next
    # norm; GPT-2/OPT-style layers return the finished stream.
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, tuple) and len(output) == 2:
        return output[0], output[1]
    raise UnsupportedModelError(
        f"Unexpected decoder-layer output {type(output).__name__}; expected a tensor or a "
        "(hidden, residual) pair."
    )


def install_taps(model: nn.Module, config: CaptureConfig, max_tokens: int) -> StepRecorder:
    """Add a tap after each captured layer and a per-step hook; return the recorder."""
    _, layer_list = locate_layers(model)
    if max(config.layers) >= len(layer_list):
        raise UnsupportedModelError(
            f"layers {list(config.layers)} asked for, but the model has {len(layer_list)} "
            "decoder layers in this worker (pipeline parallelism is not supported)."
        )
    param = next(model.parameters())
    hidden_size = _hidden_size(model)
    buffers = []
    for layer_index in config.layers:
        layer = layer_list[layer_index]
        buf = torch.zeros((max_tokens, hidden_size), dtype=param.dtype, device=param.device)
        # A non-persistent buffer is part of the module, so torch.compile sees the mutation.
        layer.register_buffer("probehook_tap_out", buf, persistent=False)
        layer.register_forward_hook(_tap_hook)
        buffers.append(layer.probehook_tap_out)
    recorder = StepRecorder(buffers, config.layers)
    recorder.config = config  # type: ignore[attr-defined]
    recorder.on_step = None  # type: ignore[attr-defined]  # set by attach_runner()
    setattr(model, RECORDER_ATTR, recorder)
    _install_step_hook(model, recorder)
    logger.info(
        "probehook: tapped layers %s (hidden %d, %s)", list(config.layers), hidden_size, param.dtype
    )
    return recorder


def _tap_hook(module: nn.Module, args: Any, output: Any) -> None:
    hidden, residual = _split_layer_output(output)
    tap(hidden, residual, module.probehook_tap_out)


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise UnsupportedModelError(f"Cannot read the hidden size of {type(model).__name__}.")


def _install_step_hook(model: nn.Module, recorder: StepRecorder) -> None:
    # compute_logits runs eagerly once per step right after the forward pass, outside
    # torch.compile and CUDA graphs, while the runner still holds this step's batch.
    original = model.compute_logits

    def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_step = recorder.on_step  # type: ignore[attr-defined]
        if on_step is not None:
            on_step()
        return original(hidden_states, *args, **kwargs)

    model.compute_logits = compute_logits


# --- per step ------------------------------------------------------------------------------


def record_step(runner: Any, recorder: StepRecorder, plan_for: Callable[[str], Any]) -> None:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    if num_reqs == 0:
        return
    recorder.record(
        batch.req_ids[:num_reqs],
        runner.query_start_loc.np[: num_reqs + 1],
        batch.num_computed_tokens_cpu[:num_reqs],
        plan_for,
    )


def _plan_factory(runner: Any, engine_config: CaptureConfig) -> Callable[[str], Any]:
    def plan_for(req_id: str) -> RequestPlan | None:
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        if not extra or "key" not in extra:
            return None  # not submitted through probehook.LLM: nobody will collect it
        options = {k: v for k, v in extra.items() if k not in INTERNAL_KEYS}
        config = engine_config.narrow(options)
        if config is None:
            return None
        if state.prompt_token_ids is not None:
            prompt_len = len(state.prompt_token_ids)
        else:
            prompt_len = int(state.prompt_embeds.shape[0])
        index = req_id.split("_", 1)[0] if extra.get("n", 1) > 1 else "0"
        lo, hi = keep_interval(config, prompt_len)
        return RequestPlan(key=f"{extra['key']}/{index}", req_id=req_id, lo=lo, hi=hi)

    return plan_for


# --- worker side of the RPCs ----------------------------------------------------------------


def worker_recorder(worker: Any) -> StepRecorder | None:
    """The recorder of this worker, or None on ranks that do not collect (TP rank > 0)."""
    model = worker.model_runner.get_model()
    recorder = getattr(model, RECORDER_ATTR, None)
    if recorder is None:
        raise UnsupportedModelError(
            "This worker's model has no probehook taps: the probehook vLLM plugin did not "
            "load (is VLLM_PLUGINS set without 'probehook'?)."
        )
    if getattr(worker, "rank", 0) != 0:
        return None
    return recorder


def attach_runner(worker: Any, recorder: StepRecorder) -> None:
    # Steps before this point (profiling, compile warm-up) are not requests' rows.
    runner = worker.model_runner
    plan_for = _plan_factory(runner, recorder.config)  # type: ignore[attr-defined]
    recorder.on_step = lambda: record_step(runner, recorder, plan_for)  # type: ignore


def live_request_ids(worker: Any) -> set[str]:
    return set(worker.model_runner.requests)


# --- front end: the offline LLM's request path ---------------------------------------------


class OfflineCaptureHooks:
    """Mixin for ``vllm.LLM`` routing every request and every finished output through
    ``_probehook_tag`` / ``_probehook_attach`` (defined by ``probehook.LLM``)."""

    def _add_request(self, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> str:
        params = self._probehook_tag(params)  # type: ignore[attr-defined]
        request_id = super()._add_request(prompt, params, *args, **kwargs)  # type: ignore[misc]
        self._probehook_register(external_request_id(request_id), params)  # type: ignore
        return request_id

    def _run_engine(self, output_type: Any, *, use_tqdm: Any = True) -> list[Any]:
        # vLLM's offline loop, plus: finished outputs get their rows (and go to the store)
        # in the step they finish, not after the whole batch.
        from tqdm.auto import tqdm

        finished: list[tuple[int, Any]] = []
        pbar = None
        if use_tqdm:
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            pbar = make_bar(
                total=self.llm_engine.get_num_unfinished_requests(),
                desc="Processed prompts",
                dynamic_ncols=True,
            )
        try:
            while self.llm_engine.has_unfinished_requests():
                done = [o for o in self.llm_engine.step() if o.finished]
                if not done:
                    continue
                for output in done:
                    if not isinstance(output, output_type):
                        raise TypeError(f"Expected {output_type}, got {type(output).__name__}")
                    finished.append((int(output.request_id), output))
                self._probehook_attach(done)  # type: ignore[attr-defined]
                if pbar is not None:
                    pbar.update(sum(len(getattr(o, "outputs", [None])) for o in done))
            self._probehook_finish()  # type: ignore[attr-defined]
        except BaseException:
            self._probehook_discard()  # type: ignore[attr-defined]
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [output for _, output in sorted(finished, key=lambda item: item[0])]


def external_request_id(internal_id: str) -> str:
    """The id a RequestOutput carries, from the one ``LLMEngine.add_request`` returns.

    vLLM appends ``-<8 hex chars>`` to make internal ids unique (unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set).
    """
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return internal_id
