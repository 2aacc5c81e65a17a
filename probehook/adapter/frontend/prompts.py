"""vLLM prompts with a prefix-cache salt (``cache_salt``), for steered requests.

vLLM hashes a prompt's ``cache_salt`` into the key of its first KV block, and every later block
chains on that key, so two requests share cached KV only if their salts are equal. probehook
salts every steered request with a digest of its steering (``SteeringSet``), joined to a salt
the user set, so a steered prompt's KV is never read by a request with other steering or none.
"""

from __future__ import annotations

from typing import Any


def with_cache_salt(prompt: Any, salt: str | None) -> Any:
    """``prompt`` (a string, a prompt dict, a rendered engine input or an
    ``EngineCoreRequest``) with ``salt`` joined to its own salt; unchanged when ``salt`` is
    None."""
    if salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    if isinstance(prompt, dict):
        own = prompt.get("cache_salt")
        return {**prompt, "cache_salt": f"{own}|{salt}" if own else salt}
    if hasattr(prompt, "cache_salt"):  # an EngineCoreRequest (deprecated in vLLM 0.32)
        own = prompt.cache_salt
        prompt.cache_salt = f"{own}|{salt}" if own else salt
        return prompt
    raise TypeError(f"cannot salt a prompt of type {type(prompt).__name__} for steering")
