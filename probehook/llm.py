"""``probehook.LLM``: vLLM's offline ``LLM`` that also returns residual-stream captures."""

from __future__ import annotations

import copy
import itertools
import shutil
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm import RequestOutput, SamplingParams

from probehook import __version__ as probehook_version
from probehook import _vllm_adapter as adapter
from probehook.capture_config import (
    EXTRA_ARGS_KEY,
    INTERNAL_KEYS,
    CaptureConfig,
    LayerSpec,
    resolve_layers,
)
from probehook.engine_args import capture_engine_kwargs, check_architecture, read_model_config
from probehook.errors import CaptureConfigError, CaptureError
from probehook.store import ActivationStore
from probehook.store.records import model_fingerprint, pending_request
from probehook.transport import new_export_path, read_tensors, spool_dir

SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class _Tagged:
    key: str
    config: CaptureConfig | None
    sampling: dict[str, Any]


class LLM(adapter.OfflineCaptureHooks, vllm.LLM):
    """Drop-in ``vllm.LLM`` that captures the residual stream after chosen decoder layers.

    Args:
        model: model name or local directory, as for ``vllm.LLM``.
        layers: decoder layers to capture: ints in ``0..num_layers-1`` (negative ints count
            from the end) or ``"all"``. ``None`` (default) captures nothing.
        include_prefill: return one row per prompt token in
            ``RequestOutput.prefill_hidden_states``.
        include_decode: return one row per generated token in
            ``CompletionOutput.hidden_states``; row ``i`` is the stream at the position whose
            logits produced output token ``i``.
        last_prefill_token: keep only the last prompt row.
        last_decode_token: keep only the last decode row.
        store: a directory; every captured request is streamed into an
            :class:`~probehook.store.ActivationStore` there while generation runs, and is
            durable once ``generate()`` returns. Output request ids become store-unique.
        store_options: ``shard_bytes``, ``compression`` ("gzip", "lzf" or None) and
            ``max_queue_bytes`` (the write queue bound that applies backpressure).
        **kwargs: passed to ``vllm.LLM`` unchanged.

    Captured rows are CPU tensors in the model dtype, keyed by layer index. The row after
    layer ``L`` equals Hugging Face's ``output_hidden_states[L + 1]``; for the last layer it
    is the stream before the final norm (HF's last entry is after it).
    """

    def __init__(
        self,
        model: str,
        *,
        layers: LayerSpec | None = None,
        include_prefill: bool = False,
        include_decode: bool = True,
        last_prefill_token: bool = False,
        last_decode_token: bool = False,
        store: str | Path | None = None,
        store_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.capture_config: CaptureConfig | None = None
        self._tags: dict[str, _Tagged] = {}
        self._keys = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self.store: ActivationStore | None = None
        self._run_id: str | None = None
        if layers is None:
            if store is not None:
                raise CaptureConfigError(
                    f"store={str(store)!r} needs something to store: pass layers=[...]."
                )
            if include_prefill or last_prefill_token or last_decode_token:
                raise CaptureConfigError(
                    "Capture options were given but layers=None captures nothing; pass "
                    "layers=[...] or layers='all'."
                )
        else:
            hf_config = read_model_config(str(model), kwargs.get("trust_remote_code", False))
            num_layers = check_architecture(hf_config)
            self.capture_config = CaptureConfig(
                layers=resolve_layers(layers, num_layers),
                include_prefill=include_prefill,
                include_decode=include_decode,
                last_prefill_token=last_prefill_token,
                last_decode_token=last_decode_token,
            )
            kwargs = capture_engine_kwargs(kwargs, self.capture_config)
            if store is not None:  # fail before a minute of engine start-up, not after
                fingerprint = model_fingerprint(hf_config)
                ActivationStore.check_appendable(store, {"model_fingerprint": fingerprint})
        super().__init__(model=model, **kwargs)
        if self.capture_config is not None:
            infos = [info for info in self.collective_rpc("probehook_attach") if info]
            if not infos:
                raise CaptureError("No vLLM worker reported probehook taps.")
            self._capture_info = infos[0]
            self._spool = spool_dir()
            weakref.finalize(self, shutil.rmtree, self._spool, True)
            if store is not None:
                self._open_store(str(model), store, store_options or {}, fingerprint)

    def _open_store(
        self, model: str, path: str | Path, options: dict[str, Any], fingerprint: str
    ) -> None:
        assert self.capture_config is not None
        meta = {
            "model": model,
            "model_fingerprint": fingerprint,
            "dtype": self._capture_info["dtype"].removeprefix("torch."),
            "hidden_size": self._capture_info["hidden_size"],
            "layers": list(self.capture_config.layers),
            "probehook_version": probehook_version,
            "vllm_version": vllm.__version__,
        }
        self.store = ActivationStore.for_writing(path, meta, **options)
        self._run_id = self.store.begin_run({"capture": self.capture_config.to_dict()})
        weakref.finalize(self, self.store.close)

    # -- request path (called by adapter.OfflineCaptureHooks) ----------------------------------

    def _probehook_tag(self, params: Any) -> Any:
        """Copy a request's SamplingParams and mark it for capture (validated here, early)."""
        if self.capture_config is None or not isinstance(params, SamplingParams):
            return params
        extra = dict(params.extra_args or {})
        options = dict(extra.get(EXTRA_ARGS_KEY) or {})
        config = self.capture_config.narrow(options)
        tagged = copy.copy(params)
        if config is not None:
            options.update(key=next(self._keys), n=params.n)
            extra[EXTRA_ARGS_KEY] = options
            tagged.extra_args = extra
            if config.include_prefill:
                # Cached prompt blocks are never recomputed, so their rows would be missing.
                tagged.skip_reading_prefix_cache = True
        return tagged

    def _probehook_register(self, request_id: str, params: Any) -> None:
        options = ((getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)) or {}
        if self.capture_config is None or "key" not in options:
            return
        user = {k: v for k, v in options.items() if k not in INTERNAL_KEYS}
        # The sampling summary stays in the front end; only the store needs it.
        sampling = {f: _jsonable(getattr(params, f, None)) for f in SAMPLING_FIELDS}
        self._tags[request_id] = _Tagged(options["key"], self.capture_config.narrow(user), sampling)

    def _probehook_discard(self) -> None:
        """Forget rows of requests whose outputs will never be returned (errors, interrupts)."""
        if not self._tags:
            return
        prefixes = [f"{tag.key}/" for tag in self._tags.values()]
        self._tags.clear()
        self.collective_rpc("probehook_forget", args=(prefixes,))

    def _probehook_attach(self, outputs: Sequence[Any]) -> None:
        """Fetch the rows of finished outputs in one RPC and hang them on the outputs."""
        requests: list[dict[str, Any]] = []
        slots: list[tuple[Any, str, int]] = []  # (target, attribute, first range index)
        stored: list[tuple[RequestOutput, _Tagged]] = []
        for output in outputs:
            if not isinstance(output, RequestOutput):
                continue
            output.prefill_hidden_states = {}
            for completion in output.outputs:
                completion.hidden_states = {}
            tag = self._tags.pop(output.request_id, None)
            if tag is None or tag.config is None:
                continue
            stored.append((output, tag))
            config = tag.config
            prompt_len = len(output.prompt_token_ids or [])
            for position, completion in enumerate(output.outputs):
                ranges = []
                if config.include_prefill and position == 0:
                    lo = prompt_len - 1 if config.last_prefill_token else 0
                    ranges.append([lo, prompt_len])
                    slots.append((output, "prefill_hidden_states", len(requests)))
                if config.include_decode:
                    n_out = len(completion.token_ids)
                    lo = prompt_len - 1
                    if config.last_decode_token and n_out > 0:
                        lo = prompt_len - 2 + n_out
                    ranges.append([lo, prompt_len - 1 + n_out])
                    slots.append((completion, "hidden_states", len(requests)))
                requests.append(
                    {
                        "key": f"{tag.key}/{completion.index}",
                        "ranges": ranges,
                        "layers": list(config.layers),
                    }
                )
        if requests:
            self._fetch_rows(requests, slots)
        for output in outputs:
            if isinstance(output, RequestOutput):
                output.hidden_states = output.outputs[0].hidden_states if output.outputs else {}
        if self.store is not None:
            for output, tag in stored:
                output.request_id = f"{self._run_id}-{output.request_id}"
                self.store.add(pending_request(output, tag.sampling))

    def _fetch_rows(
        self, requests: list[dict[str, Any]], slots: list[tuple[Any, str, int]]
    ) -> None:
        """One export RPC for all ``requests``; rows land on the ``slots`` targets."""
        path = new_export_path(self._spool)
        reply = next(
            r
            for r in self.collective_rpc("probehook_export", args=(path, requests))
            if r is not None
        )
        tensors = read_tensors(path, reply["entries"]) if reply["entries"] else []
        self._check_complete(reply["ranges"])
        _assign(requests, reply["ranges"], tensors, slots)

    def _probehook_finish(self) -> None:
        """End of an engine loop: drop orphaned rows; make stored requests durable."""
        # The loop has drained: tags without an output belong to aborted requests.
        self._probehook_discard()
        if self.store is not None:
            self.store.flush()

    @staticmethod
    def _check_complete(ranges: list[dict[str, Any]]) -> None:
        broken = [r for r in ranges if r["num_missing"]]
        if broken:
            r = broken[0]
            raise CaptureError(
                f"Request {r['key']} is missing {r['num_missing']} captured row(s) at "
                f"positions {r['missing']} (asked for {r['lo']}..{r['hi'] - 1}); "
                f"{len(broken)} range(s) are incomplete in all. This is a probehook bug: "
                "please report it with the engine arguments."
            )


def _assign(
    requests: list[dict[str, Any]],
    ranges: list[dict[str, Any]],
    tensors: list[torch.Tensor],
    slots: list[tuple[Any, str, int]],
) -> None:
    # Ranges come back in request order, each request's ranges in the order asked.
    by_request: list[list[torch.Tensor]] = [[] for _ in requests]
    key_to_request = {req["key"]: i for i, req in enumerate(requests)}
    for r in ranges:
        by_request[key_to_request[r["key"]]].append(tensors[r["tensor_index"]])
    taken = [0] * len(requests)
    for target, attribute, request_index in slots:
        tensor = by_request[request_index][taken[request_index]]
        taken[request_index] += 1
        layers = requests[request_index]["layers"]
        setattr(target, attribute, {layer: tensor[i] for i, layer in enumerate(layers)})


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)
