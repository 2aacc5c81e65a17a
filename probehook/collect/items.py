"""Items of a collection: prompts with ids, read from a file or given in Python.

An item id names one prompt for good: the store keeps it in the record (``item_id``) and a
rerun skips every id already committed. Ids are strings; ints are written in decimal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probehook.errors import CaptureConfigError


@dataclass(frozen=True)
class Item:
    id: str
    prompt: Any
    """A string, or a list of token ids."""


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
    _refuse_duplicates(strings, "ids")
    return strings


def make_items(prompts: Sequence[Any], ids: Sequence[Any] | None = None) -> list[Item]:
    """Items from prompts and optional ids (None: each prompt's index is its id)."""
    prompts = list(prompts)
    strings = check_item_ids(ids, len(prompts)) or [str(i) for i in range(len(prompts))]
    return [Item(i, p) for i, p in zip(strings, prompts, strict=True)]


def read_items(path: str | os.PathLike[str]) -> list[Item]:
    """Items of a prompts file. ``.jsonl``: each line a JSON string (its id: the line number,
    from 1), ``{"prompt": ...}`` or ``{"id": ..., "prompt": ...}``; any other extension: plain
    text, one prompt per line, ids the line numbers. Blank lines are skipped (their numbers
    are not reused, so ids stay stable when lines are added at the end)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise CaptureConfigError(f"Cannot read the prompts file {path}: {e}") from e
    items: list[Item] = []
    jsonl = path.suffix == ".jsonl"
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            items.append(Item(str(number), line))
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            raise CaptureConfigError(f"{path}:{number} is not valid JSON: {e}") from e
        if isinstance(value, str):
            items.append(Item(str(number), value))
        elif isinstance(value, dict) and isinstance(value.get("prompt"), str | list):
            item_id = value.get("id", number)
            if isinstance(item_id, bool) or not isinstance(item_id, str | int):
                raise CaptureConfigError(
                    f"{path}:{number}: id {item_id!r} must be a string or an int."
                )
            items.append(Item(str(item_id), value["prompt"]))
        else:
            raise CaptureConfigError(
                f"{path}:{number}: expected a JSON string, {{'prompt': ...}} or "
                f"{{'id': ..., 'prompt': ...}}; got {line[:80]!r}."
            )
    if not items:
        raise CaptureConfigError(f"The prompts file {path} holds no prompts.")
    _refuse_duplicates([item.id for item in items], str(path))
    return items


def _refuse_duplicates(ids: list[str], where: str) -> None:
    seen: set[str] = set()
    twice = sorted({i for i in ids if i in seen or seen.add(i)})
    if twice:
        more = f" and {len(twice) - 5} more" if len(twice) > 5 else ""
        raise CaptureConfigError(
            f"Duplicate item ids in {where}: {twice[:5]}{more}. An item id names one prompt "
            "(a rerun skips the ids already stored); give each prompt its own id."
        )
