"""Sharded, crash-safe on-disk store of captured activations."""

from probehook.errors import StoreLockedError
from probehook.store.store import ActivationStore, LayerMatrix, StoredRequest

__all__ = ["ActivationStore", "LayerMatrix", "StoreLockedError", "StoredRequest"]
