"""Sparse autoencoders: read SAELens and sparsify folders, encode rows, and the per-token
features the engine returns (:class:`SAEFeatures`). No vLLM, no SAELens import."""

from probehook.saes.features import SAEFeatures
from probehook.saes.files import SAEError
from probehook.saes.sae import SAE, layer_of_hook

__all__ = ["SAE", "SAEError", "SAEFeatures", "layer_of_hook"]
