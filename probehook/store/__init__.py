"""Sharded, crash-safe on-disk store of captured activations."""

from probehook.errors import StoreCorruptError, StoreLockedError
from probehook.store.store import ActivationStore, LayerMatrix, StoredRequest

__all__ = [
    "ActivationStore",
    "LayerMatrix",
    "StoreCorruptError",
    "StoreLockedError",
    "StoredRequest",
]
