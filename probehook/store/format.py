"""On-disk layout of an activation store (documented for h5py-only readers in docs/store.md).

    STORE/
      meta.json           store-level metadata, written once (atomically) at creation
      manifest.jsonl      append-only; one checksummed JSON record per line
      writer.lock         flock'ed by the one writer; holds its {"pid", "host", "since"}
      shards/NAME.h5      immutable once renamed from NAME.h5.tmp

A shard is committed by: write NAME.h5.tmp, fsync, rename to NAME.h5, fsync the directory, then
append its manifest lines and fsync the manifest. Anything not in the manifest does not exist.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

FORMAT_NAME = "probehook-activation-store"
FORMAT_VERSION = 1
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.jsonl"
WRITER_LOCK = "writer.lock"
SHARD_DIR = "shards"
PHASES = ("prefill", "decode")
DEFAULT_SHARD_BYTES = 1 << 30


def dataset_name(phase: str, layer: int) -> str:
    return f"{phase}/layer_{layer}"


def encode_line(record: dict[str, Any]) -> str:
    """One manifest line: the record and a CRC32 of its canonical JSON."""
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return (
        json.dumps(
            {"crc": zlib.crc32(body.encode()), "record": record},
            sort_keys=True,
            separators=(",", ":"),
        )
        + "\n"
    )


def decode_line(line: str) -> dict[str, Any] | None:
    """The record of a manifest line, or None if the line is torn or corrupt."""
    try:
        wrapper = json.loads(line)
        record = wrapper["record"]
        body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    except (ValueError, KeyError, TypeError):
        return None
    return record if zlib.crc32(body.encode()) == wrapper.get("crc") else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
