"""Lenses as one entry of the readout table: what the model would say next at a layer, for
every kept token, as the top-k rows of one readout.

A lens reads a row ``h`` of layer ``L`` through an affine map (none for the logit lens, ``J_L``
for the J-lens, ``I + A_L`` and ``b_L`` for the tuned lens), then the model's own final norm
and unembedding, and keeps the ``k`` most likely tokens with their log-probs and the log-prob
of the token that actually came next (the target). Each ``(lens, layer)`` pair is one instance
of the readout (``"j@4"``), so the worker's bank, the stream, the server and the store treat
it as any top-k readout; users see ``out.lens["j"][4]``.

No vLLM: the worker's bank is :class:`~probehook.worker.lens_bank.LensBank` (the worker's
readout table names it), the model's head comes from the adapter; the lens files are
:mod:`probehook.lenses`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from probehook.core.monitors import TopKMonitor, top_k_monitor
from probehook.errors import CaptureConfigError
from probehook.outputs.top_k import TopKRows, compact_top_k, json_top_k
from probehook.outputs.top_k_readout import TopKReadout

LOGIT = "logit"
MAP_DTYPES = (None, "float32", "bfloat16", "float16")
"""What ``lens_dtype`` takes: the dtype the worker applies a J-lens's or tuned lens's map in
(None: float32, the lens file's precision or more). The head always runs in the model's."""
MAX_LENS_TOP_K = 64
"""Tokens kept per row and lens at most: the wire and the responses stay small."""


@dataclass(frozen=True, repr=False)
class LensRows(TopKRows):
    """A lens's reading of ``n`` tokens at one layer.

    - ``token_ids``: int64 ``[n, k]``, the ``k`` most likely next tokens under the lens,
      descending by log-prob;
    - ``logprobs``: float32 ``[n, k]``, their log-probs under the lens;
    - ``target_logprob``: float32 ``[n]``, the lens's log-prob of the token that actually came
      next (of a prompt row, the next prompt token; of the last prompt row and of decode row
      ``i``, output token ``i``).
    """

    scalar_dtype: ClassVar[torch.dtype] = torch.float32
    column_names: ClassVar[tuple[str, str, str]] = ("token_ids", "logprobs", "target_logprob")

    @property
    def token_ids(self) -> torch.Tensor:
        return self.indices

    @property
    def logprobs(self) -> torch.Tensor:
        return self.values

    @property
    def target_logprob(self) -> torch.Tensor:
        return self.l0


LENS_STOP_PREFIX = "lens:"


@top_k_monitor
@dataclass(frozen=True)
class LensMonitor(TopKMonitor):
    """Stop or flag generation when lens ``lens``'s log-prob of token ``token`` at layer
    ``layer`` crosses ``threshold``.

    The watched value is the token's log-prob under the lens where it is among the row's
    most likely tokens at the engine's ``lens_top_k`` (whatever k the request keeps: the
    worker and the front end read the same values), ``-inf`` where it is not. That is exact
    for every threshold above ``-log(k + 1)``: a token outside the top ``k`` has ``k``
    tokens at least as likely, so its probability is at most ``1 / (k + 1)``; the engine
    refuses a lower threshold (raise ``lens_top_k``). The same rule as :class:`ProbeMonitor`
    on the same rows (each decode row: the state that produces the next token): ``"stop"``
    ends the completion at the first crossing (``stop_reason`` is ``"lens:" + key``),
    ``"flag"`` lists every crossing row in ``CompletionOutput.lens_flags[key]``; ``key`` is
    ``"<lens>@<layer>:<token>"``.
    """

    lens: str
    layer: int
    token: int
    threshold: float
    action: str = "flag"
    direction: str = "above"

    source: ClassVar[str] = "lens"
    """The top-k readout it watches."""
    outside: ClassVar[float] = -math.inf
    """Its value where the token is not among the engine's top k."""
    marker: ClassVar[str] = "lens"
    required: ClassVar[tuple[str, ...]] = ("lens", "layer", "token", "threshold")
    watches: ClassVar[str] = "lenses"
    stop_prefix: ClassVar[str] = LENS_STOP_PREFIX

    def __post_init__(self) -> None:
        what = f"LensMonitor({self.lens!r})"
        if not isinstance(self.lens, str) or not self.lens or "@" in self.lens:
            raise CaptureConfigError(
                f"LensMonitor lens={self.lens!r} must be the name of an engine lens."
            )
        for field_name in ("layer", "token"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                hint = (
                    "a token id, such as tokenizer.convert_tokens_to_ids(...)"
                    if field_name == "token"
                    else "a layer index of the engine's lens_layers"
                )
                raise CaptureConfigError(
                    f"{what} {field_name}={value!r} is not valid: pass {hint}."
                )
            object.__setattr__(self, field_name, int(value))
        if self.token < 0:
            raise CaptureConfigError(f"{what} token={self.token} is negative.")
        self._check_action(what)

    @property
    def instance(self) -> str:
        """The readout instance it watches (``"<lens>@<layer>"``)."""
        return f"{self.lens}@{self.layer}"

    @property
    def entry(self) -> int:
        """The entry of the instance's top-k rows it watches."""
        return self.token

    @property
    def key(self) -> str:
        """Its name in ``lens_flags``: ``"<lens>@<layer>:<token>"``."""
        return f"{self.instance}:{self.token}"


def instance_name(lens: str, layer: int) -> str:
    """The readout instance of ``lens`` at ``layer`` (the store's and the wire's name)."""
    return f"{lens}@{layer}"


def split_instance(name: str) -> tuple[str, int]:
    lens, _, layer = name.rpartition("@")
    return lens, int(layer)


class LensReadout(TopKReadout):
    """The ``lenses={name: lens}`` engine option (``lens_layers=[...]``, ``lens_top_k=k``)
    and the ``lenses`` / ``lens_layers`` request options."""

    name = "lens"
    source = "lens"
    request_attributes = ("prefill_lens",)
    completion_attributes = ("lens",)
    engine_option = "lenses"
    request_option = "lenses"
    extra_engine_options = ("lens_layers", "lens_dtype")
    extra_request_options = ("lens_layers",)
    default_k = 5
    max_k = MAX_LENS_TOP_K
    top_k_option = "lens_top_k"
    row_type = LensRows
    reads_next_token = True
    entries_are_tokens = True
    follows_last_prefill_token = True  # the last prompt token's reading costs one row
    monitor = LensMonitor
    flags_attribute = "lens_flags"
    ranks = "every rank"  # each rank holds a shard of the vocabulary
    worker_bank = "probehook.worker.lens_bank:lens_bank"
    reads_head = True
    scalar_series = ("target", "logprob")

    cli_flag = "lens"
    cli_help = {
        "lenses": 'a lens requests may ask readings of ("probehook": {"lenses": ["NAME"]}): '
        "'logit', a J-lens file (.pt) or a tuned-lens folder; needs --lens-layers",
        "lens_layers": "the layers the lenses read: '2,4' or 'all'",
        "lens_top_k": f"next tokens a lens reading keeps per token (default {default_k})",
        "lens_dtype": "the dtype of a J-lens or tuned lens's map (default float32; the head "
        "runs in the model's)",
    }
    cli_choices = {"lens_dtype": tuple(d for d in MAP_DTYPES if d is not None)}

    def cli_value(self, option: str, text: str) -> Any:
        if option == "lens_layers":
            from probehook.capture_config import parse_layers

            return parse_layers(text)
        return super().cli_value(option, text)

    def instances(
        self,
        specs: Mapping[str, Any],
        extras: Mapping[str, Any],
        *,
        num_layers: int,
        hidden_size: int,
        model_name: str | None = None,
    ) -> dict[str, dict]:
        from probehook.lenses.artifacts import check_lens, load_lens

        unknown = sorted(set(extras) - set(self.extra_engine_options))
        if unknown:
            raise CaptureConfigError(
                f"unknown lens option(s) {unknown}; valid: {list(self.extra_engine_options)}."
            )
        dtype = extras.get("lens_dtype")
        if dtype not in MAP_DTYPES:
            raise CaptureConfigError(
                f"lens_dtype={dtype!r} is not valid; choose one of {list(MAP_DTYPES)} (the dtype "
                "of a J-lens or tuned lens's map in the worker; None: float32)."
            )
        layers = user_layers(extras.get("lens_layers"), num_layers, "lens_layers")
        if not layers:
            raise CaptureConfigError(
                "lenses={...} needs lens_layers=[...]: the layers whose rows the lenses read "
                f"(0..{num_layers - 1}), e.g. lens_layers=[{num_layers // 2}]."
            )
        out = {}
        for name, spec in specs.items():
            name = str(name)
            if "@" in name or not name:
                raise CaptureConfigError(
                    f"lenses: the name {name!r} is not valid: pass a non-empty name without '@'."
                )
            lens = load_lens(spec, weights=False)  # checked by its description: nothing read
            kind = LOGIT if isinstance(lens, str) else lens.kind
            if kind != LOGIT:
                check_lens(lens, name, hidden_size=hidden_size, num_layers=num_layers,
                           layers=layers, model_name=model_name)  # fmt: skip
                if lens.path is None:
                    raise CaptureConfigError(
                        f"lenses[{name!r}] was never saved: the workers read lenses from files; "
                        "call its save(path) first."
                    )
            for layer in layers:
                out[instance_name(name, layer)] = {
                    "layer": layer,
                    "lens": name,
                    "kind": kind,
                    "path": None if kind == LOGIT else str(lens.path),
                    "num_layers": num_layers,
                    "dtype": dtype,
                }
        return out

    def check_monitor(self, monitor: Any, k: int, vocab_size: int | None) -> None:
        """A :class:`~probehook.LensMonitor` reads the token's log-prob among
        the top ``k``, ``-inf`` outside: exact above ``-log(k + 1)`` (a token outside the top
        ``k`` has probability at most ``1 / (k + 1)``), so a lower threshold is refused."""
        if vocab_size is not None and monitor.token >= vocab_size:
            raise CaptureConfigError(
                f"LensMonitor token={monitor.token} is not a token id of this model "
                f"(vocabulary 0..{vocab_size - 1})."
            )
        floor = -math.log(k + 1)
        if monitor.threshold <= floor:
            needed = math.ceil(math.exp(-monitor.threshold))  # k + 1 > 1 / p
            fix = (
                f"raise lens_top_k to {needed} or more"
                if needed <= MAX_LENS_TOP_K
                else f"pass a threshold above {-math.log(MAX_LENS_TOP_K + 1):.4f}"
            )
            raise CaptureConfigError(
                f"LensMonitor({monitor.key!r}) threshold={monitor.threshold} is not above "
                f"-log(lens_top_k + 1) = {floor:.4f}: with lens_top_k={k} the engine knows a "
                f"token's log-prob only down to that (a token outside the top {k} may still "
                f"be as likely as 1/{k + 1}); {fix}, or pass a threshold above {floor:.4f}."
            )

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        return 2**32 - 2  # a vocabulary's ids; the model's size is not known here

    def pickable(self, instances: Mapping[str, Mapping]) -> list[str]:
        return list(dict.fromkeys(str(s["lens"]) for s in instances.values()))

    def narrow(
        self, names: list[str], extras: Mapping[str, Any], instances: Mapping[str, Mapping]
    ) -> list[str]:
        engine_layers = sorted({int(s["layer"]) for s in instances.values()})
        asked = extras.get("lens_layers")
        if asked is None or asked is True or asked == "all":  # every layer the engine reads
            layers = engine_layers
        else:  # as the engine option: negative from the end
            num_layers = int(next(iter(instances.values()))["num_layers"])
            layers = user_layers(asked, num_layers, "probehook option lens_layers")
            missing = [layer for layer in layers if layer not in engine_layers]
            if missing:
                raise CaptureConfigError(
                    f"probehook option lens_layers={list(asked)!r} names layer(s) {missing}, "
                    f"which the engine's lenses do not read; its lens_layers: {engine_layers}."
                )
        return [instance_name(name, layer) for name in names for layer in layers]

    def present(self, rows: dict[str, TopKRows]) -> dict[str, dict[int, LensRows]]:
        out: dict[str, dict[int, LensRows]] = {}
        for name, value in rows.items():
            lens, layer = split_instance(name)
            out.setdefault(lens, {})[layer] = value  # type: ignore[assignment]
        return out

    def to_response(self, value: Any) -> dict[str, Any]:
        """``{lens: {layer: {"token_ids", "logprobs", "target_logprob"}}}`` (JSON keys are
        strings: ``"4"``)."""
        return {
            lens: {str(layer): json_top_k(rows) for layer, rows in by_layer.items()}
            for lens, by_layer in value.items()
        }

    def to_compact(self, value: Any) -> dict[str, Any]:
        return {
            lens: {str(layer): compact_top_k({"": rows})[""] for layer, rows in by_layer.items()}
            for lens, by_layer in value.items()
        }

    def written(self, response: dict[str, Any], name: str) -> dict[str, Any]:
        lens, layer = split_instance(name)
        return response[lens][str(layer)]

    def served_path(self, instance: str) -> list[str]:
        lens, layer = split_instance(instance)
        return [lens, str(layer)]

    def served(self, response: dict[str, Any]) -> dict[str, Any]:
        return {
            instance_name(lens, int(layer)): columns
            for lens, by_layer in response.items()
            for layer, columns in by_layer.items()
        }

    def flat(self, value: Any) -> dict[str, TopKRows]:
        return {
            instance_name(lens, layer): rows
            for lens, by_layer in value.items()
            for layer, rows in by_layer.items()
        }


def user_layers(value: Any, num_layers: int | None, option: str) -> list[int]:
    """Layer indices from a user's list (None: [])."""
    if value is None:
        return []
    if value == "all" and num_layers is not None:
        return list(range(num_layers))
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise CaptureConfigError(
            f"{option}={value!r} is not valid: pass a list of layer indices or 'all'."
        )
    layers = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise CaptureConfigError(
                f"{option}={list(value)!r} is not valid: {item!r} is not a layer index (int)."
            )
        if num_layers is not None and not -num_layers <= item < num_layers:
            raise CaptureConfigError(
                f"{option}={list(value)!r}: the model has no layer {item} (0..{num_layers - 1})."
            )
        layers.append(item % num_layers if num_layers is not None else item)
    return sorted(set(layers))
