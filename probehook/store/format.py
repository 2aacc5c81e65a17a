"""On-disk layout of an activation store (documented for h5py-only readers in docs/store.md).

    STORE/
      meta.json           store-level metadata, written once (atomically) at creation
      manifest.jsonl      append-only; one checksummed JSON record per line
      writer.lock         flock'ed by the one writer; holds its {"pid", "host", "since"}
      shards/NAME.h5      immutable once renamed from NAME.h5.tmp
      create.lock         flock'ed briefly while a writer creates meta.json or checks against it
      lanes/LANE/         an extra writer's lane: its own writer.lock, manifest.jsonl, shards/

The root's manifest and shards are the default lane (named ""); every lane is written by one
writer at a time and read together with the others as one store. A shard is addressed by its
key: its file name in the root lane, ``lanes/LANE/NAME`` in another lane.

A shard is committed by: write NAME.h5.tmp, fsync, rename to NAME.h5, fsync the directory, then
append its manifest lines and fsync the manifest. Anything not in the manifest does not exist.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

FORMAT_NAME = "probehook-activation-store"
FORMAT_VERSION = 1
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.jsonl"
WRITER_LOCK = "writer.lock"
SHARD_DIR = "shards"
CREATE_LOCK = "create.lock"
LANES_DIR = "lanes"
ROOT_LANE = ""
"""The default lane: the store root's own manifest.jsonl and shards/."""
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


_LANE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
LANE_RULE = '1-64 characters of A-Z, a-z, 0-9, "_", "." and "-", not starting with "."'


def is_lane_name(name: str) -> bool:
    return isinstance(name, str) and bool(_LANE_NAME.fullmatch(name)) and name[0] != "."


def check_lane_name(name: str) -> str:
    """``name`` if it is a valid lane name, else ValueError naming it and the rule."""
    if not is_lane_name(name):
        raise ValueError(
            f"Invalid store lane name {name!r}: a lane name is {LANE_RULE} (lane=None writes "
            "the root lane)."
        )
    return name


def lane_dir(root: Path, lane: str) -> Path:
    """The directory holding a lane's writer.lock, manifest.jsonl and shards/."""
    return root if lane == ROOT_LANE else root / LANES_DIR / lane


def list_lanes(root: Path) -> tuple[list[str], list[str]]:
    """The store's lanes in store order (the root lane first, then the others by name), and
    the names of entries under ``lanes/`` that are not lanes (bad names, not directories)."""
    lanes, odd = [ROOT_LANE], []
    base = root / LANES_DIR
    if base.is_dir():
        for entry in sorted(os.listdir(base)):
            if is_lane_name(entry) and (base / entry).is_dir():
                lanes.append(entry)
            else:
                odd.append(entry)
    return lanes, odd


def shard_key(lane: str, name: str) -> str:
    """How a store addresses shard ``name`` of ``lane`` (file names are unique per lane)."""
    return name if lane == ROOT_LANE else f"{LANES_DIR}/{lane}/{name}"


def split_shard_key(key: str) -> tuple[str, str]:
    """(lane, file name) of a shard key."""
    if key.startswith(LANES_DIR + "/"):
        _, lane, name = key.split("/", 2)
        return lane, name
    return ROOT_LANE, key


def shard_path(root: Path, key: str) -> Path:
    lane, name = split_shard_key(key)
    return lane_dir(root, lane) / SHARD_DIR / name


def lane_label(lane: str) -> str:
    """A lane as messages name it."""
    return "root lane" if lane == ROOT_LANE else f"lane {lane!r}"
