"""Sharded, crash-safe on-disk store of captured activations."""

from probehook.errors import DuplicateStoreIdError, StoreCorruptError, StoreLockedError
from probehook.store.export import export_saelens, export_safetensors, read_safetensors_export
from probehook.store.layer_matrix import LayerMatrix
from probehook.store.store import ActivationStore
from probehook.store.stored_request import StoredRequest

__all__ = [
    "ActivationStore",
    "DuplicateStoreIdError",
    "LayerMatrix",
    "StoreCorruptError",
    "StoreLockedError",
    "StoredRequest",
    "export_saelens",
    "export_safetensors",
    "read_safetensors_export",
]
