"""What a request returns of one SAE: the top-k features of each token, in the generic top-k
row type every top-k readout shares (:class:`~probehook.outputs.top_k.TopKRows`)."""

from __future__ import annotations

from probehook.outputs.top_k import TopKRows

SAEFeatures = TopKRows
"""The ``k`` strongest features of each token, from one SAE: ``indices`` int64 ``[n, k]``
(descending by activation, |activation| for abstopk, -1 padding), ``values`` float32
``[n, k]``, ``l0`` int64 ``[n]`` (non-zero features before the cut); ``watched``: the same
tokens at the engine's ``sae_top_k``, which feature monitors read."""

__all__ = ["SAEFeatures"]
