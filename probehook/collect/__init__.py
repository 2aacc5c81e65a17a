"""Collection at scale: items with ids, capture-only replicas (in this process or on Ray)
writing one store, resume. The replicas build ``probehook.LLM`` in their own processes."""

from probehook.collect.collector import CollectionError, CollectResult, collect
from probehook.collect.items import Item, read_items

__all__ = ["CollectResult", "CollectionError", "Item", "collect", "read_items"]
