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
from probehook.frontend.item_ids import check_item_ids, refuse_duplicate_ids


@dataclass(frozen=True)
class Item:
    id: str
    prompt: Any
    """A string, or a list of token ids."""


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
    refuse_duplicate_ids([item.id for item in items], str(path))
    return items
