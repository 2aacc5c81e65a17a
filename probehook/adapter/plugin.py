"""Entry point in vLLM's ``vllm.general_plugins`` group; vLLM calls it in every process.

It registers the ``probehook`` load format (nothing is tapped unless an engine selects it) and
probehook's out-of-tree model, the tiny segmenter (``ProbehookTinySegmenter``), by name only:
nothing is imported until an engine loads that architecture.
"""

SEGMENTER = "probehook.segmentation.model:TinySegmenter"


def register() -> None:
    from vllm import ModelRegistry

    from probehook.adapter.worker.loader import register_loader

    register_loader()
    if "ProbehookTinySegmenter" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("ProbehookTinySegmenter", SEGMENTER)
