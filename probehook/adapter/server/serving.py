"""vLLM's OpenAI completion and chat handlers, returning probehook's per-choice field.

:func:`install` swaps the class of the handlers vLLM's ``init_app_state`` built (so vLLM's
constructor arguments are not repeated here) for subclasses that:

- read the request body's ``probehook`` object, check it against the engine (unknown layers or
  probes, malformed options, a response over the size cap: a 400 before generation), and pass
  it to the engine in ``SamplingParams.extra_args``; a request without it captures nothing;
- add the ``probehook`` field (``probehook.frontend.response_fields``) to each choice of a response,
  and to each chunk choice of a stream with the rows of that chunk's own tokens. vLLM's stream
  generators consume one engine output and yield its chunks before pulling the next, so
  recording each output as it is pulled pairs rows with chunks exactly.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

from probehook.core.request_options import EXTRA_ARGS_KEY, RECORD_KEY
from probehook.core.transport import DTYPES
from probehook.errors import CaptureConfigError
from probehook.frontend.response_fields import (
    FIELD,
    ChoiceFields,
    TokenText,
    features_bytes_bound,
    request_options,
    response_bytes_bound,
)
from probehook.frontend.steering_set import INLINE_PREFIX

MiB = 1 << 20


class CaptureServing:
    """What the completion and chat handlers share: option checks and the size cap."""

    max_response_bytes: int = 64 * MiB
    capture_default: dict[str, Any] | None = None
    """The server's ``--capture-default``: the options of a request whose body has no
    ``probehook`` object (None: such a request captures nothing). A request's own object
    wins; ``{}`` opts out."""

    allow_inline_steering: bool = False
    """``--allow-inline-steering``: requests may send their own vectors (``steer_vectors``)."""

    compact: bool = False
    """``--sae-encoding base64``: processors with a compact form (SAE features) use it."""

    def _fields(self) -> ChoiceFields:
        return ChoiceFields(compact=self.compact, token_text=self._token_text())

    def _token_text(self) -> TokenText | None:
        """The engine's token texts (one cache per server; None without a tokenizer)."""
        text = getattr(self, "_token_text_cache", None)
        if text is None:
            tokenizer = getattr(self.engine_client, "tokenizer", None)  # type: ignore[attr-defined]
            if tokenizer is None:
                return None
            text = self._token_text_cache = TokenText(tokenizer)
        return text

    async def _run(self, request: Any, prompts: int, run: Callable[[], Awaitable[Any]]) -> Any:
        """Check the request (400 when bad), put its inline vectors in the bank, run it, and
        take them out when it is done (a stream: when its generator ends)."""
        try:
            names = await self._acquire_inline(request)
        except CaptureConfigError as e:
            return self._refuse(str(e))
        engine: Any = self.engine_client  # type: ignore[attr-defined]
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                for name in names:
                    await engine.release_inline_steering(name)

        request.probehook_release = release
        error = self._prepare(request, prompts)
        if error is not None:
            await release()
            return error
        try:
            result = await run()
        except BaseException:
            await release()
            raise
        if not inspect.isasyncgen(result):
            await release()
        else:  # a stream releases when its generator ends, or is dropped without starting
            _release_when_dropped(result, release)
        return result

    async def _acquire_inline(self, request: Any) -> list[str]:
        """A body's ``steer_vectors`` ``{name: {layer: [floats]}}`` as bank vectors, its
        ``steer`` renamed to their bank names; refused unless the server allows them."""
        asked = (request.model_extra or {}).get(FIELD)
        if not isinstance(asked, dict) or "steer_vectors" not in asked:
            return []
        engine: Any = self.engine_client  # type: ignore[attr-defined]
        own = [name for name in sorted(engine.steering) if not name.startswith(INLINE_PREFIX)]
        if not self.allow_inline_steering:
            raise CaptureConfigError(
                "probehook option steer_vectors (vectors sent in the request) is off on this "
                "server; start it with --allow-inline-steering, or steer with its vectors "
                f"{own}."
            )
        inline = inline_vectors(asked["steer_vectors"], own)
        names: list[str] = []
        renamed: dict[str, str] = {}
        try:
            for name, vector in inline.items():
                renamed[name] = await engine.acquire_inline_steering(vector)
                names.append(renamed[name])
        except BaseException:
            for name in names:
                await engine.release_inline_steering(name)
            raise
        options = {k: v for k, v in asked.items() if k != "steer_vectors"}
        if isinstance(options.get("steer"), dict):
            options["steer"] = {renamed.get(k, k): v for k, v in options["steer"].items()}
        request.model_extra[FIELD] = options
        return names

    def _prepare(self, request: Any, prompts: int) -> Any:
        """Put the request's probehook options into its ``vllm_xargs``; an error response
        (400) when they are bad, None when the request may go on."""
        engine: Any = self.engine_client  # type: ignore[attr-defined]
        for key in (EXTRA_ARGS_KEY, RECORD_KEY):  # probehook's own: never from a client
            if key in (request.vllm_xargs or {}):
                return self._refuse(
                    f"vllm_xargs['{key}'] is reserved: put probehook options in a "
                    f'top-level "{FIELD}" object of the request body.'
                )
        try:
            asked = (request.model_extra or {}).get(FIELD)
            options = request_options(
                self.capture_default if asked is None else asked, engine.readout_options
            )
            n = request.n or 1
            tracked = engine.check_request(
                SamplingParams(n=n, extra_args={EXTRA_ARGS_KEY: options})
            )
            if tracked is not None and getattr(request, "use_beam_search", False):
                where = "this server's --capture-default" if asked is None else "the request"
                raise CaptureConfigError(
                    f"use_beam_search cannot be combined with capture (asked for by {where}): "
                    "vLLM runs beam search as one-token requests that recompute the prefix each "
                    "step, so rows and scores would not belong to the final beams. For beam "
                    f'search send "{FIELD}": {{}} (no capture); to capture, drop use_beam_search.'
                )
            if tracked is not None and tracked.config is not None:
                self._check_size(request, tracked, n * prompts)
        except CaptureConfigError as e:
            return self._refuse(str(e))
        except (TypeError, ValueError) as e:  # a malformed value deep in the options
            return self._refuse(f"malformed '{FIELD}' options: {e}")
        request.vllm_xargs = {**(request.vllm_xargs or {}), EXTRA_ARGS_KEY: options}
        request.probehook_wanted = tracked is not None
        return None

    def _check_size(self, request: Any, tracked: Any, completions: int) -> None:
        """The most bytes of hidden states and SAE features the request could return,
        against the cap."""
        config = tracked.config
        info = self.engine_client.capture_info  # type: ignore[attr-defined]
        max_len = self.model_config.max_model_len  # type: ignore[attr-defined]
        max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
        rows = max_len if config.include_prefill or not max_tokens else min(max_tokens, max_len)
        itemsize = DTYPES[info["dtype"]].itemsize
        bound = response_bytes_bound(
            rows * completions, len(config.layers), info["hidden_size"], itemsize
        )
        asked = [f"{len(config.layers)} layer(s)"]
        engine_readouts = self.engine_client.session.readouts  # type: ignore[attr-defined]
        for source, readout in (tracked.readouts or {}).items():  # SAE features, lenses, ...
            kind = engine_readouts[source].readout
            settings = [engine_readouts[source].instances[name] for name in readout.names]
            shapes = [(kind.entries(s, readout.k), kind.packed_width(s, readout.k))
                      for s in settings]  # fmt: skip
            bound += features_bytes_bound(rows * completions, shapes)
            entries = rows * completions * sum(n for n, _ in shapes)
            text = self._token_text() if kind.entries_are_tokens else None
            if text is not None:  # each entry's token text beside its id
                bound += entries * text.json_bytes
            noun = engine_readouts[source].noun
            asked.append(f"{len(readout.names)} {noun}(s) x top-{readout.k}")
        if bound > self.max_response_bytes:
            raise CaptureConfigError(
                f"This request could return up to {bound / MiB:.1f} MiB of hidden states and "
                f"top-k readings ({', '.join(asked)} x {rows} rows x {completions} "
                f"completion(s); {info['hidden_size']} values a row), over this server's cap "
                f"of {self.max_response_bytes / MiB:.1f} MiB (--max-capture-response-mb). Ask "
                "for fewer layers, SAEs, lenses or other readouts, a smaller top-k or "
                "max_tokens, or leave include_prefill off."
            )

    def _refuse(self, message: str) -> Any:
        return self.create_error_response(message, param=FIELD)  # type: ignore[attr-defined]


class CaptureCompletionServing(CaptureServing, OpenAIServingCompletion):
    async def create_completion(self, request: Any, raw_request: Any = None) -> Any:
        prompt = request.prompt
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not _is_ids(prompt) else 1
        return await self._run(
            request,
            prompts,
            lambda: super(CaptureServing, self).create_completion(request, raw_request),
        )

    async def completion_stream_generator(  # type: ignore[override]
        self,
        request: Any,
        engine_inputs: Any,
        result_generator: AsyncIterator,
        *args: Any,
        **kw: Any,
    ) -> AsyncGenerator[str, None]:
        fields = self._fields()
        n = request.n or 1
        source = _recorded(request, result_generator, fields, lambda item: (item[1], item[0] * n))
        stream = super().completion_stream_generator(request, engine_inputs, source, *args, **kw)
        try:
            async for line in stream:
                yield fields.annotate_sse(line)
        finally:
            await _release(request)

    def request_output_to_completion_response(  # type: ignore[override]
        self, final_res_batch: list[Any], *args: Any, **kwargs: Any
    ) -> Any:
        response = super().request_output_to_completion_response(final_res_batch, *args, **kwargs)
        fields = self._fields()
        pairs = [(output, c) for output in final_res_batch for c in output.outputs]
        for index, (output, completion) in enumerate(pairs):  # vLLM numbers choices so
            fields.add(index, output, completion)
        _annotate(response, fields)
        return response


class CaptureChatServing(CaptureServing, OpenAIServingChat):
    async def create_chat_completion(self, request: Any, raw_request: Any = None) -> Any:
        return await self._run(
            request,
            1,
            lambda: super(CaptureServing, self).create_chat_completion(request, raw_request),
        )

    async def chat_completion_stream_generator(  # type: ignore[override]
        self, request: Any, result_generator: AsyncIterator, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[str, None]:
        fields = self._fields()
        source = _recorded(request, result_generator, fields, _single)
        stream = super().chat_completion_stream_generator(request, source, *args, **kwargs)
        try:
            async for line in stream:
                yield fields.annotate_sse(line)
        finally:
            await _release(request)

    async def chat_completion_full_generator(  # type: ignore[override]
        self, request: Any, result_generator: AsyncIterator, *args: Any, **kwargs: Any
    ) -> Any:
        fields = self._fields()
        source = _recorded(request, result_generator, fields, _single)
        response = await super().chat_completion_full_generator(request, source, *args, **kwargs)
        _annotate(response, fields)
        return response


def _release_when_dropped(stream: Any, release: Callable[[], Awaitable[None]]) -> None:
    """A stream never iterated (its client left before the response began) never runs its
    ``finally``: release when the generator is collected. ``release`` runs once, whichever
    comes first."""
    loop = asyncio.get_running_loop()

    def start() -> None:
        task = loop.create_task(release())
        _RELEASING.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(_RELEASING.discard)

    def dropped() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(start)

    weakref.finalize(stream, dropped)


_RELEASING: set[asyncio.Task] = set()


async def _release(request: Any) -> None:
    release = getattr(request, "probehook_release", None)
    if release is not None:
        await release()


MAX_INLINE_VECTORS = 4
"""The most vectors one request body may send."""


def inline_vectors(value: Any, own: list[str]) -> dict[str, Any]:
    """``steer_vectors`` of a request body as :class:`~probehook.SteeringVector` objects
    (shape, finite values, op and the count checked here; the engine checks layers and
    size)."""
    example = '{"mine": {"12": [0.1, ...]}}'
    if not isinstance(value, dict) or not value:
        raise CaptureConfigError(
            f"probehook option steer_vectors must be an object of named vectors such as "
            f"{example}, not {value!r:.80}."
        )
    if len(value) > MAX_INLINE_VECTORS:
        raise CaptureConfigError(
            f"probehook option steer_vectors sends {len(value)} vectors; a request may send "
            f"at most {MAX_INLINE_VECTORS}."
        )
    out = {}
    for name, body in value.items():
        if name in own:
            raise CaptureConfigError(
                f"probehook option steer_vectors names {name!r}, a vector of this server; give "
                "yours another name."
            )
        out[name] = vector_from_json(name, body, f"probehook option steer_vectors[{name!r}]")
    return out


OP_KEYS = ("vectors", "op", "min", "max", "to")
"""The keys of a vector sent with its op (``POST /v1/steering``, ``steer_vectors``)."""


def vector_from_json(name: str, body: Any, where: str) -> Any:
    """A :class:`~probehook.SteeringVector` from JSON: ``{"12": [floats]}`` (an addition), or
    ``{"vectors": {"12": [...]}, "op": "cap", "max": 4.0}`` with an op and its parameters
    (``min``/``max`` for cap; ``to`` the to directions of a swap, whose from directions are
    ``vectors``)."""
    from probehook.steering.vector import SteeringVector

    example = '{"12": [0.1, ...]} or {"vectors": {"12": [0.1, ...]}, "op": "ablate"}'
    if isinstance(body, dict) and "vectors" in body:
        unknown = sorted(set(body) - set(OP_KEYS))
        if unknown:
            raise CaptureConfigError(
                f"{where}: unknown keys {unknown}; the keys are {list(OP_KEYS)}."
            )
        op = body.get("op", "add")
        params = {k: body[k] for k in ("min", "max") if body.get(k) is not None}
        try:
            directions = _layers(body["vectors"], example)
            if op == "swap":
                if "to" not in body:
                    raise CaptureConfigError('a swap needs its to directions ("to").')
                to = SteeringVector(_layers(body["to"], example))
                return SteeringVector.swap(SteeringVector(directions), to, name=name)
            if "to" in body:
                raise CaptureConfigError("only op 'swap' takes to directions.")
            vector = SteeringVector(directions, name=name)
            return vector if op == "add" and not params else vector.with_op(op, **params)
        except CaptureConfigError as e:
            raise CaptureConfigError(f"{where}: {e}") from None
    try:
        return SteeringVector(_layers(body, example), name=name)
    except CaptureConfigError as e:
        raise CaptureConfigError(f"{where}: {e}") from None


def _layers(layers: Any, example: str) -> dict[int, list]:
    if not isinstance(layers, dict) or not all(
        isinstance(v, list)
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
        for v in layers.values()
    ):
        raise CaptureConfigError(f"it must map layers to lists of numbers, such as {example}.")
    try:
        return {int(layer): v for layer, v in layers.items()}
    except ValueError:
        raise CaptureConfigError(f"layers must be integers, got {sorted(layers)}.") from None


def _recorded(
    request: Any,
    items: AsyncIterator[Any],
    fields: ChoiceFields,
    unpack: Callable[[Any], tuple[Any, int]],
) -> AsyncIterator[Any]:
    """``items`` unchanged, each output noted in ``fields`` under its choices' indices as it
    passes (``unpack``: an item's output and its first choice index); ``items`` itself when
    the request asked for nothing."""
    if not getattr(request, "probehook_wanted", False):
        return items

    async def recorded() -> AsyncIterator[Any]:
        async for item in items:
            output, first = unpack(item)
            for completion in output.outputs:
                fields.add(first + completion.index, output, completion)
            yield item

    return recorded()


def _single(output: Any) -> tuple[Any, int]:
    """A chat request's outputs: one prompt, choices numbered by completion index."""
    return output, 0


def _annotate(response: Any, fields: ChoiceFields) -> None:
    for choice in getattr(response, "choices", None) or ():  # an error response has none
        field = fields.take(choice.index)
        if field is not None:
            setattr(choice, FIELD, field)  # an extra field: response models allow them


def _is_ids(prompt: list) -> bool:
    """A completion prompt given as one list of token ids (not a list of prompts)."""
    return isinstance(prompt[0], int)


HANDLERS = {
    "openai_serving_completion": (OpenAIServingCompletion, CaptureCompletionServing),
    "openai_serving_chat": (OpenAIServingChat, CaptureChatServing),
}


def install(
    state: Any,
    max_response_bytes: int,
    capture_default: dict[str, Any] | None = None,
    allow_inline_steering: bool = False,
    compact: bool = False,
) -> list[str]:
    """Give the app's completion, chat and pooling handlers probehook's classes; the names of
    the handlers changed (a generative model has no pooling handlers, a model without a chat
    template no chat handler). ``capture_default`` (``--capture-default``) goes to the
    completion and chat handlers only."""
    from probehook.adapter.server import pooling_serving

    changed = []
    for name, (base, capture_class) in {**HANDLERS, **pooling_serving.handlers()}.items():
        handler = getattr(state, name, None)
        if handler is None:
            continue
        if type(handler) is not base:
            raise TypeError(f"app.state.{name} is a {type(handler)}, not vLLM's {base}")
        handler.__class__ = capture_class
        handler.max_response_bytes = max_response_bytes
        if name in HANDLERS:
            handler.capture_default = capture_default
            handler.allow_inline_steering = allow_inline_steering
            handler.compact = compact
        changed.append(name)
    return changed
