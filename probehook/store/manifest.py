"""Reading and rewriting ``manifest.jsonl``, the store's append-only log of checksummed records.

Two kinds of damage are told apart, because only one of them may be cut:

- a **torn tail**: bytes after the last newline. Appends write whole lines and fsync before
  anything is acknowledged, so these bytes were never acknowledged: a writer cuts them.
- a **bad line**: a complete line (it ends in a newline) whose checksum or JSON fails, with
  possibly good lines after it. Records after it were acknowledged, so nothing is cut: readers
  skip the line with a warning, writers refuse to append, and ``probehook store fsck --repair``
  rewrites the manifest keeping every verifiable record (the old file is kept beside it).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probehook.store.format import MANIFEST_FILE, SHARD_DIR, decode_line, encode_line, fsync_dir


@dataclass
class ManifestScan:
    """What a manifest holds: its valid records in order, and its damage."""

    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    """1-based numbers of complete lines that fail their checksum."""
    torn_tail: int = 0
    """Bytes after the last newline (an interrupted append)."""
    size: int = 0


def scan_manifest(root: Path) -> ManifestScan:
    path = root / MANIFEST_FILE
    data = path.read_bytes() if path.exists() else b""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    result = ManifestScan(torn_tail=len(tail), size=len(data))
    for number, line in enumerate(lines, 1):
        record = decode_line(line.decode(errors="replace"))
        if record is None:
            result.bad_lines.append(number)
        else:
            result.records.append(record)
    return result


def cut_torn_tail(root: Path, scan: ManifestScan) -> None:
    """Drop the unacknowledged bytes after the last newline, so appends stay readable."""
    with open(root / MANIFEST_FILE, "r+b") as f:
        f.truncate(scan.size - scan.torn_tail)
        os.fsync(f.fileno())


def rewrite_manifest(root: Path, records: list[dict[str, Any]], keep_old_as: str) -> Path | None:
    """Atomically replace the manifest with ``records``; the old file is kept, renamed to
    ``manifest.<keep_old_as>-<time>.jsonl``, and its path returned (None if there was none).

    A kill at any point leaves either the old or the new manifest in place, never a mix.
    """
    path = root / MANIFEST_FILE
    tmp = root / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(encode_line(r) for r in records))
        f.flush()
        os.fsync(f.fileno())
    backup = None
    if path.exists():
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        backup = root / f"manifest.{keep_old_as}-{stamp}.jsonl"
        os.link(path, backup)  # the old bytes stay on disk under the backup name
    os.replace(tmp, path)
    fsync_dir(root)
    return backup


def run_layers(run: dict[str, Any]) -> list[int] | None:
    """The layers a run record says it captured (None: not recorded)."""
    layers = (run.get("capture") or {}).get("layers")
    return list(layers) if layers is not None else None


def remove_replaced_shards(root: Path, records: list[dict[str, Any]]) -> list[str]:
    """Delete shards that a finished compaction replaced and nothing references any more.

    Such a shard is provably garbage: the compaction record is only written after every one
    of its requests was copied, fsynced and re-pointed to the new shards.
    """
    live = {r["name"] for r in records if r.get("kind") == "shard"}
    removed = []
    for record in records:
        if record.get("kind") != "compaction":
            continue
        for name in record["replaced"]:
            path = root / SHARD_DIR / name
            if name not in live and path.exists():
                path.unlink()
                removed.append(name)
    return removed
