"""Models that ship with probehook, so demos and tests run offline."""

from __future__ import annotations

from pathlib import Path

_TINY_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-arith"


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
