"""vLLM's pooling handlers (``/v1/embeddings``, ``/classify``, ``/pooling``, ``/score``) with
probehook's opt-in per-item field.

As for completions (``adapter/server/serving.py``), :func:`install` swaps the classes of the
handlers vLLM built. A request whose body has a top-level ``probehook`` object gets, on each
item of its ``data``, a ``probehook`` field with the item's per-token rows (``hidden_states``:
layer -> base64 array) and probe scores, from the registered output processors. A request without it
is vLLM's, untouched. Bad options, an answer over the size cap, or a route or format that has
no per-item JSON (``/score``, IO Processor plugin data, ``encoding_format`` bytes) are 400s
before any model work.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from vllm import PoolingParams
from vllm.entrypoints.pooling.classify.serving import ServingClassification
from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
from vllm.entrypoints.pooling.pooling.serving import ServingPooling
from vllm.entrypoints.pooling.scoring.serving import ServingScores

from probehook.core.request_options import EXTRA_ARGS_KEY, RECORD_KEY
from probehook.core.transport import DTYPES
from probehook.errors import CaptureConfigError
from probehook.frontend.response_fields import (
    FIELD,
    PooledFields,
    request_options,
    response_bytes_bound,
)

MiB = 1 << 20


class CapturePooling:
    """What every pooling handler gets: the option check, the size cap, the per-item field.

    Not a base class: vLLM's pooling handlers cannot take a mixin in front of them and still
    accept a ``__class__`` swap (CPython refuses the layout), so :func:`capture_class` builds
    a plain subclass of each with these methods, which call the vLLM class's own explicitly.
    """

    base: type
    max_response_bytes: int = 64 * MiB
    route = "this route"
    per_item = True  # the response's ``data`` is one item per engine input
    refusal: str | None = None  # a route that never takes the field: why (the 400's message)

    async def _init_ctx(self, io_processor: Any, request: Any, raw_request: Any = None) -> Any:
        ctx = await self.base._init_ctx(self, io_processor, request, raw_request)
        ctx.probehook_wanted = False
        asked = (getattr(request, "model_extra", None) or {}).get(FIELD)
        if asked is None:
            return ctx  # opt-in: vLLM's request, untouched
        self._check_route(request)
        try:
            # A pooling model reads its input in one pass: every row is an input row.
            readouts = self.engine_client.readout_options  # type: ignore[attr-defined]
            options = {**request_options(asked, readouts), "include_prefill": True,
                       "include_decode": False}  # fmt: skip
            params: PoolingParams = ctx.pooling_params
            params.extra_kwargs = {**(params.extra_kwargs or {}), EXTRA_ARGS_KEY: options}
            tracked = self.engine_client.check_request(params)  # type: ignore[attr-defined]
        except CaptureConfigError:
            raise  # a ValueError: vLLM answers 400 with its message
        except (TypeError, ValueError) as e:
            raise CaptureConfigError(f"malformed '{FIELD}' options: {e}") from e
        ctx.probehook_wanted = tracked is not None
        ctx.probehook_layers = (
            len(tracked.config.layers) if tracked is not None and tracked.config else 0
        )
        ctx.probehook_plugin = _is_plugin(request)
        ctx.probehook_options = options
        return ctx

    def _check_route(self, request: Any) -> None:
        if self.refusal is not None:
            raise CaptureConfigError(self.refusal)
        if _is_plugin(request):
            if getattr(self.engine_client, "store", None) is None:
                raise CaptureConfigError(
                    f"An IO Processor plugin request answers with the plugin's data only, so its "
                    f"'{FIELD}' rows can only go to the store: start the server with --store "
                    "PATH, or leave the field out."
                )
            return
        if not self.per_item:
            raise CaptureConfigError(
                f"'{FIELD}' fields are not available on {self.route}: its response has no item "
                "per input. Capture these inputs offline (probehook.LLM.score / encode), or "
                "leave the field out."
            )
        if getattr(request, "encoding_format", "float") in ("bytes", "bytes_only"):
            raise CaptureConfigError(
                f"'{FIELD}' fields need a JSON response; use encoding_format 'float' or "
                "'base64', or leave the field out."
            )

    async def _prepare_generators(self, ctx: Any) -> None:
        if getattr(ctx, "probehook_plugin", False) and ctx.probehook_wanted:
            _label_patches(ctx)  # rows go to the store, keyed to this request and the patch
        elif getattr(ctx, "probehook_layers", 0):
            self._check_size(ctx)
        await self.base._prepare_generators(self, ctx)

    def _check_size(self, ctx: Any) -> None:
        """Every input's rows, against the cap, before the engine sees the request."""
        info = self.engine_client.capture_info  # type: ignore[attr-defined]
        max_len = self.model_config.max_model_len  # type: ignore[attr-defined]
        rows = sum(
            len(item["prompts"].get("prompt_token_ids") or ()) or max_len
            if isinstance(item["prompts"], dict)
            else max_len
            for item in ctx.engine_inputs or ()
        )
        layers = ctx.probehook_layers
        bound = response_bytes_bound(
            rows, layers, info["hidden_size"], DTYPES[info["dtype"]].itemsize
        )
        if bound > self.max_response_bytes:
            raise CaptureConfigError(
                f"This request could return up to {bound / MiB:.1f} MiB of hidden states "
                f"({layers} layer(s) x {rows} input tokens x {info['hidden_size']} values), over "
                f"this server's cap of {self.max_response_bytes / MiB:.1f} MiB "
                "(--max-capture-response-mb). Ask for fewer layers or send fewer inputs."
            )

    def _build_response(self, ctx: Any) -> Any:
        response = self.base._build_response(self, ctx)
        json_body = "json" in (getattr(response, "media_type", None) or "")
        if not getattr(ctx, "probehook_wanted", False) or not json_body:
            return response
        body = json.loads(response.body)
        if ctx.probehook_plugin:  # the plugin's data as it is; where the patches' rows went
            body[FIELD] = {"store_ids": [o.store_id for o in ctx.final_res_batch]}
            return JSONResponse(content=body, status_code=response.status_code)
        items = body.get("data")
        if not isinstance(items, list):
            return response  # routes without per-item data are refused in _check_route
        outputs = ctx.final_res_batch
        for position, item in enumerate(items):
            if len(items) != len(outputs):  # the engine split inputs (chunked processing)
                item[FIELD] = {"error": "rows unavailable: vLLM split this input into chunks"}
                continue
            item[FIELD] = PooledFields().of(outputs[item.get("index", position)])
        return JSONResponse(content=body, status_code=response.status_code)  # (or ORJSON's)


def _is_plugin(request: Any) -> bool:
    """An IO Processor plugin request (``/pooling`` with ``data``)."""
    return getattr(request, "data", None) is not None


def _label_patches(ctx: Any) -> None:
    """Each engine input of a plugin request gets its own params whose options name the
    user request and the patch index, for its store record."""
    # (the plugin's merge_pooling_params made these params, without the request's options)
    for index, item in enumerate(ctx.engine_inputs):
        params = item["params"].clone()
        record = {"user_request": ctx.request_id, "patch": index}
        params.extra_kwargs = {
            **(params.extra_kwargs or {}),
            EXTRA_ARGS_KEY: ctx.probehook_options,
            RECORD_KEY: record,
        }
        item["params"] = params


def capture_class(
    base: type, route: str, per_item: bool = True, refusal: str | None = None
) -> type:
    """A subclass of vLLM's pooling handler ``base`` with :class:`CapturePooling`'s methods
    (``refusal``: every request with a ``probehook`` object gets a 400 with this message)."""
    methods = {
        name: value
        for name, value in vars(CapturePooling).items()
        if not name.startswith("__") or name == "__doc__"
    }
    return type(
        f"Capture{base.__name__}",
        (base,),
        {**methods, "base": base, "route": route, "per_item": per_item, "refusal": refusal},
    )


HANDLERS = {
    "serving_embedding": (ServingEmbedding, capture_class(ServingEmbedding, "/v1/embeddings")),
    "serving_classification": (
        ServingClassification,
        capture_class(ServingClassification, "/classify"),
    ),
    "serving_pooling": (ServingPooling, capture_class(ServingPooling, "/pooling")),
    "serving_scores": (ServingScores, capture_class(ServingScores, "/score", per_item=False)),
}

TOKEN_EMBED_REFUSAL = (
    f"'{FIELD}' fields are not available for this token_embed model's /v1/embeddings "
    "(vLLM's ServingTokenEmbedding, new in vLLM 0.33): probehook does not capture through "
    "that handler yet. Capture these inputs offline (probehook.LLM.embed or encode), or leave "
    "the field out."
)


def handlers() -> dict[str, tuple[type, type]]:
    """:data:`HANDLERS`, plus the handlers of the installed vLLM that exist only in some
    versions: 0.33's ``serving_token_embedding``, which refuses the opt-in."""
    from probehook.adapter import vllm_names

    found = dict(HANDLERS)
    token_embedding = vllm_names.resolve("ServingTokenEmbedding")
    if token_embedding is not None:
        found["serving_token_embedding"] = (
            token_embedding,
            capture_class(token_embedding, "/v1/embeddings", refusal=TOKEN_EMBED_REFUSAL),
        )
    return found
