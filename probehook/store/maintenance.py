"""Store maintenance: ``fsck`` (check, and repair without losing data) and ``compact`` (merge
small shards). Both go lane by lane (the root lane, then ``lanes/NAME`` by name) and change a
lane only while holding that lane's writer lock; a lane whose lock a live writer holds is
reported and skipped. Compaction merges shards only within a lane.

Rules they keep:

- nothing acknowledged is deleted: a repaired or compacted manifest replaces the old one
  atomically, and the old one stays beside it (``manifest.<why>-<time>.jsonl``);
- a file is deleted only when it is provably garbage: an interrupted ``.tmp`` shard (never
  acknowledged), a shard that a finished compaction replaced, or a ``compact-*`` shard that no
  manifest line references (its rows are still in the shards it was copied from).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py

from probehook.errors import StoreCorruptError, StoreLockedError
from probehook.store.appender import DatasetAppender
from probehook.store.contents import read_meta
from probehook.store.features import PARTS, feature_dataset
from probehook.store.format import (
    DEFAULT_SHARD_BYTES,
    MANIFEST_FILE,
    ROOT_LANE,
    SHARD_DIR,
    dataset_name,
    fsync_dir,
    lane_dir,
    lane_label,
    list_lanes,
)
from probehook.store.manifest import (
    remove_replaced_shards,
    rewrite_manifest,
    scan_manifest,
)
from probehook.store.repair import repair_for_append

COMPACT_PREFIX = "compact-"


@dataclass
class FsckReport:
    """What ``fsck`` found in one lane; ``ok`` when every record is readable and nothing is
    damaged. :func:`fsck` returns the root lane's report, with the other lanes' in
    :attr:`lanes` (its ``ok`` and :meth:`lines` cover them all)."""

    path: str
    lane: str = ROOT_LANE
    records: int = 0
    requests: int = 0
    bad_lines: list[int] = field(default_factory=list)
    torn_tail_bytes: int = 0
    missing_shards: list[str] = field(default_factory=list)
    unverifiable_requests: list[str] = field(default_factory=list)
    orphan_shards: list[str] = field(default_factory=list)
    garbage_files: list[str] = field(default_factory=list)
    repaired: bool = False
    backup: str | None = None
    skipped: str | None = None
    """Why ``repair`` left this lane untouched (a live writer holds its lock); None if not."""
    lanes: list[FsckReport] = field(default_factory=list)
    """The root lane's report only: the reports of the other lanes, by name."""
    not_lanes: list[str] = field(default_factory=list)
    """The root lane's report only: entries under ``lanes/`` that are not lanes (kept)."""

    @property
    def lane_ok(self) -> bool:
        """This lane alone is undamaged."""
        return not (self.bad_lines or self.missing_shards or self.unverifiable_requests)

    @property
    def ok(self) -> bool:
        return self.lane_ok and all(r.ok for r in self.lanes)

    def all_lanes(self) -> list[FsckReport]:
        """This report and the other lanes' reports, in store order."""
        return [self, *self.lanes]

    def lines(self) -> list[str]:
        """A human-readable report, one finding per line; with several lanes, each finding
        names its lane."""
        reports = self.all_lanes()
        requests = sum(r.requests for r in reports)
        records = sum(r.records for r in reports)
        head = f"{self.path}: {requests} requests in {records} manifest records"
        out = [head + (f" in {len(reports)} lanes" if self.lanes else "")]
        for report in reports:
            tag = f"{lane_label(report.lane)}: " if self.lanes else ""
            if self.lanes:
                out.append(f"{tag}{report.requests} requests in {report.records} records")
            out.extend(tag + finding for finding in report._findings())
        if self.not_lanes:
            out.append(f"entries under lanes/ that are not lanes (kept): {self.not_lanes}")
        damaged = "DAMAGED: run with --repair to keep every verifiable record"
        out.append("OK" if self.ok else damaged)
        return out

    def _findings(self) -> list[str]:
        out = []
        if self.skipped:
            out.append(f"skipped, not repaired: {self.skipped}")
        if self.bad_lines:
            out.append(f"damaged manifest line(s): {self.bad_lines}")
        if self.torn_tail_bytes:
            out.append(f"torn manifest tail: {self.torn_tail_bytes} bytes (never acknowledged)")
        if self.missing_shards:
            out.append(f"shards listed but missing: {self.missing_shards}")
        if self.unverifiable_requests:
            out.append(
                f"{len(self.unverifiable_requests)} request(s) whose rows cannot be read: "
                f"{self.unverifiable_requests[:10]}"
            )
        if self.orphan_shards:
            out.append(f"shards no manifest line references (kept): {self.orphan_shards}")
        if self.garbage_files:
            verb = "removed" if self.repaired else "removable"
            out.append(f"interrupted or replaced files ({verb}): {self.garbage_files}")
        if self.repaired:
            if self.backup:
                out.append(f"repaired; the previous manifest is kept as {self.backup}")
            else:
                out.append("repaired")
        return out


def fsck(path: str | os.PathLike[str], *, repair: bool = False) -> FsckReport:
    """Check every lane of a store; with ``repair``, rewrite a lane's manifest keeping every
    verifiable record and remove provably garbage files. Repair takes each lane's writer lock
    in turn; a lane a live writer holds is checked, reported (``skipped``) and left alone."""
    from probehook.store.lock import WriterLock

    root = Path(path)
    lanes, not_lanes = list_lanes(root)
    reports = []
    for lane in lanes:
        if not repair:
            reports.append(_check(root, lane))
            continue
        try:
            lock = WriterLock.acquire(root, lane)
        except StoreLockedError as e:
            report = _check(root, lane)
            report.skipped = str(e)
            reports.append(report)
            continue
        with lock:
            reports.append(_repair(root, lane))
    main = reports[0]
    main.lanes, main.not_lanes = reports[1:], not_lanes
    return main


def _repair(store_root: Path, lane: str) -> FsckReport:
    """Repair one lane (holding its writer lock)."""
    root = lane_dir(store_root, lane)
    report = _check(store_root, lane)
    if report.bad_lines or report.torn_tail_bytes or report.unverifiable_requests:
        scan = scan_manifest(root)
        dead = set(report.unverifiable_requests)
        keep = [
            r
            for r in scan.records
            if not (r.get("kind") == "request" and r["id"] in dead)
            and not (r.get("kind") == "shard" and r["name"] in report.missing_shards)
        ]
        report.backup = str(rewrite_manifest(root, keep, keep_old_as="before-fsck"))
    for name in report.garbage_files:
        (root / SHARD_DIR / name).unlink(missing_ok=True)
    report.repaired = True
    fixed = _check(store_root, lane)
    report.missing_shards, report.unverifiable_requests = [], fixed.unverifiable_requests
    report.bad_lines = fixed.bad_lines
    return report


def _check(store_root: Path, lane: str = ROOT_LANE) -> FsckReport:
    root = lane_dir(store_root, lane)
    scan = scan_manifest(root)
    report = FsckReport(
        str(store_root),
        lane=lane,
        records=len(scan.records),
        bad_lines=scan.bad_lines,
        torn_tail_bytes=scan.torn_tail,
    )
    shards_dir = root / SHARD_DIR
    listed = [r["name"] for r in scan.records if r.get("kind") == "shard"]
    replaced = {n for r in scan.records if r.get("kind") == "compaction" for n in r["replaced"]}
    report.missing_shards = [n for n in listed if not (shards_dir / n).is_file()]
    lengths = _dataset_lengths(shards_dir, [n for n in listed if n not in report.missing_shards])
    for record in scan.records:
        if record.get("kind") != "request":
            continue
        report.requests += 1
        shard = lengths.get(record["shard"])
        readable = shard is not None and all(
            seg["start"] + seg["count"] <= shard.get(name, -1)
            for seg in (*record["segments"], *record.get("sae_segments", ()))
            if seg["count"]
            for name in _datasets(seg)
        )
        if not readable:
            report.unverifiable_requests.append(record["id"])
    on_disk = sorted(p.name for p in shards_dir.iterdir()) if shards_dir.is_dir() else []
    for name in on_disk:
        if name.endswith(".tmp"):
            report.garbage_files.append(name)
        elif name in listed:
            continue
        elif name in replaced or name.startswith(COMPACT_PREFIX):
            report.garbage_files.append(name)
        else:
            report.orphan_shards.append(name)
    return report


def _dataset_lengths(shards_dir: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Rows per dataset of each readable shard (an unreadable shard is left out)."""
    lengths: dict[str, dict[str, int]] = {}
    for name in names:
        try:
            with h5py.File(shards_dir / name, "r") as f:
                found: dict[str, int] = {}
                f.visititems(
                    lambda key, obj, found=found: (
                        found.__setitem__(key, obj.shape[0])
                        if isinstance(obj, h5py.Dataset)
                        else None
                    )
                )
                lengths[name] = found
        except OSError:
            continue
    return lengths


@dataclass
class CompactReport:
    """What ``compact`` did: totals over the lanes it compacted (``backup``: the root lane's
    old manifest, or the first compacted lane's), each lane's own report in ``lanes``, and
    the lanes it left alone in ``skipped`` (lane -> why: a live writer holds it, or its
    manifest is damaged)."""

    shards_before: int
    shards_after: int
    merged: int
    bytes_after: int
    backup: str | None
    lanes: dict[str, CompactReport] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def compact(
    path: str | os.PathLike[str],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> CompactReport:
    """Merge adjacent small shards of each lane into shards of up to ``shard_bytes``,
    atomically; shards are merged only within a lane, under that lane's writer lock. A lane
    a live writer holds, or whose manifest has damaged lines, is skipped (``skipped``).

    New shards are written, fsynced and renamed first; then the manifest is replaced in one
    rename (the old one is kept); only then are the merged shards deleted. A kill at any
    point leaves a readable store with every request, and the next writer, ``fsck --repair``
    or ``compact`` removes the leftovers. Readers opened before a compaction must reopen.
    """
    from probehook.store.lock import WriterLock

    root = Path(path)
    read_meta(root)  # a clear error if it is not a store
    lanes, _ = list_lanes(root)
    done: dict[str, CompactReport] = {}
    skipped: dict[str, str] = {}
    for lane in lanes:
        try:
            lock = WriterLock.acquire(root, lane)
        except StoreLockedError as e:
            skipped[lane] = str(e)
            continue
        with lock:
            try:
                done[lane] = _compact_lane(root, lane, shard_bytes, progress)
            except StoreCorruptError as e:
                skipped[lane] = str(e)
    backups = [r.backup for r in done.values() if r.backup]
    return CompactReport(
        sum(r.shards_before for r in done.values()),
        sum(r.shards_after for r in done.values()),
        sum(r.merged for r in done.values()),
        sum(r.bytes_after for r in done.values()),
        backups[0] if backups else None,
        done,
        skipped,
    )


def _compact_lane(store_root: Path, lane: str, shard_bytes: int, progress: bool) -> CompactReport:
    """Compact one lane (holding its writer lock)."""
    from tqdm.auto import tqdm

    root = lane_dir(store_root, lane)
    # torn tail, .tmp and replaced leftovers
    repair_for_append(root, store_root=store_root)
    scan = scan_manifest(root)
    if scan.bad_lines:
        raise StoreCorruptError(
            f"{root / MANIFEST_FILE} has damaged line(s) {scan.bad_lines}; run `probehook "
            f"store fsck {store_root} --repair` before compacting."
        )
    shards = [r for r in scan.records if r.get("kind") == "shard"]
    groups = _plan(shards, shard_bytes)
    renames: dict[str, tuple[str, dict[str, int]]] = {}  # old shard -> new, offsets
    into: list[dict[str, Any]] = []
    desc = "compacting" + ("" if lane == ROOT_LANE else f" lane {lane}")
    bar = tqdm(groups, desc=desc, unit="shard", disable=not progress or not groups)
    for group in bar:
        name = f"{COMPACT_PREFIX}{uuid.uuid4().hex[:12]}.h5"
        offsets = _merge(root / SHARD_DIR, [s["name"] for s in group], name)
        renames.update(offsets)
        into.append(
            {
                "kind": "shard",
                "name": name,
                "bytes": (root / SHARD_DIR / name).stat().st_size,
                "requests": sum(s.get("requests", 0) for s in group),
            }
        )
    if not groups:
        return CompactReport(len(shards), len(shards), 0, _bytes(root, shards), None)
    first_of_group = {g[0]["name"]: new for g, new in zip(groups, into, strict=True)}
    records: list[dict[str, Any]] = []
    for record in scan.records:
        kind = record.get("kind")
        if kind == "shard" and record["name"] in renames:
            if record["name"] in first_of_group:
                records.append(first_of_group[record["name"]])
        elif kind == "request" and record["shard"] in renames:
            new_name, offsets = renames[record["shard"]]
            moved = {**record, "shard": new_name}
            for key in ("segments", "sae_segments"):
                if key in record:
                    moved[key] = [
                        {**seg, "start": seg["start"] + offsets.get(_datasets(seg)[0], 0)}
                        for seg in record[key]
                    ]
            records.append(moved)
        else:
            records.append(record)
    records.append(
        {
            "kind": "compaction",
            "replaced": sorted(renames),
            "into": [s["name"] for s in into],
        }
    )
    backup = rewrite_manifest(root, records, keep_old_as="before-compact")
    remove_replaced_shards(root, records)
    after = [r for r in records if r.get("kind") == "shard"]
    return CompactReport(len(shards), len(after), len(renames), _bytes(root, after), str(backup))


def _datasets(segment: dict[str, Any]) -> list[str]:
    """The datasets a segment's rows lie in (an SAE segment: its three, in step)."""
    if "sae" in segment:
        return [feature_dataset(segment["phase"], segment["sae"], part) for part in PARTS]
    return [dataset_name(segment["phase"], segment["layer"])]


def _plan(shards: list[dict[str, Any]], shard_bytes: int) -> list[list[dict[str, Any]]]:
    """Groups of consecutive shards smaller than ``shard_bytes`` to merge (two or more each)."""
    groups: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    size = 0
    for shard in shards:
        nbytes = int(shard.get("bytes", 0))
        if nbytes >= shard_bytes or (current and size + nbytes > shard_bytes):
            if len(current) > 1:
                groups.append(current)
            current, size = [], 0
        if nbytes < shard_bytes:
            current.append(shard)
            size += nbytes
    if len(current) > 1:
        groups.append(current)
    return groups


def _merge(
    shards_dir: Path, names: list[str], new_name: str
) -> dict[str, tuple[str, dict[str, int]]]:
    """Concatenate the datasets of ``names`` into one new shard (tmp, fsync, rename); return
    for each old shard the new name and the row offset of each of its datasets there.

    Streams one source dataset at a time, so memory stays at the largest source dataset.
    """
    layout: dict[str, list[tuple[str, int]]] = {}  # dataset -> [(shard, rows)] in order
    compressions: dict[str, str | None] = {}
    for name in names:
        with h5py.File(shards_dir / name, "r") as f:

            def note(key: str, obj: Any, name: str = name) -> None:
                if isinstance(obj, h5py.Dataset):
                    layout.setdefault(key, []).append((name, obj.shape[0]))
                    compressions.setdefault(key, obj.compression)

            f.visititems(note)
    offsets: dict[str, tuple[str, dict[str, int]]] = {n: (new_name, {}) for n in names}
    tmp = shards_dir / (new_name + ".tmp")
    with h5py.File(tmp, "w") as out:
        for key, parts in layout.items():
            target = DatasetAppender(out, key, compressions[key])
            for name, _ in parts:
                with h5py.File(shards_dir / name, "r") as f:
                    offsets[name][1][key] = target.append(f[key][()])
            target.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, shards_dir / new_name)
    fsync_dir(shards_dir)
    return offsets


def _bytes(root: Path, shards: list[dict[str, Any]]) -> int:
    return sum((root / SHARD_DIR / s["name"]).stat().st_size for s in shards)
