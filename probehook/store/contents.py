"""What a store holds, read from disk when it is opened: ``meta.json`` and every lane's
manifest. Shards are not opened here; records name them and readers open them on demand."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from probehook.errors import StoreFormatError
from probehook.store.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LANES_DIR,
    MANIFEST_FILE,
    META_FILE,
    ROOT_LANE,
    SHARD_DIR,
    lane_dir,
    list_lanes,
)
from probehook.store.manifest import scan_manifest

logger = logging.getLogger(__name__)


def read_meta(root: Path) -> dict[str, Any]:
    """The store's ``meta.json``, checked to be this format and version."""
    meta_path = root / META_FILE
    if not meta_path.is_file():
        raise StoreFormatError(
            f"{root} is not a probehook activation store (no {META_FILE}). Create one by "
            "passing store=PATH to probehook.LLM or `probehook capture --store PATH`."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise StoreFormatError(f"{meta_path} is not valid JSON: {e}") from e
    if meta.get("format") != FORMAT_NAME:
        raise StoreFormatError(f"{root} is not a probehook activation store ({meta_path}).")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StoreFormatError(
            f"{root} was written in store format version {meta.get('format_version')}, but "
            f"this probehook reads version {FORMAT_VERSION}. Use a probehook release that "
            "writes that version, or re-capture."
        )
    return meta


def read_manifests(
    root: Path,
) -> tuple[dict[str, dict], dict[str, dict], list[str], list[str]]:
    """Requests (by store id) and runs (by run id) of every lane's manifest, what was left
    out, and the lanes, in store order (the root lane, then the other lanes by name).

    A damaged line is skipped with a warning and the records after it are kept; a torn
    tail (an interrupted append, never acknowledged) is left out quietly, since a reader
    may see one while a writer is appending. Each lane is read on its own: a record
    never refers to a shard of another lane. A record's ``shard`` is its shard key
    (``lanes/LANE/NAME`` outside the root lane). Two records with one store id: the later
    one in store order is kept, the other is named in ``dropped``.
    """
    dropped: list[str] = []
    records: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    lanes, odd = list_lanes(root)
    for entry in odd:
        dropped.append(
            f"{LANES_DIR}/{entry} (not a lane: a lane is a directory named by the lane name rule)"
        )
    for lane in lanes:
        directory = lane_dir(root, lane)
        prefix = "" if lane == ROOT_LANE else f"{LANES_DIR}/{lane}/"
        scan = scan_manifest(directory)
        shards: set[str] = set()
        for record in scan.records:
            kind = record.get("kind")
            if kind == "shard":
                if (directory / SHARD_DIR / record["name"]).is_file():
                    shards.add(record["name"])
                else:
                    dropped.append(f"{prefix}{record['name']} (listed but missing)")
            elif kind == "request":
                if record["shard"] in shards:
                    if prefix:
                        record = {**record, "shard": prefix + record["shard"]}
                    if record["id"] in records:  # written before ids were checked at add()
                        earlier = records.pop(record["id"])
                        dropped.append(
                            f"request {record['id']} in {earlier['shard']} (shadowed by a "
                            f"later record with the same id in {record['shard']})"
                        )
                        logger.warning("probehook store %s: %s", root, dropped[-1])
                    records[record["id"]] = record
            elif kind == "run":
                runs[record["run_id"]] = record
        if scan.bad_lines:
            dropped.append(
                f"{prefix}{MANIFEST_FILE} line(s) {scan.bad_lines} (corrupt; run `probehook "
                f"store fsck {root} --repair`)"
            )
            logger.warning("probehook store %s: skipped %s", root, dropped[-1])
        if scan.torn_tail:
            dropped.append(
                f"{prefix}{MANIFEST_FILE} tail ({scan.torn_tail} bytes, torn or being written)"
            )
        shard_dir = directory / SHARD_DIR
        for tmp in sorted(shard_dir.glob("*.tmp")) if shard_dir.exists() else []:
            with contextlib.suppress(FileNotFoundError):  # committed or removed meanwhile
                size = tmp.stat().st_size
                dropped.append(f"{prefix}{tmp.name} ({size} bytes, not committed)")
    if dropped:
        logger.info("probehook store %s: left out %s", root, "; ".join(dropped))
    return records, runs, dropped, lanes
