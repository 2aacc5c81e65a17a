"""Models that ship with probehook, so demos and tests run offline.

- :func:`tiny_model_path`: a tiny Llama trained on 2-digit addition (a checkpoint only; vLLM
  runs it natively);
- :mod:`probehook.models.segmenter`: a tiny one-pass image model. It plugs into vLLM and
  probehook as a third party's model would, through entry points only (``pyproject.toml``):
  ``vllm.general_plugins`` registers its model class with vLLM (:mod:`probehook.models.plugin`),
  ``probehook.output_processors`` registers its ``segmentation_image`` output processor, and the
  model class declares where its layers are (``probehook_layer_path``).

This module stays light (``probehook`` imports it): no torch, no vLLM.
"""

from __future__ import annotations

from pathlib import Path

_TINY_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-arith"
_TINY_SAE_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-arith-sae-l3"


def tiny_model_path() -> Path:
    """Directory of the bundled tiny Llama trained on 2-digit addition (see docs/tiny-model.md).

    Raises:
        FileNotFoundError: the assets are missing (a broken install or an sdist without them).
    """
    if not (_TINY_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"The bundled tiny model is missing from {_TINY_MODEL_DIR}. Reinstall probehook, "
            "or rebuild it with `python scripts/train_tiny_model.py`."
        )
    return _TINY_MODEL_DIR


def tiny_sae_path() -> Path:
    """Directory of the bundled SAE of the tiny model: TopK, 512 features, k = 8, on layer 3
    (``blocks.3.hook_resid_post``), trained with SAELens's trainer on a probehook export
    (``scripts/train_tiny_sae.py``; docs/saes.md). ``probehook.SAE.load`` reads it.

    Raises:
        FileNotFoundError: the assets are missing.
    """
    if not (_TINY_SAE_DIR / "cfg.json").is_file():
        raise FileNotFoundError(
            f"The bundled SAE is missing from {_TINY_SAE_DIR}. Reinstall probehook, or "
            "rebuild it with `python scripts/train_tiny_sae.py`."
        )
    return _TINY_SAE_DIR
