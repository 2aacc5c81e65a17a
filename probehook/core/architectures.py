"""The architectures probehook taps, where each keeps its layers, and how another model declares
its own: the one table the front end's construction-time refusal and the worker's loader both
read (no torch, no vLLM: the user's process need not load the worker's ops to check a model).
"""

from __future__ import annotations

from probehook.errors import UnsupportedModelError

_ARCH_TEST = "tests/test_architectures.py::test_matches_hf"
_BACKEND = None  # found by rule on vLLM's Transformers backend (see _transformers_backend_layers)
TESTED_ARCHITECTURES: dict[str, tuple[str | None, str]] = {
    # architecture (config.json's, or vLLM's Transformers-backend class) -> (where vLLM's model
    # keeps its layer list, the real-engine test that compares its rows with HF). The one list
    # of what is tested: the construction-time refusal names these, locate_layers falls back
    # to these paths for a model that declares none, and docs/capture.md's table must match it
    # (tests/test_architectures.py checks).
    "LlamaForCausalLM": ("model.layers", f"{_ARCH_TEST}[llama]"),
    "MistralForCausalLM": ("model.layers", f"{_ARCH_TEST}[mistral]"),
    "Qwen2ForCausalLM": ("model.layers", f"{_ARCH_TEST}[qwen2]"),
    "Qwen3ForCausalLM": ("model.layers", f"{_ARCH_TEST}[qwen3]"),
    "GPT2LMHeadModel": ("transformer.h", f"{_ARCH_TEST}[gpt2]"),
    "OPTForCausalLM": ("model.decoder.layers", f"{_ARCH_TEST}[opt]"),
    "GemmaForCausalLM": ("model.layers", f"{_ARCH_TEST}[gemma]"),
    "Gemma2ForCausalLM": ("model.layers", f"{_ARCH_TEST}[gemma2]"),
    "Gemma3ForCausalLM": ("model.layers", f"{_ARCH_TEST}[gemma3]"),
    "Phi3ForCausalLM": ("model.layers", f"{_ARCH_TEST}[phi3]"),
    "MixtralForCausalLM": ("model.layers", f"{_ARCH_TEST}[mixtral]"),
    "Qwen3MoeForCausalLM": ("model.layers", f"{_ARCH_TEST}[qwen3_moe]"),
    "GraniteForCausalLM": ("model.layers", f"{_ARCH_TEST}[granite]"),
    # vLLM 0.32 runs these two through its Transformers backend (below)
    "GPTNeoXForCausalLM": (_BACKEND, f"{_ARCH_TEST}[gpt_neox]"),
    "Olmo2ForCausalLM": (_BACKEND, f"{_ARCH_TEST}[olmo2]"),
    # Transformers backend: any model vLLM runs through it (model_impl="transformers", or an
    # architecture vLLM has no native class for)
    "TransformersForCausalLM": (_BACKEND, f"{_ARCH_TEST}[llama-transformers]"),
    "TransformersMoEForCausalLM": (_BACKEND, f"{_ARCH_TEST}[mixtral-transformers]"),
    # pooling models (encode / embed / classify / score): encoder layers (vLLM nests BertModel
    # under .model)
    "BertModel": (
        "model.encoder.layer",
        "tests/test_pooling.py::test_embed_rows_and_scores_equal_hf",
    ),
    "BertForSequenceClassification": (
        "bert.encoder.layer",
        "tests/test_pooling.py::test_classify_and_cross_encoder_score",
    ),
}
TRANSFORMERS_BACKEND_CLASSES = ("TransformersForCausalLM", "TransformersMoEForCausalLM")
"""vLLM's Transformers-backend classes probehook taps: HF decoder layers on [1, T, H]."""
KNOWN_LAYER_PATHS: tuple[str, ...] = tuple(
    dict.fromkeys(path for path, _ in TESTED_ARCHITECTURES.values() if path is not None)
)
"""Where :func:`locate_layers` looks, in order, on a model that declares no layer path."""
LAYER_PATH_ATTRIBUTE = "probehook_layer_path"
"""A vLLM model class's declaration of its layer list: the dotted path of an ``nn.ModuleList``
relative to the model (``probehook_layer_path = "backbone.layers"``); each layer's output is the
stream probehook taps (a tensor, or a ``(hidden, residual)`` pair)."""


def supported_message() -> str:
    """The sentences every architecture refusal ends with: the tested list, and how a model
    declares its layers."""
    native = [a for a in TESTED_ARCHITECTURES if a not in TRANSFORMERS_BACKEND_CLASSES]
    return (
        f"Tested architectures: {', '.join(native)}; and any causal LM vLLM runs through its "
        f"Transformers backend ({' / '.join(TRANSFORMERS_BACKEND_CLASSES)}, e.g. "
        'model_impl="transformers"). Another model can declare where its layers are: set '
        f'`{LAYER_PATH_ATTRIBUTE} = "path.to.layers"` (its nn.ModuleList of layers, relative '
        "to the model) on its vLLM model class. See docs/capture.md#architectures."
    )


def declared_layer_path(model_cls: type) -> str | None:
    """The layer path a model class declares (:data:`LAYER_PATH_ATTRIBUTE`), if any."""
    path = getattr(model_cls, LAYER_PATH_ATTRIBUTE, None)
    if path is not None and (not isinstance(path, str) or not path):
        raise UnsupportedModelError(
            f"{model_cls.__name__}.{LAYER_PATH_ATTRIBUTE} = {path!r}: expected a dotted path "
            'such as "model.layers".'
        )
    return path
