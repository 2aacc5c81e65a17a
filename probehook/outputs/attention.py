"""Attention per head as one entry of the readout table (issue 51): for every kept token, the
key positions each query head attends to most, their probabilities and the entropy of the
head's distribution, read from the query at the layer's attention op and the keys in vLLM's
paged cache (the worker's :class:`~probehook.worker.attention_bank.AttentionBank`).

``LLM(model, attention_layers=[2, 5], attention_top_k=8)``; per request
``{"attention": False}`` (none) or ``{"attention_layers": [5]}`` (fewer layers) and
``{"attention_top_k": 4}``; ``out.outputs[0].attention[5]`` (``out.attention`` mirrors it,
``out.prefill_attention`` the prompt rows).

No vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probehook.errors import CaptureConfigError
from probehook.outputs.lens import user_layers
from probehook.outputs.top_k import PACKED_INDEX_LIMIT, TopKRows, compact_top_k, json_top_k
from probehook.outputs.top_k_readout import TopKReadout

DEFAULT_TOP_K = 8
MAX_TOP_K = 64
PICK = "attention"
"""The one name a request picks with ``"attention"``: True/False (every layer, or none)."""


@dataclass(frozen=True, repr=False)
class AttentionRows(TopKRows):
    """One layer's attention of ``n`` tokens, every query head.

    - ``positions``: int64 ``[n, heads, k]``, the key positions each head attends to most, by
      descending probability; -1 where fewer than ``k`` keys are visible;
    - ``probs``: float32 ``[n, heads, k]``, their probabilities (0 at -1 slots);
    - ``entropy``: float32 ``[n, heads]``, nats, of the head's whole distribution.
    """

    scalar_dtype: ClassVar[torch.dtype] = torch.float32
    column_names: ClassVar[tuple[str, str, str]] = ("positions", "probs", "entropy")
    lead_axes: ClassVar[tuple[str, ...]] = ("heads",)

    @property
    def heads(self) -> tuple[int, ...]:
        """The query heads read, ascending."""
        return tuple(range(self.indices.shape[1])) if self.indices.dim() == 3 else ()


class AttentionReadout(TopKReadout):
    """The ``attention_layers=[...]`` engine option (``attention_top_k=k``) and the
    ``attention`` / ``attention_layers`` / ``attention_top_k`` request options."""

    name = "attention"
    source = "attention"
    request_attributes = ("prefill_attention",)
    completion_attributes = ("attention",)
    engine_option = "attention_layers"
    request_option = "attention"
    extra_request_options = ("attention_layers",)
    default_k = DEFAULT_TOP_K
    max_k = MAX_TOP_K
    top_k_option = "attention_top_k"
    row_type = AttentionRows
    site = "attn_q"
    reads_step = True
    tensor_parallel = False  # each rank's heads against its KV shard: not built yet
    worker_bank = "probehook.worker.attention_bank:attention_bank"
    scalar_series = ("entropy", "activation")
    cli_named = False
    cli_help = {
        "attention_layers": 'the layers whose attention per head requests may read ("probehook": '
        '{"attention": true}): "2,5" or "all"',
        "attention_top_k": f"key positions a head keeps per token (default {DEFAULT_TOP_K})",
    }

    def cli_value(self, option: str, text: str) -> Any:
        if option == self.engine_option:
            from probehook.capture_config import parse_layers

            return parse_layers(text)
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
        """One instance a layer, named by it (``"5"``), with the model's query heads."""
        heads = _query_heads(model_name)
        return {
            str(layer): {"layer": layer, "heads": heads, "num_layers": num_layers}
            for layer in user_layers(specs["layers"], num_layers, "attention_layers")
        }

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

    def present(self, rows: dict[str, TopKRows]) -> dict[int, AttentionRows]:
        return {int(name): value for name, value in rows.items()}  # type: ignore[misc]

    def flat(self, value: Any) -> dict[str, TopKRows]:
        return {str(layer): rows for layer, rows in value.items()}

    def to_response(self, value: Any) -> dict[str, Any]:
        return {str(layer): json_top_k(rows) for layer, rows in value.items()}

    def to_compact(self, value: Any) -> dict[str, Any]:
        return compact_top_k(self.flat(value))


def _query_heads(model_name: str | None) -> int:
    """The model's query heads, from its config (the attention op's rows are heads x head
    size wide)."""
    from transformers import AutoConfig

    if model_name is None:
        raise CaptureConfigError("attention_layers= needs the model's config: none was given.")
    config = AutoConfig.from_pretrained(model_name)
    config = getattr(config, "get_text_config", lambda: config)()
    return int(config.num_attention_heads)
