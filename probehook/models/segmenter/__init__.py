"""A one-pass, non-text model at toy scale: per-pixel segmentation of small images.

The RFC on non-text-generating models (geospatial segmentation) in miniature: an image is split
into patches, every patch runs through vLLM as one pooling request under the same user input,
and an output processor puts the patch outputs back together as an image.

- :mod:`~probehook.models.segmenter.codec`: pixels <-> token ids, the network in plain torch
  (the reference the tests compare vLLM against), the bundled weights (no vLLM imports);
- :mod:`~probehook.models.segmenter.processor`: the ``segmentation_image`` output processor (file ->
  patches -> mask image; no vLLM imports);
- :mod:`~probehook.models.segmenter.model`: the network as a vLLM out-of-tree pooling model
  (registered with vLLM by :mod:`probehook.models.plugin`, the ``probehook_models`` entry point
  of ``vllm.general_plugins``).

The output processor is registered through the ``probehook.output_processors`` entry point,
the model class declares its layer path (``probehook_layer_path``): the segmenter uses only
what a third party's model package could use.
"""

from probehook.models.segmenter.codec import segmenter_path

ENGINE_KWARGS = {"skip_tokenizer_init": True, "enable_prefix_caching": False, "dtype": "float32"}
"""What an engine on the segmenter needs: no tokenizer (prompts are token ids), no prefix
caching (it keeps no KV cache: vLLM refuses caching without one), float32 weights."""

__all__ = ["ENGINE_KWARGS", "segmenter_path"]
