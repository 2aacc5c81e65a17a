"""The tiny segmenter as a vLLM out-of-tree pooling model (registered with vLLM by the
``probehook_models`` general plugin, :mod:`probehook.models.plugin`, under the architecture name
``ProbehookTinySegmenter``).

Each patch is one request whose prompt is its pixels as token ids; the model returns one row of
class logits per pixel through vLLM's token-classification pooler. It has no attention, so
vLLM keeps no KV cache for it (``IsAttentionFree``, as vLLM's own Terratorch/Prithvi model).

What probehook needs of it is declared on the class, as any model package would: its output
processor (``@OUTPUT_PROCESSORS.for_model``) and where its layers are (``probehook_layer_path``,
the layer list relative to the model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.layers.pooler.tokwise import pooler_for_token_classify
from vllm.model_executor.models.interfaces import IsAttentionFree
from vllm.model_executor.models.interfaces_base import default_pooling_type

from probehook.models.segmenter.codec import SegmenterNet, SegmenterSpec
from probehook.outputs import OUTPUT_PROCESSORS


@OUTPUT_PROCESSORS.for_model("segmentation_image")
@default_pooling_type(tok_pooling_type="ALL")
class TinySegmenter(nn.Module, IsAttentionFree):
    is_pooling_model = True
    probehook_layer_path = "encoder.layers"
    """Where probehook finds the layers it taps (each block's output is the stream)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.encoder = SegmenterNet(SegmenterSpec.from_config(self.config))
        pooler_config = vllm_config.model_config.pooler_config
        assert pooler_config is not None
        self.pooler = DispatchPooler({"token_classify": pooler_for_token_classify(pooler_config)})

    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.encoder.embed.weight.new_zeros((input_ids.shape[0], 0))  # reads ids itself

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        assert input_ids is not None, "the segmenter reads pixels as token ids"
        return self.encoder(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"Unexpected weight {name!r} in the segmenter checkpoint.")
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded
