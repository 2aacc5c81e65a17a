"""Attention per head as one entry of the readout table (issue 51): for every kept token, the
key positions each query head attends to most, their probabilities and the entropy of the
head's distribution, read from the query at the layer's attention op and the keys in vLLM's
paged cache (the worker's :class:`~probehook.worker.attention_bank.AttentionBank`).

``LLM(model, attention_layers=[2, 5], attention_top_k=8, attention_min_p=0.0)``; per request
``{"attention": False}`` (none) or ``{"attention_layers": [5]}`` (fewer layers),
``{"attention_top_k": 4}``, ``{"attention_heads": [0, 3]}`` (or ``{5: [0, 3]}``: per layer)
and ``{"attention_spans": {"system": [0, 57]}}`` (the mass on key ranges);
``out.outputs[0].attention[5]`` (``out.attention`` mirrors it, ``out.prefill_attention`` the
prompt rows).

No vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probehook.errors import CaptureConfigError
from probehook.outputs.columns import Column
from probehook.outputs.lens import user_layers
from probehook.outputs.top_k import PACKED_INDEX_LIMIT, TopKRows, compact_top_k, json_top_k
from probehook.outputs.top_k_readout import TopKReadout

DEFAULT_TOP_K = 8
MAX_TOP_K = 256
MAX_SPANS = 16
"""Spans a request may name: the worker's rows hold this many span masses per head."""
PICK = "attention"
"""The one name a request picks with ``"attention"``: True/False (every layer, or none)."""


@dataclass(frozen=True, repr=False)
class AttentionRows(TopKRows):
    """One layer's attention of ``n`` tokens, every query head.

    - ``positions``: int64 ``[n, heads, k]``, the key positions each head attends to most, by
      descending probability; -1 where fewer than ``k`` keys are visible;
    - ``probs``: float32 ``[n, heads, k]``, their probabilities (0 at -1 slots);
    - ``entropy``: float32 ``[n, heads]``, nats, of the head's whole distribution;
    - ``span_mass``: float32 ``[n, heads, spans]``, the probability mass on each key range
      the request named (:attr:`spans` by name).
    """

    scalar_dtype: ClassVar[torch.dtype] = torch.float32
    column_names: ClassVar[tuple[str, str, str]] = ("positions", "probs", "entropy")
    lead_axes: ClassVar[tuple[str, ...]] = ("heads",)
    extra_columns: ClassVar[tuple[Column, ...]] = (Column("span_mass", ("heads", "spans")),)

    @property
    def heads(self) -> tuple[int, ...]:
        """The query heads read, ascending."""
        if "heads" in self.labels:
            return tuple(int(h) for h in self.labels["heads"])
        return tuple(range(self.indices.shape[1])) if self.indices.dim() == 3 else ()

    @property
    def spans(self) -> dict[str, torch.Tensor]:
        """float32 ``[n, heads]`` by span name: the probability mass each head puts on the
        keys of the span (``[start, end)`` absolute positions), in the order the request
        named them."""
        mass = self.extra["span_mass"]
        return {str(name): mass[..., i] for i, name in enumerate(self.labels.get("spans", ()))}


class AttentionReadout(TopKReadout):
    """The ``attention_layers=[...]`` engine option (``attention_top_k=k``) and the
    ``attention`` / ``attention_layers`` / ``attention_top_k`` request options."""

    name = "attention"
    source = "attention"
    request_attributes = ("prefill_attention",)
    completion_attributes = ("attention",)
    engine_option = "attention_layers"
    request_option = "attention"
    extra_engine_options = ("attention_min_p",)
    extra_request_options = ("attention_layers", "attention_heads", "attention_spans")
    default_k = DEFAULT_TOP_K
    max_k = MAX_TOP_K
    top_k_option = "attention_top_k"
    row_type = AttentionRows
    site = "attn_q"
    reads_step = True
    entries_are_positions = True
    ranks = "every rank"  # each rank reads its heads against its KV shard; one all-gather
    worker_bank = "probehook.worker.attention_bank:attention_bank"
    scalar_series = ("entropy", "activation")
    cli_named = False
    cli_help = {
        "attention_layers": 'the layers whose attention per head requests may read ("probehook": '
        '{"attention": true}): "2,5" or "all"',
        "attention_top_k": f"key positions a head keeps per token (default {DEFAULT_TOP_K})",
        "attention_min_p": "keep a key among a head's top k only if its probability is at least "
        "this (default 0: the top k whatever their probability; Neuronpedia uses 0.005)",
    }

    def cli_value(self, option: str, text: str) -> Any:
        if option == self.engine_option:
            from probehook.capture_config import parse_layers

            return parse_layers(text)
        if option == "attention_min_p":
            return float(text)
        return super().cli_value(option, text)

    def named_specs(self, value: Any) -> dict[str, Any]:
        """``attention_layers=`` as given (a list of layers or ``"all"``, checked against the
        model by :meth:`instances`)."""
        if isinstance(value, Mapping) and set(value) == {"layers"}:  # checked once already
            return dict(value)
        if value is None or value == [] or value is False:
            raise CaptureConfigError(
                f"attention_layers={value!r} is not valid: pass a list of layer indices or 'all'."
            )
        return {"layers": value}

    def instances(
        self,
        specs: Mapping[str, Any],
        extras: Mapping[str, Any],
        *,
        num_layers: int,
        hidden_size: int,
        model_name: str | None = None,
    ) -> dict[str, dict]:
        """One instance a layer, named by it (``"5"``), with the model's query heads, the
        span slots of its rows and the engine's ``attention_min_p``."""
        min_p = extras.get("attention_min_p", 0.0)
        if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p < 1:
            raise CaptureConfigError(
                f"attention_min_p={min_p!r} is not valid: pass a probability in [0, 1) (a key "
                "is kept among a head's top k only if its probability is at least this)."
            )
        heads = _query_heads(model_name)
        return {
            str(layer): {"layer": layer, "heads": heads, "spans": MAX_SPANS,
                         "min_p": float(min_p), "num_layers": num_layers}
            for layer in user_layers(specs["layers"], num_layers, "attention_layers")
        }  # fmt: skip

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        return PACKED_INDEX_LIMIT  # positions in a sequence: the packed rows carry them exactly

    def pickable(self, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
        return [PICK]

    def narrow(
        self, names: list[str], extras: Mapping[str, Any], instances: Mapping[str, Mapping]
    ) -> list[str]:
        if not names:
            return []
        engine_layers = sorted(int(s["layer"]) for s in instances.values())
        unknown = sorted(set(extras) - set(self.extra_request_options))
        if unknown:
            raise CaptureConfigError(f"the attention readout takes no option(s) {unknown}.")
        asked = extras.get("attention_layers")
        if asked is None or asked is True or asked == "all":
            return [str(layer) for layer in engine_layers]
        num_layers = int(next(iter(instances.values()))["num_layers"])
        layers = user_layers(asked, num_layers, "probehook option attention_layers")
        missing = [layer for layer in layers if layer not in engine_layers]
        if missing:
            raise CaptureConfigError(
                f"probehook option attention_layers={asked!r} names layer(s) {missing}, whose "
                f"attention the engine does not read; its attention_layers: {engine_layers}."
            )
        return [str(layer) for layer in layers]

    def request_terms(
        self, names: list[str], extras: Mapping[str, Any], instances: Mapping[str, Mapping]
    ) -> dict[str, Any] | None:
        """``attention_heads`` as ``{"heads": {layer: [heads]}}`` (the layers that narrow) and
        ``attention_spans`` as ``{"spans": [[name, start, end], ...]}``, checked."""
        terms: dict[str, Any] = {}
        heads = extras.get("attention_heads")
        if heads is not None:
            terms["heads"] = _request_heads(heads, names, instances)
        spans = extras.get("attention_spans")
        if spans is not None:
            terms["spans"] = _request_spans(spans)
        return terms or None

    def view(self, rows: TopKRows, settings: Mapping[str, Any], terms: Any) -> TopKRows:
        """A layer's rows of every head and span slot -> the request's heads and spans."""
        terms = terms or {}
        spans = terms.get("spans", ())
        rows = rows.select("spans", range(len(spans)), [name for name, _, _ in spans])
        heads = terms.get("heads", {}).get(str(settings["layer"]))
        return rows if heads is None else rows.select("heads", heads, heads)

    def present(self, rows: dict[str, TopKRows]) -> dict[int, AttentionRows]:
        return {int(name): value for name, value in rows.items()}  # type: ignore[misc]

    def flat(self, value: Any) -> dict[str, TopKRows]:
        return {str(layer): rows for layer, rows in value.items()}

    def to_response(self, value: Any) -> dict[str, Any]:
        return {str(layer): json_top_k(rows) for layer, rows in value.items()}

    def to_compact(self, value: Any) -> dict[str, Any]:
        return compact_top_k(self.flat(value))


def _request_heads(
    value: Any, names: list[str], instances: Mapping[str, Mapping]
) -> dict[str, list[int]]:
    """``attention_heads``: a list of query heads (every layer the request reads) or
    ``{layer: [heads]}`` (a layer not listed: every head) -> heads by instance name."""
    if not names:
        return {}
    num_layers = int(instances[names[0]]["num_layers"])
    if isinstance(value, Mapping):
        by_layer: dict[str, Any] = {}
        for key, heads in value.items():
            layer = key if isinstance(key, int) else int(key) if _is_int_text(key) else None
            if layer is None or isinstance(layer, bool):
                raise CaptureConfigError(
                    f"probehook option attention_heads={_plain(value)!r}: the key {key!r} is not "
                    "a layer index; pass {layer: [heads]} or a list of heads."
                )
            name = str(user_layers([layer], num_layers, "probehook option attention_heads")[0])
            if name not in names:
                raise CaptureConfigError(
                    f"probehook option attention_heads names layer {key!r}, whose attention this "
                    f"request does not read (it reads layers {[int(n) for n in names]})."
                )
            by_layer[name] = heads
    else:
        by_layer = dict.fromkeys(names, value)
    return {
        name: _heads_of(heads, int(instances[name]["heads"]), name)
        for name, heads in by_layer.items()
    }


def _heads_of(value: Any, n_heads: int, layer: str) -> list[int]:
    listed = list(value) if isinstance(value, (list, tuple)) else None
    if (
        not listed
        or any(isinstance(h, bool) or not isinstance(h, int) for h in listed)
        or len(set(listed)) != len(listed)
    ):
        raise CaptureConfigError(
            f"probehook option attention_heads={_plain(value)!r} (layer {layer}) is not valid: "
            f"pass a non-empty list of distinct query heads in 0..{n_heads - 1}."
        )
    bad = [h for h in listed if not 0 <= h < n_heads]
    if bad:
        raise CaptureConfigError(
            f"probehook option attention_heads names head(s) {bad} of layer {layer}, which has "
            f"{n_heads} query heads (0..{n_heads - 1})."
        )
    return sorted(listed)


def _request_spans(value: Any) -> list[list[Any]]:
    """``attention_spans``: ``{name: [start, end)}`` of absolute key positions, at most
    :data:`MAX_SPANS` -> ``[[name, start, end], ...]`` in the given order."""
    if not isinstance(value, Mapping) or not value:
        raise CaptureConfigError(
            f"probehook option attention_spans={_plain(value)!r} is not valid: pass a dict of "
            'span names and [start, end) key positions, e.g. {"system": [0, 57]}.'
        )
    if len(value) > MAX_SPANS:
        raise CaptureConfigError(
            f"probehook option attention_spans names {len(value)} spans; at most {MAX_SPANS}."
        )
    spans = []
    for name, bounds in value.items():
        pair = list(bounds) if isinstance(bounds, (list, tuple)) else None
        if (
            not isinstance(name, str)
            or not name
            or pair is None
            or len(pair) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) for b in pair)
            or not 0 <= pair[0] < pair[1]
        ):
            raise CaptureConfigError(
                f"probehook option attention_spans: {name!r}: {_plain(bounds)!r} is not a span; "
                "pass a name and two ordered key positions [start, end), 0 <= start < end."
            )
        spans.append([name, int(pair[0]), int(pair[1])])
    return spans


def _is_int_text(key: Any) -> bool:
    return isinstance(key, str) and key.lstrip("-").isdigit()


def _plain(value: Any) -> Any:
    """A request option's value as the user wrote it (lists, not the hashed tuples)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _query_heads(model_name: str | None) -> int:
    """The model's query heads, from its config (the attention op's rows are heads x head
    size wide)."""
    from transformers import AutoConfig

    if model_name is None:
        raise CaptureConfigError("attention_layers= needs the model's config: none was given.")
    config = AutoConfig.from_pretrained(model_name)
    config = getattr(config, "get_text_config", lambda: config)()
    return int(config.num_attention_heads)
