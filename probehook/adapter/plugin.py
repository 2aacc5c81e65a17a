"""Entry point in vLLM's ``vllm.general_plugins`` group; vLLM calls it in every process.

It only registers the ``probehook`` load format; nothing is tapped unless an engine selects it.
"""


def register() -> None:
    from probehook.adapter.loader import register_loader

    register_loader()
