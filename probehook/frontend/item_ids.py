"""Item ids: the caller's name for each prompt, kept in the store's records (``item_id``).

Shared by ``LLM.generate(..., ids=...)`` and collections (:mod:`probehook.collect.items`), so
that neither imports the other. Ids are strings; ints are written in decimal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from probehook.errors import CaptureConfigError


def check_item_ids(ids: Sequence[Any] | None, count: int) -> list[str] | None:
    """Item ids as strings, one per prompt and unique; a clear error otherwise."""
    if ids is None:
        return None
    if isinstance(ids, str | bytes):
        raise CaptureConfigError(f"ids={ids!r} must be a sequence of ids, one per prompt.")
    ids = list(ids)
    if len(ids) != count:
        raise CaptureConfigError(f"{len(ids)} ids for {count} prompts; give one id per prompt.")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, str | int)]
    if bad:
        raise CaptureConfigError(f"ids must be str or int; got {bad[0]!r}.")
    strings = [str(i) for i in ids]
    refuse_duplicate_ids(strings, "ids")
    return strings


def refuse_duplicate_ids(ids: list[str], where: str) -> None:
    """A clear error naming the ids that ``ids`` (read from ``where``) holds twice."""
    seen: set[str] = set()
    twice = sorted({i for i in ids if i in seen or seen.add(i)})
    if twice:
        more = f" and {len(twice) - 5} more" if len(twice) > 5 else ""
        raise CaptureConfigError(
            f"Duplicate item ids in {where}: {twice[:5]}{more}. An item id names one prompt "
            "(a rerun skips the ids already stored); give each prompt its own id."
        )
