"""Collection at scale: items with ids, capture-only replicas on Ray, resume. No vLLM imports
here except through the adapter (replicas build a probehook.LLM in their own process)."""
