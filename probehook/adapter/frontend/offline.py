"""``probehook.LLM``: vLLM's offline ``LLM`` that also returns residual-stream captures.

The capture logic lives in :class:`~probehook.frontend.session.CaptureSession`; this class only
connects it to the offline request path: ``_add_request`` (tag and register), the engine loop
``_run_engine`` (fill finished outputs with rows; abort everything on an error or Ctrl-C) and
``_render_and_add_requests`` (forget requests of a batch that failed to enter the engine).
"""

from __future__ import annotations

import inspect
import itertools
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import vllm
from vllm import PoolingParams, SamplingParams

from probehook.adapter.frontend import cpu_memory, engine_config, outputs, setup
from probehook.adapter.frontend.engine_death import raise_on_engine_death
from probehook.adapter.frontend.prompts import with_cache_salt
from probehook.adapter.frontend.sweep_params import noise_write, sweep_params
from probehook.capture_config import CaptureConfig
from probehook.core.request_options import EXTRA_ARGS_KEY
from probehook.errors import CaptureConfigError
from probehook.frontend import capture_request
from probehook.frontend.attention_pattern import DEFAULT_MAX_BYTES as DEFAULT_PATTERN_BYTES
from probehook.frontend.attention_pattern import attention_pattern
from probehook.frontend.fill import clear_outputs, copy_captures
from probehook.frontend.item_ids import check_item_ids
from probehook.frontend.patch_sweep import patch_sweep
from probehook.frontend.probe_set import ProbeSet
from probehook.frontend.session import CaptureSession
from probehook.store import ActivationStore


class LLM(vllm.LLM):
    """Drop-in ``vllm.LLM`` that captures the residual stream after chosen decoder layers.

    Args:
        model: model name or local directory (``str`` or any ``os.PathLike``), as for
            ``vllm.LLM``.
        layers: decoder layers to capture: ints in ``0..num_layers-1`` (negative ints count
            from the end, numpy ints work), ``"all"`` or ``["all"]``. ``None`` (default)
            captures nothing.
        include_prefill: return one row per prompt token in
            ``RequestOutput.prefill_hidden_states``.
        include_decode: return one row per generated token in
            ``CompletionOutput.hidden_states``; row ``i`` is the stream at the position whose
            logits produced output token ``i``.
        last_prefill_token: keep only the last prompt row.
        last_decode_token: keep only the last decode row.
        store: a directory (``str`` or ``os.PathLike``); every captured request is streamed
            into an :class:`~probehook.store.ActivationStore` there while generation runs, and
            is durable once ``generate()`` returns. Each stored output gets ``store_id``, its
            key in the store (vLLM's ``request_id`` is left as it is).
        store_options: ``shard_bytes``, ``compression`` ("gzip", "lzf" or None),
            ``max_queue_bytes`` (the write queue bound that applies backpressure) and
            ``lane`` (write a lane of the store, so that several engines write one store at
            once: docs/store.md).
        max_request_capture_bytes: the most bytes of rows the worker keeps for one request
            (0 or None: no limit). A request over it fails alone: its rows raise
            ``CaptureError`` on access and the other requests are unaffected.
        probes: :class:`~probehook.LinearProbe` objects scored inside the engine on every
            token: a dict name -> probe (or path to a saved probe), or a list of named probes.
            Their layers are tapped whether or not ``layers`` names them, and only scores
            leave the worker: ``CompletionOutput.probe_scores[name]`` (one per generated
            token) and, with ``include_prefill``, ``RequestOutput.prefill_probe_scores``.
        monitors: :class:`~probehook.ProbeMonitor` objects applied to every request (requests
            may replace them through ``extra_args``): stop, flag or steer generation on a
            score.
        steering: :class:`~probehook.SteeringVector` objects in the engine's steering bank: a
            dict name -> vector (or path to a saved vector), or a list of named vectors.
            Requests steer with ``extra_args={"probehook": {"steer": {name: scale}}}``.
        steering_layers: more layers to give a steering op (the layers of ``steering``
            always get one), for vectors added later with :meth:`add_steering`. Which layers
            steer is fixed when the model is compiled; the vectors are not.
        steering_capacity: the most vectors the bank holds at once (default 64).
        **readout options**: each registered top-k readout's engine options, by its own
            names. SAE features (:class:`~probehook.SAE`; ``SAEReadout``): SAEs read
            inside the engine on every token, by name (``CompletionOutput.sae_features``),
            with ``sae_top_k`` (default 32), ``sae_clamping`` and ``sae_dtype``; lenses
            (:class:`~probehook.outputs.lens.LensReadout`): ``lenses``, ``lens_layers``,
            ``lens_top_k``, ``lens_dtype``. Each readout's class documents its options.
        capture_only: build a collection engine: :meth:`capture` reads each prompt in one
            forward pass (vLLM's pooling runner; nothing is sampled) and the model stops after
            the deepest layer captured or probed (no later layers, final norm or LM head).
            ``include_prefill`` then defaults to True and ``include_decode`` to False;
            :meth:`generate` is refused. See docs/collect.md.
        **kwargs: passed to ``vllm.LLM`` unchanged.

    Captured rows are CPU tensors in the model dtype, keyed by layer index. The row after
    layer ``L`` equals Hugging Face's ``output_hidden_states[L + 1]``; for the last layer it
    is the stream before the final norm (HF's last entry is after it).
    """

    def __init__(self, model: str | os.PathLike[str], **kwargs: Any) -> None:
        # The capture arguments are declared once, as CaptureRequest's fields (the
        # signature below shows them); everything else is vLLM's.
        model = os.fspath(model)
        request = capture_request.take_capture_arguments(kwargs)
        self.capture_only = request.capture_only
        # capture(): the store record fields of each request it adds, in order
        self._labels: Iterator[dict[str, Any]] | None = None
        self.capture_config: CaptureConfig | None = None
        self.session: CaptureSession | None = None
        self.store: ActivationStore | None = None
        self.probes: ProbeSet | None = None
        self._inputs = itertools.count()  # user inputs split by an IO Processor plugin
        self._pooled: dict[str, Any] = {}  # the last pooling call's outputs, by request id
        kwargs = cpu_memory.size_for_cpu(
            model, kwargs, engine_config.resolve_vllm_config, request.worker_bytes()
        )
        if not request.captures:  # plain vLLM, with the runner vLLM itself chooses
            super().__init__(model=model, **kwargs)
            return
        with engine_config.capture_engine_start():
            plan = setup.prepare(model, kwargs, request, engine_config.resolve_vllm_config)
            assert plan is not None
            super().__init__(model=model, **plan.engine_kwargs)
        engine_config.pin_v1_runner(self.llm_engine.vllm_config)  # its workers run V1
        raise_on_engine_death(self.llm_engine.engine_core)
        self.capture_config, self.probes = plan.config, plan.probes
        infos = self.collective_rpc("probehook_start_recording", args=plan.recording_args())
        # The session's callbacks hold the engine weakly: the finalizers below hold the
        # session, so a callback holding this LLM (or its engine) would keep a dropped LLM's
        # engine, and its processes, alive for good. While the LLM lives, so does its engine.
        engine = weakref.ref(self.llm_engine)
        self.session, self.capture_info, self.store = setup.start(
            plan,
            model,
            infos,
            rpc=lambda method, args: engine().collective_rpc(method, args=args),
            abort=lambda ids: engine().abort_request(ids, internal=True),
            stop_token=setup.eos_token(self.get_tokenizer),
        )
        """Layers, hidden size, dtype and model runner class of the tapped worker."""
        weakref.finalize(self, self.session.close)
        if self.store is not None:
            weakref.finalize(self, self.store.close)

    # -- vLLM's offline request path ------------------------------------------------------

    def _add_request(self, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> str:
        if self.session is None or not isinstance(params, SamplingParams | PoolingParams):
            return super()._add_request(prompt, params, *args, **kwargs)
        params = self.session.tag(params)
        prompt = with_cache_salt(prompt, self.session.cache_salt(params))
        engine_id = super()._add_request(prompt, params, *args, **kwargs)
        request_id = _request_id(engine_id)
        self.session.register(request_id, engine_id, params)
        if self._labels is not None:  # capture(): requests are added in prompt order
            self.session.label(request_id, next(self._labels))
        return engine_id

    def _render_and_add_requests(self, *args: Any, **kwargs: Any) -> list[str]:
        before = set(self.session.pending) if self.session is not None else set()
        try:
            return super()._render_and_add_requests(*args, **kwargs)
        except BaseException:
            # vLLM aborted the requests this call added; forget their rows too.
            if self.session is not None:
                self.session.abandon([r for r in self.session.pending if r not in before])
            raise

    def _run_engine(self, output_type: Any, *, use_tqdm: Any = True) -> list[Any]:
        # vLLM's offline loop, plus: finished outputs get their rows (and go to the store)
        # in the step they finish; an error or Ctrl-C aborts every unfinished request.
        from tqdm.auto import tqdm

        finished: list[tuple[int, Any]] = []
        pbar = None
        try:
            if use_tqdm:
                make_bar = use_tqdm if callable(use_tqdm) else tqdm
                pbar = make_bar(
                    total=self.llm_engine.get_num_unfinished_requests(),
                    desc="Processed prompts",
                    dynamic_ncols=True,
                )
            while self.llm_engine.has_unfinished_requests():
                done = [o for o in self.llm_engine.step() if o.finished]
                if not done:
                    continue
                for output in done:
                    if not isinstance(output, output_type):
                        raise TypeError(f"Expected {output_type}, got {type(output).__name__}")
                finished.extend((int(o.request_id), o) for o in done)
                if self.session is not None:
                    self.session.fill(done)
                else:
                    for output in done:
                        _empty_rows(output)
                if pbar is not None:
                    pbar.update(sum(len(getattr(o, "outputs", [None])) for o in done))
            if self.session is not None:
                # The loop has drained: requests still pending were aborted by the user.
                self.session.abandon(abort=False)
                if self.store is not None:
                    self.store.flush()
        except BaseException:
            self._abort_unfinished()
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [output for _, output in sorted(finished, key=lambda item: item[0])]

    def _run_tiling_engine(self, io_processor: Any, *args: Any, **kwargs: Any) -> list[Any]:
        # vLLM's loop for pooling models (encode, embed, classify, score and IO Processor
        # plugins): every output is finished when it arrives; fill all of them with rows
        # before vLLM post-processes (so a plugin's post_process sees them too).
        try:
            pooled = super()._run_tiling_engine(io_processor, *args, **kwargs)
        except BaseException:
            self._abort_unfinished()
            raise
        if self.session is None:
            for output in pooled:
                _empty_rows(output)
            return pooled
        if getattr(io_processor, "io_processor", None) is not None:
            # An IO Processor plugin split one user input into these requests (patches):
            # the store keeps each one's rows keyed to the input and its index.
            user_request = f"input-{next(self._inputs)}"
            for index, output in enumerate(pooled):
                self.session.label(
                    output.request_id, {"user_request": user_request, "patch": index}
                )
        try:
            self.session.fill(pooled)
        finally:
            self.session.abandon(abort=False)
        if self.store is not None:
            self.store.flush()
        self._pooled = {output.request_id: output for output in pooled}
        return pooled

    # -- capture-only engines ------------------------------------------------------------------

    def capture(
        self,
        prompts: Any,
        ids: Sequence[Any] | None = None,
        *,
        use_tqdm: Any = True,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Read each prompt in one forward pass and return its prompt rows; nothing is sampled.

        Needs an engine built with ``capture_only=True``. Each output (one per prompt, in
        order) carries ``prefill_hidden_states[layer]`` (one row per prompt token),
        ``prefill_probe_scores[name]`` (with probes), ``prompt_token_ids``, ``store_id`` (with
        ``store=``) and ``item_id``. ``ids``: one id per prompt (str or int; unique), kept in
        the store record (``StoredRequest.item_id``) so that a collection can be resumed;
        None: no item ids.
        """
        if not self.capture_only or self.session is None:
            raise CaptureConfigError(
                "capture() needs an engine built with capture_only=True (and layers=[...] or "
                "probes={...}); use generate() on this one."
            )
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        batch = [prompts] if single else list(prompts)
        item_ids = check_item_ids(ids, len(batch))
        labels = [{"prompt": p} if isinstance(p, str) else {} for p in batch]
        for label, item_id in zip(labels, item_ids or (), strict=False):
            label["item_id"] = item_id
        self._labels = iter(labels)
        try:
            outputs = self.encode(
                batch,
                use_tqdm=use_tqdm,
                lora_request=lora_request,
                pooling_task=self.pooling_task,
                tokenization_kwargs=tokenization_kwargs,
            )
        finally:
            self._labels = None
        for index, output in enumerate(outputs):
            # The stream stopped early: what the pooler got is not the model's output.
            output.outputs = None
            output.item_id = item_ids[index] if item_ids is not None else None
        return outputs

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        if self.capture_only:
            raise CaptureConfigError(
                "generate() on a capture-only engine: it stops after the deepest captured "
                "layer, so it has no logits to sample from. Use capture(prompts), or build an "
                "LLM without capture_only=True to generate."
            )
        return super().generate(*args, **kwargs)

    def chat(self, *args: Any, **kwargs: Any) -> list[Any]:
        if self.capture_only:
            raise CaptureConfigError(
                "chat() on a capture-only engine: it generates nothing. Use capture() with the "
                "rendered prompts, or build an LLM without capture_only=True to chat."
            )
        return super().chat(*args, **kwargs)

    # vLLM wraps pooled outputs in new objects (EmbeddingRequestOutput.from_base, ...): carry
    # the captures over by request id.

    def embed(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._carry(super().embed(*args, **kwargs))

    def classify(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._carry(super().classify(*args, **kwargs))

    def score(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's ``score``; with capture each result also has ``inputs``: the two pooled
        outputs it compared (each with its ``hidden_states`` and ``probe_scores``), or one
        output for a cross-encoder that reads the pair together."""
        results = super().score(*args, **kwargs)
        pooled, self._pooled = self._pooled, {}
        for result in results:
            # A bi-encoder's pair result is named "<first id>_<second id>".
            ids = [result.request_id] if result.request_id in pooled else []
            ids = ids or result.request_id.split("_")
            result.inputs = tuple(pooled[i] for i in ids if i in pooled)
        return results

    def _carry(self, results: list[Any]) -> list[Any]:
        pooled, self._pooled = self._pooled, {}
        for result in results:
            source = pooled.get(result.request_id)
            if source is not None:
                copy_captures(source, result)
            else:
                clear_outputs(result)
        return results

    def _abort_unfinished(self) -> None:
        """After an error or Ctrl-C: nothing of this call may come back in a later call."""
        if self.session is not None:
            self.session.abandon()
        if self.llm_engine.has_unfinished_requests():
            engine_ids = list(self.llm_engine.output_processor.request_states)
            self.llm_engine.abort_request(engine_ids, internal=True)

    # -- attention ----------------------------------------------------------------------------

    def attention_pattern(
        self, prompt: str | list[int], layer: int, *, max_bytes: int = DEFAULT_PATTERN_BYTES
    ) -> torch.Tensor:
        """The full attention matrix of a short prompt at ``layer``, every query head: float32
        ``[n_heads, n, n]`` (row ``p``: position ``p``'s probabilities over keys ``0..n-1``).

        Needs an engine built with ``attention_layers=[..., layer, ...]``,
        ``include_prefill=True`` and ``attention_top_k`` at least the prompt's length (the
        rows' top k then hold every key; at most 256), without ``attention_min_p``; refused,
        naming ``max_bytes``, when the matrix is larger. ``prompt``: text or token ids.
        """
        if self.session is None or self.capture_only:
            raise CaptureConfigError(
                "attention_pattern runs one request through generate(): build an LLM (not "
                "capture_only) with attention_layers=[...] and include_prefill=True."
            )

        def generate(one: Any, options: dict[str, Any]) -> list[Any]:
            params = SamplingParams(max_tokens=1, extra_args={EXTRA_ARGS_KEY: options})
            return self.generate(one, params, use_tqdm=False)

        config = self.capture_config
        return attention_pattern(
            generate,
            lambda text: list(self.get_tokenizer().encode(text)),
            self.session.readouts,
            bool(config is not None and config.include_prefill),
            prompt,
            layer,
            max_bytes,
        )

    # -- patching -----------------------------------------------------------------------------

    def patch_sweep(self, *, use_tqdm: bool = True, **kwargs: Any) -> Any:
        """Activation patching over layers and positions (:class:`~probehook.PatchSweep`):
        the clean run's row at each (layer, position) put into the corrupt run, one cell per
        request, in one batch. Needs ``LLM(patching=True)``. Keywords as
        :func:`probehook.frontend.patch_sweep.patch_sweep` (``prompt``, ``clean_prompt``,
        ``answer_token``/``foil_token`` or their ``_id``, ``layers``, ``positions``, ``hook``,
        ``metric``, ``alpha``); see docs/patching.md."""
        if self.session is None or self.capture_only:
            raise CaptureConfigError(
                "patch_sweep runs requests through generate(): build an LLM (not "
                "capture_only) with patching=True."
            )
        tokenizer = self.get_tokenizer()

        def generate(requests: list[Any], progress: bool) -> list[Any]:
            params = [sweep_params(extra, ids) for _, extra, ids in requests]
            return self.generate([{"prompt_token_ids": p} for p, _, _ in requests], params,
                                 use_tqdm=use_tqdm and progress)  # fmt: skip

        def write_noise(plan: Any) -> None:
            stats = self.collective_rpc("probehook_embedding_stats")
            self.collective_rpc("probehook_patch_rows", args=noise_write(plan, stats))

        return patch_sweep(
            generate,
            lambda text, add_special_tokens=True: tokenizer.encode(
                text, add_special_tokens=add_special_tokens
            ),
            lambda token: tokenizer.decode([token]),
            self.session.writes,
            write_noise,
            **kwargs,
        )

    # -- steering -----------------------------------------------------------------------------

    @property
    def steering(self) -> dict[str, Any]:
        """The engine's steering vectors by name (a copy; change them with
        :meth:`add_steering` and :meth:`remove_steering`)."""
        steering = self.session.steering if self.session is not None else None
        return dict(steering.vectors) if steering is not None else {}

    def add_steering(self, name: str, vector: Any) -> None:
        """Put ``vector`` (a :class:`~probehook.SteeringVector`) in the engine's bank under
        ``name``, while the engine runs: no restart, no recompilation. Its layers must be
        steered layers (``steering=`` or ``steering_layers=`` at construction)."""
        steering = setup.steering_of(self.session)
        wire = steering.add(name, vector)
        try:
            self.collective_rpc("probehook_steering_add", args=(name, wire))
        except BaseException:
            steering.remove(name)
            raise

    def remove_steering(self, name: str) -> None:
        """Take a vector out of the bank. Requests that name it afterwards are refused."""
        setup.steering_of(self.session).remove(name)
        self.collective_rpc("probehook_steering_remove", args=(name,))

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        if self.session is not None:
            raise CaptureConfigError(
                "beam_search is not supported with capture: vLLM runs it as one-token "
                "generate() calls that recompute the prefix each step, so rows would not "
                "belong to the final beams. Build an LLM with layers=None for beam search."
            )
        return super().beam_search(*args, **kwargs)

    def shutdown(self) -> None:
        """Stop the engine's processes now (instead of at garbage collection)."""
        try:
            if self.store is not None:
                self.store.close()
        finally:  # a store that fails to close still lets the engine stop
            if self.session is not None:
                self.session.close()
            self.llm_engine.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _empty_rows(output: Any) -> None:
    # layers=None is plain vLLM, but the attributes exist, so code works either way.
    clear_outputs(output)
    outputs.decorate(output)


def _request_id(engine_id: str) -> str:
    """The id a RequestOutput carries, from the engine id ``LLMEngine.add_request`` returns.

    vLLM appends ``-<8 hex chars>`` to make engine ids unique (unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set).
    """
    head, sep, tail = engine_id.rpartition("-")
    if sep and len(tail) == 8 and _HEX.issuperset(tail):
        return head
    return engine_id


_HEX = frozenset("0123456789abcdef")


LLM.__init__.__signature__ = capture_request.front_end_signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str"),
    ]
)
