"""Entry point ``probehook_models`` in vLLM's ``vllm.general_plugins`` group: the bundled
models' registration with vLLM, as a third-party model package would write it.

vLLM calls :func:`register` in every process. It registers the tiny segmenter's model class by
name only: nothing of it is imported until an engine loads that architecture, so a vLLM engine
on any other model is unchanged.
"""

SEGMENTER_ARCHITECTURE = "ProbehookTinySegmenter"
SEGMENTER_CLASS = "probehook.models.segmenter.model:TinySegmenter"


def register() -> None:
    from vllm import ModelRegistry

    if SEGMENTER_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(SEGMENTER_ARCHITECTURE, SEGMENTER_CLASS)
