"""``probehook.AsyncLLM``: vLLM's v1 ``AsyncLLM`` whose streamed outputs carry the rows and
probe scores of the tokens yielded so far.

Rows travel on the streaming data plane (``probehook.core.stream_frames``): the worker pushes
each step's rows of streaming requests to a socket this front end binds, before the step's
tokens leave the engine, and :class:`~probehook.frontend.request_stream.RequestStream` fills
each output with them after it leaves vLLM's per-request queue (attributes set earlier would
be lost when a lagging DELTA consumer's outputs are merged). No RPC per step: vLLM serves RPCs
between engine steps, so one per step would stall generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm import PoolingParams, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import BeamSearchParams, RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM as VllmAsyncLLM
from vllm.v1.executor import Executor

from probehook.adapter.frontend import cpu_memory, engine_config, outputs, setup
from probehook.adapter.frontend.prompts import with_cache_salt
from probehook.adapter.frontend.sweep_params import noise_write, sweep_params
from probehook.capture_config import CaptureConfig
from probehook.errors import CaptureConfigError
from probehook.frontend import capture_request
from probehook.frontend.fill import clear_outputs, reset
from probehook.frontend.patch_sweep import PairedSweep
from probehook.frontend.probe_set import ProbeSet
from probehook.frontend.request_stream import Kind, RequestStream
from probehook.frontend.session import CaptureSession, marked, options_of
from probehook.frontend.stream_receiver import Receiver
from probehook.frontend.tracked_request import TrackedRequest
from probehook.store import ActivationStore

BEAM_SEARCH_REFUSED = (
    "Beam search is not supported on a capturing engine: vLLM runs it as one-token requests "
    "that recompute the prefix each step, so rows would not belong to the final beams (and "
    "vLLM's beam allow-lists are unsafe on the V1 runner that capture uses). Use an engine "
    "built with layers=None and no probes for beam search."
)
KINDS: dict[Any, Kind] = {
    RequestOutputKind.CUMULATIVE: "cumulative",
    RequestOutputKind.DELTA: "delta",
    RequestOutputKind.FINAL_ONLY: "final",
}


class AsyncLLM(VllmAsyncLLM):
    """Drop-in ``vllm.v1.engine.async_llm.AsyncLLM`` with residual-stream capture and probes.

    ``AsyncLLM(model, layers=..., probes=..., monitors=..., store=..., **engine_args)`` takes
    the capture arguments of :class:`probehook.LLM` and any ``AsyncEngineArgs`` field;
    :meth:`from_engine_args` takes an ``AsyncEngineArgs``. Every output that
    :meth:`generate` yields carries ``hidden_states`` / ``probe_scores`` / ``probe_flags``
    (and ``prefill_*``) for the tokens it holds, with the offline ``LLM``'s row semantics,
    following the request's ``output_kind``: CUMULATIVE (vLLM's default) all rows to date,
    DELTA only the new rows, FINAL_ONLY everything once.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        vllm_config: Any = None,
        **kwargs: Any,
    ) -> None:
        # The capture arguments are declared once, as CaptureRequest's fields (the
        # signature below shows them); everything else is vLLM's.
        self.capture_config: CaptureConfig | None = None
        self.session: CaptureSession | None = None
        self.store: ActivationStore | None = None
        self.store_thread: ThreadPoolExecutor | None = None
        """The one thread that adds to and flushes the store (None without a store)."""
        self.probes: ProbeSet | None = None
        self._receiver: Receiver | None = None
        self._capturing: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}  # by request id, while generating
        self._inline_ready: dict[str, asyncio.Future] = {}  # inline vectors being added
        self.capture_unmarked = True
        """Capture requests that carry no probehook options with the engine's defaults. The
        server sets False: only requests that opt in capture (its pooling routes: none)."""
        if vllm_config is not None:  # vLLM's own constructor path: a plain engine
            given = [name for name in capture_request.CAPTURE_ARGUMENTS if name in kwargs]
            if model is not None or given:
                raise CaptureConfigError(
                    "AsyncLLM(vllm_config=...) builds a plain vLLM engine; for capture pass "
                    "model=... with layers/probes, or use AsyncLLM.from_engine_args(args, "
                    "layers=...)."
                )
            super().__init__(vllm_config=vllm_config, **kwargs)
            return
        if model is None:
            raise CaptureConfigError("AsyncLLM needs model= (a name or a local directory).")
        if "capture_only" in kwargs:
            raise CaptureConfigError(
                f"AsyncLLM(capture_only={kwargs['capture_only']!r}): capture-only engines are "
                "built by the offline front end. Use probehook.LLM(..., capture_only=True) and "
                "llm.capture(prompts), or probehook.collect / `probehook capture --capture-only` "
                "for a resumable collection (docs/collect.md)."
            )
        request = capture_request.take_capture_arguments(kwargs)
        model = os.fspath(model)
        self._model = model
        engine_kwargs, start = _split_start_kwargs(kwargs)
        engine_kwargs = cpu_memory.size_for_cpu(
            model, engine_kwargs, _resolve, request.worker_bytes()
        )
        if not request.captures:
            self._start_engine(engine_config.engine_args(model, engine_kwargs, True), start)
            return
        with engine_config.capture_engine_start():
            plan = setup.prepare(model, engine_kwargs, request, _resolve)
            assert plan is not None
            args = engine_config.engine_args(model, plan.engine_kwargs, True)
            self._start_engine(args, start)
        engine_config.pin_v1_runner(self.vllm_config)  # the workers run V1 for its whole life
        self._plan = plan
        self.capture_config, self.probes = plan.config, plan.probes

    def _start_engine(self, args: AsyncEngineArgs, start: dict[str, Any]) -> None:
        usage = start.pop("usage_context", UsageContext.ENGINE_CONTEXT)
        vllm_config = args.create_engine_config(usage)
        super().__init__(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_requests=args.enable_log_requests,
            log_stats=not args.disable_log_stats,
            usage_context=usage,
            **start,
        )

    @classmethod
    def from_engine_args(  # type: ignore[override]
        cls,
        engine_args: AsyncEngineArgs,
        start_engine_loop: bool = True,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        stat_loggers: list[Any] | None = None,
        **capture: Any,
    ) -> AsyncLLM:
        """vLLM's ``from_engine_args``, plus the capture keyword arguments of ``AsyncLLM``."""
        fields = {
            f.name: getattr(engine_args, f.name)
            for f in dataclasses.fields(engine_args)
            if f.name != "model" and getattr(engine_args, f.name) != _default(f)
        }
        return cls(
            engine_args.model,
            **capture,
            **fields,
            start_engine_loop=start_engine_loop,
            usage_context=usage_context,
            stat_loggers=stat_loggers,
        )

    # -- capture start-up: the workers are reached through async RPC, so on first use -----

    async def start_capture(self) -> None:
        """Start capture on the workers now instead of on the first request (a server does
        this at start-up, so that it can check requests before they reach the engine)."""
        await self._ensure_capturing()

    @property
    def readout_options(self) -> dict[str, str]:
        """The request option of each top-k readout the engine has -> its source."""
        return self.session.readout_options if self.session is not None else {}

    def check_request(self, params: SamplingParams | PoolingParams) -> TrackedRequest | None:
        """What ``params`` would capture (None: nothing), or :class:`CaptureConfigError` for
        bad per-request options; nothing reaches the engine. Call :meth:`start_capture`
        first."""
        options = options_of(params, self.readout_options)
        if self.session is None:
            if hasattr(self, "_plan"):
                raise CaptureConfigError("check_request: call await start_capture() first.")
            asked = options.asked()
            if asked:
                raise CaptureConfigError(
                    f"This engine captures nothing (no layers, no probes), so the request's "
                    f"probehook options {sorted(asked)} cannot be served; start it with "
                    "layers=... or probes=...."
                )
            return None
        return self.session.describe(self.session.tag(params, stream=True))

    async def _ensure_capturing(self) -> None:
        if self.session is not None or not hasattr(self, "_plan"):
            return
        if self._capturing is None:
            self._capturing = asyncio.ensure_future(self._start_capture())
        starting = self._capturing
        try:
            await asyncio.shield(starting)
        except BaseException:
            if starting.done() and self._capturing is starting:
                self._capturing = None  # it failed (and cleaned up): the next request retries
            raise

    async def _start_capture(self) -> None:
        plan = self._plan
        infos = await self.collective_rpc("probehook_start_recording", args=plan.recording_args())
        capture, info, store = setup.start(
            plan,
            self._model,
            infos,
            rpc=_no_sync_rpc,
            abort=lambda ids: None,  # streams abort through AsyncLLM.abort
            stop_token=setup.eos_token(self.get_tokenizer),
        )
        closers = [capture.close] + ([store.close] if store is not None else [])
        try:
            receiver = Receiver(capture.spool.dirs[0])
            closers.insert(0, receiver.close)
            await self.collective_rpc("probehook_stream_connect", args=(receiver.address,))
        except BaseException:
            # Nothing of a failed start stays open: the receiver's thread, the spool, the
            # store's writer and its lock.
            for close in closers:
                with contextlib.suppress(Exception):
                    close()
            raise
        self.capture_info: dict[str, Any] = info
        """Layers, hidden size, dtype and model runner class of the tapped worker."""
        self.session, self.store, self._receiver = capture, store, receiver
        if store is not None:
            # The store's disk waits (backpressure, fsync) never run on the event loop: adds
            # and the server's periodic flush run on this one thread, in order.
            self.store_thread = ThreadPoolExecutor(1, thread_name_prefix="probehook-store-adds")
            closers.insert(-1, self.store_thread.shutdown)  # before the store closes
        # Finalizers, not __del__: they also run at interpreter exit, before modules go.
        self._closers = [weakref.finalize(self, close) for close in closers]

    # -- the request path -------------------------------------------------------------------

    async def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """vLLM's ``generate``; ``request_id`` is optional (a fresh one when omitted), and every
        output carries the rows and scores of the tokens it holds."""
        if isinstance(sampling_params, BeamSearchParams) and hasattr(self, "_plan"):
            raise CaptureConfigError(BEAM_SEARCH_REFUSED)
        params = sampling_params if sampling_params is not None else SamplingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        async for output in self._captured(super().generate, prompt, params, request_id, kwargs):
            yield output

    async def patch_sweep(
        self, *, on_cell: Callable[[int, int, float, int], Any] | None = None, **kwargs: Any
    ) -> Any:
        """:meth:`probehook.LLM.patch_sweep` on the running engine: the clean run, the corrupt
        run alone, then every cell and the corrupt run as concurrent requests; ``on_cell(layer,
        position, value, pair)`` is called as each cell finishes (a coroutine function is
        awaited; ``pair``: its pair's index, 0 with one pair).
        Returns the :class:`~probehook.PatchSweep`."""
        await self._ensure_capturing()
        if self.session is None:
            raise CaptureConfigError("patch_sweep needs an engine built with patching=True.")
        tokenizer = self.get_tokenizer()

        def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        sweep = PairedSweep(self.session.writes, tokenize, lambda t: tokenizer.decode([t]),
                            **kwargs)  # fmt: skip

        async def one(request: tuple[list[int], dict[str, Any], list[int]]) -> Any:
            final = None
            async for output in self.generate({"prompt_token_ids": request[0]},
                                              sweep_params(request[1], request[2])):  # fmt: skip
                final = output
            return final

        async def every(requests: list[Any]) -> list[Any]:
            return await asyncio.gather(*(one(r) for r in requests))

        for plan in sweep.plans:  # corruption by noise: its rows into the banks first
            if plan.noise is not None:
                stats = await self.collective_rpc("probehook_embedding_stats")
                await self.collective_rpc("probehook_patch_rows", args=noise_write(plan, stats))
        clean = await every(sweep.clean_requests())
        sweep.set_ends(clean, await every(sweep.corrupt_requests()))
        requests = sweep.cell_requests()

        async def cell(k: int) -> Any:
            out = await one(requests[k])
            pair, at = sweep.locate(k)
            if at and on_cell is not None:  # at 0: the pair's corrupt run in the batch
                plan = sweep.plans[pair]
                layer, position = plan.cell_of(at - 1)
                called = on_cell(layer, position, plan.value(out), pair)
                if inspect.isawaitable(called):
                    await called
            return out

        return sweep.result(await asyncio.gather(*(cell(k) for k in range(len(requests)))))

    async def encode(  # type: ignore[override]
        self,
        prompt: Any,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """vLLM's ``encode`` for pooling models; the (single, final) output carries
        ``hidden_states`` and ``probe_scores``: one row per input token."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        async for output in self._captured(super().encode, prompt, params, request_id, kwargs):
            yield output

    async def _captured(
        self, run: Any, prompt: Any, params: Any, request_id: str, kwargs: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """One request through vLLM's ``run`` (generate or encode), tagged for capture; every
        output it yields gets its rows and scores."""
        await self._ensure_capturing()
        plain = not self.capture_unmarked and not marked(params)
        if plain or self.session is None or not isinstance(params, SamplingParams | PoolingParams):
            async for output in run(prompt, params, request_id, **kwargs):
                clear_outputs(output)
                outputs.decorate(output)
                yield output
            return
        assert self._receiver is not None
        tagged = self.session.tag(params, stream=True)
        tracked = self.session.describe(tagged)
        prompt = with_cache_salt(prompt, self.session.cache_salt(tagged))
        kind = KINDS[params.output_kind]
        captures = tracked is not None and tracked.config is not None
        stream = (
            RequestStream(self.session, self._receiver, tracked, kind, self.store_thread)
            if captures
            else None
        )
        if stream is not None:
            self._streams[request_id] = stream
            self._receiver.expect(stream.request.tag)
        steering = self.session.steering
        held = steering.hold(tracked.steering) if steering and tracked and tracked.steering else []
        try:
            async for output in run(prompt, tagged, request_id, **kwargs):
                if stream is not None:
                    await stream.fill(output)
                else:
                    reset(output, tracked)  # steered, nothing captured: empty, with steering
                outputs.decorate(output)
                yield output
        finally:
            self._streams.pop(request_id, None)
            if held:
                steering.release(held)  # type: ignore[union-attr]
            if tracked is not None:
                self._receiver.drop(tracked.tag)

    # -- steering ---------------------------------------------------------------------------

    @property
    def steering(self) -> dict[str, Any]:
        """The engine's steering vectors by name (a copy)."""
        steering = self._steering_set()
        return dict(steering.vectors) if steering is not None else {}

    def steering_info(self) -> dict[str, Any]:
        """The steered layers, the bank's capacity and its vectors (for ``GET
        /v1/probehook``); empty layers and vectors when the engine does not steer."""
        steering = self._steering_set()
        if steering is None:
            return {"layers": [], "capacity": 0, "vectors": {}}
        return steering.describe()

    def _steering_set(self) -> Any:
        # Built with the plan, before the workers attach; the session holds the same object.
        plan = getattr(self, "_plan", None)
        return plan.steering if plan is not None else None

    async def add_steering(self, name: str, vector: Any) -> None:
        """Put ``vector`` in the engine's bank under ``name`` while it runs (no restart, no
        recompilation); see :meth:`probehook.LLM.add_steering`."""
        await self._ensure_capturing()
        steering = setup.steering_of(self.session)
        wire = steering.add(name, vector)
        try:
            await self.collective_rpc("probehook_steering_add", args=(name, wire))
        except BaseException:
            steering.remove(name)
            raise

    async def acquire_inline_steering(self, vector: Any) -> str:
        """Put a vector sent in a request body into the bank (or count one more user of the
        same one); returns its bank name. Release it with :meth:`release_inline_steering`."""
        await self._ensure_capturing()
        steering = setup.steering_of(self.session)
        name, wire = steering.acquire_inline(vector)
        ready = self._inline_ready
        if wire is None:
            try:
                await asyncio.shield(ready[name])  # another request is adding the same one
            except BaseException:
                steering.release_inline(name)
                raise
            return name
        ready[name] = asyncio.get_running_loop().create_future()
        try:
            await self.collective_rpc("probehook_steering_add", args=(name, wire))
        except BaseException as e:
            steering.release_inline(name)
            ready.pop(name).set_exception(e)
            raise
        ready[name].set_result(None)
        return name

    async def release_inline_steering(self, name: str) -> None:
        if setup.steering_of(self.session).release_inline(name):
            self._inline_ready.pop(name, None)
            await self.collective_rpc("probehook_steering_remove", args=(name,))

    async def remove_steering(self, name: str) -> None:
        """Take a vector out of the bank; requests that name it afterwards are refused."""
        await self._ensure_capturing()
        setup.steering_of(self.session).remove(name)
        await self.collective_rpc("probehook_steering_remove", args=(name,))

    # -- life cycle -------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine; make stored requests durable."""
        if getattr(self, "_shut_down", False):
            return  # vLLM's __del__ calls this again, maybe while the interpreter exits
        self._shut_down = True
        for close in getattr(self, "_closers", ()):
            close()  # each runs once
        super().shutdown(timeout)
        _close_sockets_of_idle_loop(getattr(self, "engine_core", None))

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    async def stats(self) -> dict[str, Any]:
        """The worker's and this front end's capture counters (tests, debugging)."""
        await self._ensure_capturing()
        worker = next((r for r in await self.collective_rpc("probehook_stats") if r), {})
        return {
            **worker,
            "front_end_streams": self._receiver.pending_streams if self._receiver else 0,
            "front_end_requests": len(self._streams),
        }


def _close_sockets_of_idle_loop(engine_core: Any) -> None:
    """Close vLLM's client sockets when ``shutdown`` ran outside their event loop and that loop
    is not running (a script's ``run_until_complete``, a fixture's teardown).

    vLLM 0.32 queues the close on the owning loop with ``call_soon_threadsafe``
    (``core_client.py:541``); a loop that never runs again leaves the sockets open, and the
    ZeroMQ context behind them then blocks, forever, whichever thread garbage-collects it
    (``Context.term`` waits for open sockets). vLLM closes them directly when the loop is
    already closed; an idle loop gets the same here. A loop running in another thread still
    closes them itself."""
    resources = getattr(engine_core, "resources", None)
    task = getattr(resources, "output_queue_task", None)
    if task is None:
        return  # no loop ever owned them: vLLM closed them directly
    loop = task.get_loop()
    if loop.is_running() or loop.is_closed():
        return
    for name in (
        "output_socket",
        "input_socket",
        "first_req_send_socket",
        "first_req_rcv_socket",
        "stats_update_socket",
    ):
        sock = getattr(resources, name, None)
        if sock is not None and not sock.closed:
            sock.close(linger=0)
    for pending in (task, getattr(resources, "stats_update_task", None)):
        if pending is not None and not pending.done():
            pending.cancel()


def _resolve(model: str, kwargs: dict[str, Any]) -> Any:
    return engine_config.engine_args(model, kwargs, True).create_engine_config(
        UsageContext.ENGINE_CONTEXT
    )


START_KWARGS = ("start_engine_loop", "usage_context", "stat_loggers")


def _split_start_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Engine arguments, and the arguments of ``AsyncLLM.__init__`` itself."""
    start = {k: kwargs[k] for k in START_KWARGS if k in kwargs and kwargs[k] is not None}
    return {k: v for k, v in kwargs.items() if k not in START_KWARGS}, start


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _no_sync_rpc(method: str, args: tuple) -> list:
    raise RuntimeError(f"AsyncLLM's capture session has no synchronous RPC ({method}).")


AsyncLLM.__init__.__signature__ = capture_request.front_end_signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                          annotation="str | None"),
    ],
    refused=("capture_only",),
)  # fmt: skip
