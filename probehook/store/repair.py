"""Crash repair of one lane before a writer appends to it (or ``compact`` merges it).

A writer killed mid-append leaves a torn manifest tail (never acknowledged), ``.tmp`` shards
(never committed) and, after a finished compaction, old shards no manifest names. All three
are safe to remove, but only under the lane's writer lock: a live writer's are not leftovers.
"""

from __future__ import annotations

import logging
from pathlib import Path

from probehook.errors import StoreCorruptError
from probehook.store.format import MANIFEST_FILE, SHARD_DIR
from probehook.store.manifest import cut_torn_tail, remove_replaced_shards, scan_manifest

logger = logging.getLogger(__name__)


def repair_for_append(root: Path, store_root: Path | None = None) -> None:
    """Before appending after a crash (holding the lane's writer lock): cut a torn
    manifest tail (never acknowledged) and delete interrupted ``.tmp`` shards and the old
    shards of a finished compaction, in the lane directory ``root`` only (of the store
    ``store_root``, default ``root``). A damaged line before good ones is refused, never
    cut."""
    store_root = root if store_root is None else store_root
    scan = scan_manifest(root)
    if scan.bad_lines:
        raise StoreCorruptError(
            f"{root / MANIFEST_FILE} has damaged line(s) {scan.bad_lines} before good ones; "
            "appending is refused so that no acknowledged record is lost. Run `probehook "
            f"store fsck {store_root}` to see the damage and `probehook store fsck "
            f"{store_root} --repair` to keep every verifiable record, then append again."
        )
    if scan.torn_tail:
        logger.warning(
            "probehook store %s: cutting %d bytes of torn manifest tail",
            root,
            scan.torn_tail,
        )
        cut_torn_tail(root, scan)
    for tmp in (root / SHARD_DIR).glob("*.tmp") if (root / SHARD_DIR).is_dir() else []:
        logger.warning("probehook store %s: removing interrupted shard %s", root, tmp.name)
        tmp.unlink()
    remove_replaced_shards(root, scan.records)
