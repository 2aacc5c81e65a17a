"""vLLM's IO Processor plugin ``probehook``: runs the model's one-pass output processor.

vLLM 0.32 selects one IO Processor plugin per engine (``--io-processor-plugin probehook`` or
``"io_processor_plugin": "probehook"`` in the model's config.json) and calls it for
``LLM.encode({"data": ...}, pooling_task="plugin")`` and ``POST /pooling``. This bridge finds the
:class:`~probehook.outputs.registry.OnePassProcessor` attached to the engine's model class
(``@OUTPUT_PROCESSORS.for_model``) and hands it vLLM's calls; it re-implements none of vLLM's
plumbing.

Two gaps of the interface are bridged here (see docs/outputs.md): ``post_process`` gets no
handle on what ``pre_process`` made of the input, so the parsed input is kept by request id
until then; and nothing says whether a call is offline or online except the request id, which
vLLM passes online only.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from vllm.plugins.io_processors.interface import IOProcessor
from vllm.pooling_params import PoolingParams

from probehook.outputs import OUTPUT_PROCESSORS, OutputProcessorError
from probehook.outputs.registry import OnePassProcessor

logger = logging.getLogger(__name__)

PLUGIN_NAME = "probehook"
MAX_WAITING = 1024  # parsed inputs kept for post_process (requests in flight)
OFFLINE = "<offline>"  # vLLM passes no request id offline


def plugin_class() -> str:
    """Entry point of vLLM's ``vllm.io_processor_plugins`` group: the bridge's class."""
    return f"{__name__}.OutputProcessorBridge"


class OutputProcessorBridge(IOProcessor):
    def __init__(self, vllm_config: Any, renderer: Any) -> None:
        super().__init__(vllm_config, renderer)
        from vllm.model_executor.models.registry import ModelRegistry

        model_config = vllm_config.model_config
        model_cls, arch = ModelRegistry.resolve_model_cls(
            model_config.architectures, model_config=model_config
        )
        processor = OUTPUT_PROCESSORS.for_model_class(model_cls)
        if not isinstance(processor, OnePassProcessor):
            raise OutputProcessorError(
                f"--io-processor-plugin {PLUGIN_NAME} runs the one-pass output processor of the "
                f"model class, but {arch} has {processor or 'none'}. Attach one with "
                "@OUTPUT_PROCESSORS.for_model(name) (a OnePassProcessor subclass)."
            )
        self.processor: OnePassProcessor = processor
        # Parsed inputs waiting for post_process. A request that fails in between never comes
        # back for its entry, so the oldest are dropped beyond MAX_WAITING.
        self._parsed: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def parse_data(self, data: object) -> Any:
        return data  # parsed in pre_process, which knows whether the call is online

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        params = params or PoolingParams()
        if params.task in (None, "plugin"):
            params.task = self.processor.pooling_task
        return params

    def pre_process(
        self, prompt: Any, request_id: str | None = None, **kwargs: Any
    ) -> Sequence[dict[str, Any]]:
        parsed = self.processor.parse(prompt, online=request_id is not None)
        prompts = self.processor.split(parsed)
        with self._lock:
            self._parsed[request_id or OFFLINE] = parsed
            while len(self._parsed) > MAX_WAITING:
                self._parsed.popitem(last=False)
        return prompts

    def post_process(
        self, model_output: Sequence[Any], request_id: str | None = None, **kwargs: Any
    ) -> Any:
        with self._lock:
            parsed = self._parsed.pop(request_id or OFFLINE, None)
        name = self.processor.name
        if parsed is None:
            raise OutputProcessorError(
                f"output processor {name!r}: no input was pre-processed for request "
                f"{request_id or '(offline)'}."
            )
        try:
            result = self.processor.assemble(parsed, list(model_output))
            return self.processor.to_response(result) if request_id is not None else result
        except Exception as exc:
            ids = [getattr(o, "request_id", "?") for o in model_output]
            message = (
                f"output processor {name!r} failed on request {request_id or '(offline)'} "
                f"(engine requests {ids[:4]}{'...' if len(ids) > 4 else ''}): "
                f"{type(exc).__name__}: {exc}"
            )
            logger.error("probehook: %s", message)
            raise OutputProcessorError(message) from exc
