"""Old home of the tiny segmenter, now :mod:`probehook.models.segmenter`.

Kept only because notebooks/05_non_text_outputs.ipynb (committed executed) still imports
``probehook.segmentation`` and ``probehook.segmentation.codec``; remove this package when that
notebook is re-executed with the new imports. New code imports ``probehook.models.segmenter``.
"""

import sys

from probehook.models.segmenter import ENGINE_KWARGS, codec, segmenter_path

sys.modules[f"{__name__}.codec"] = codec  # ``from probehook.segmentation.codec import ...``

__all__ = ["ENGINE_KWARGS", "segmenter_path"]
