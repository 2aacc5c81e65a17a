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

from probehook.errors import StoreCorruptError, StoreError, StoreLockedError
from probehook.outputs.top_k import SEGMENT_NAME_KEY
from probehook.store.appender import DatasetAppender
from probehook.store.contents import read_meta
from probehook.store.features import (
    EXTRA_PREFIX,
    LAYOUT,
    PARTS,
    feature_dataset,
    layout_of,
    layout_parts,
    segment_group,
)
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
    merged = {s["name"] for g in groups for s in g}
    sae_groups: dict[str, dict[str, tuple[str, str, str | None]]] = {}
    for record in scan.records:
        if record.get("kind") == "request" and record["shard"] in merged:
            for seg in record.get("sae_segments", ()):
                if seg["count"]:
                    where = (seg["phase"], seg[SEGMENT_NAME_KEY], seg.get("layout"))
                    sae_groups.setdefault(record["shard"], {})[segment_group(seg)] = where
    renames: dict[str, _Moved] = {}  # old shard -> where its datasets went
    into: list[dict[str, Any]] = []
    desc = "compacting" + ("" if lane == ROOT_LANE else f" lane {lane}")
    bar = tqdm(groups, desc=desc, unit="shard", disable=not progress or not groups)
    for group in bar:
        name = f"{COMPACT_PREFIX}{uuid.uuid4().hex[:12]}.h5"
        try:
            offsets = _merge(root / SHARD_DIR, [s["name"] for s in group], name, sae_groups)
        except StoreError:
            # A refusal: the copies made so far are referenced by nothing; remove them now.
            for done in into:
                (root / SHARD_DIR / done["name"]).unlink(missing_ok=True)
            raise
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
            target = renames[record["shard"]]
            moved = {**record, "shard": target.name}
            moved["segments"] = [
                {**seg, "start": seg["start"] + target.offsets.get(_datasets(seg)[0], 0)}
                for seg in record["segments"]
            ]
            if "sae_segments" in record:
                moved["sae_segments"] = [target.sae_segment(seg) for seg in record["sae_segments"]]
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
    """The datasets a segment's rows lie in (a top-k segment: its layout's, in step)."""
    if SEGMENT_NAME_KEY in segment:
        group = segment_group(segment)
        return [f"{group}/{part}" for part in layout_parts(segment.get("layout"))]
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


@dataclass
class _Moved:
    """Where one merged shard's datasets went."""

    name: str
    """The new shard."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Source dataset -> the row its first row became in its destination dataset."""
    layouts: dict[str, str] = field(default_factory=dict)
    """Source SAE group -> its layout: its rows are in ``{phase}/sae_{name}/{layout}`` now."""

    def sae_segment(self, seg: dict[str, Any]) -> dict[str, Any]:
        """An SAE segment of a request of the old shard, pointed at its rows in the new."""
        group = segment_group(seg)
        layout = self.layouts.get(group)
        if layout is None:  # no rows (count 0): there is no group to follow
            return dict(seg)
        offset = self.offsets[f"{group}/{PARTS[0]}"]
        return {**seg, "layout": layout, "start": seg["start"] + offset}


def _merge(
    shards_dir: Path,
    names: list[str],
    new_name: str,
    sae_groups: dict[str, dict[str, tuple[str, str, str | None]]],
) -> dict[str, _Moved]:
    """Concatenate the datasets of ``names`` into one new shard (tmp, fsync, rename); return
    for each old shard where its datasets went (:class:`_Moved`).

    Row datasets go to the dataset of the same name. SAE datasets go to the group of their
    layout (store/features.py), read from the datasets themselves, so rows of another width,
    index type or value type are never appended to each other and every stored value is
    copied as it is. ``sae_groups``: each shard's SAE groups that its records' segments name
    (group -> ``(phase, sae, layout)``). A group whose three datasets are out of step (or
    that a segment names but the shard lacks) is refused with a :class:`StoreError` naming
    the SAE, and nothing is written.

    Streams one source dataset at a time, so memory stays at the largest source dataset.
    """
    plan: dict[str, list[tuple[str, str]]] = {}  # destination -> [(shard, source)] in order
    compressions: dict[str, str | None] = {}
    moved = {n: _Moved(new_name) for n in names}
    owners: dict[str, str] = {}  # destination dataset -> its stored name (for messages)
    for name in names:
        with h5py.File(shards_dir / name, "r") as f:
            keys: list[str] = []
            f.visititems(
                lambda key, obj, keys=keys: (
                    keys.append(key) if isinstance(obj, h5py.Dataset) else None
                )
            )
            targets = _sae_destinations(
                f, name, keys, sae_groups.get(name, {}), moved[name], owners
            )
            # All parts of a source group next to each other, groups in one order for every
            # part: groups that share a destination land at the same row in each of its three.
            for key in sorted(keys, key=lambda k: k.rpartition("/")[0]):
                dest = targets.get(key, key)
                plan.setdefault(dest, []).append((name, key))
                compressions.setdefault(dest, f[key].compression)
    tmp = shards_dir / (new_name + ".tmp")
    try:
        with h5py.File(tmp, "w") as out:
            for dest, parts in plan.items():
                target = DatasetAppender(out, dest, compressions[dest])
                for name, key in parts:
                    with h5py.File(shards_dir / name, "r") as f:
                        try:
                            moved[name].offsets[key] = target.append(f[key][()])
                        except ValueError as e:
                            what = f"{owners[dest]!r}'s" if dest in owners else "the"
                            raise StoreError(
                                f"Cannot compact {what} dataset {key} of shard {name} into "
                                f"{dest}: {e}. Nothing was changed."
                            ) from e
                target.close()
        for name in names:
            for group, layout in moved[name].layouts.items():
                starts = {moved[name].offsets[f"{group}/{p}"] for p in layout_parts(layout)}
                if len(starts) != 1:  # a bug, not damage: refuse rather than misplace rows
                    raise StoreError(
                        f"Compacting shard {name}: SAE datasets of {group} would land at rows "
                        f"{sorted(starts)}, out of step. Nothing was changed."
                    )
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, shards_dir / new_name)
    fsync_dir(shards_dir)
    return moved


def _sae_destinations(
    f: h5py.File,
    shard: str,
    keys: list[str],
    named: dict[str, tuple[str, str, str | None]],
    moved: _Moved,
    owners: dict[str, str],
) -> dict[str, str]:
    """Where the SAE datasets of shard ``f`` go: ``{source dataset: destination}``; notes each
    group's layout in ``moved`` and each destination's stored name in ``owners``.

    An SAE group is one that segments name (``named``), or any group holding the three
    datasets (kept even if no record names it, as every other dataset is). Its destination is
    ``{phase}/sae_{name}/{layout}`` with the layout of its datasets as they are."""
    datasets = set(keys)
    groups = {g: named[g] for g in named}
    for key in keys:
        group, _, part = key.rpartition("/")
        whole = all(f"{group}/{p}" in datasets for p in PARTS)
        if part == PARTS[0] and group not in groups and whole:
            # Not named by any record: a layout group if its name says so, else a group of a
            # store written before layouts.
            parent, _, last = group.rpartition("/")
            base = parent if LAYOUT.fullmatch(last) and parent else group
            phase, _, sae = base.partition("/")
            groups[group] = (phase, sae.removeprefix("sae_"), last if base == parent else None)
    targets: dict[str, str] = {}
    for group, (phase, sae, recorded) in groups.items():
        missing = [p for p in PARTS if f"{group}/{p}" not in datasets]
        if missing:
            raise StoreError(
                f"Cannot compact shard {shard}: its records name SAE {sae!r}'s features in "
                f"{group}, which lacks {missing}. Run `probehook store fsck` on the store. "
                "Nothing was changed."
            )
        mine = sorted(
            part for g, _, part in (k.rpartition("/") for k in keys)
            if g == group and part.startswith(EXTRA_PREFIX)
        )  # fmt: skip
        parts = {p: f[f"{group}/{p}"] for p in (*PARTS, *mine)}
        rows = {p: d.shape[0] for p, d in parts.items()}
        if len(set(rows.values())) != 1:
            raise StoreError(
                f"Cannot compact shard {shard}: the datasets of SAE {sae!r} in {group} are out "
                f"of step ({rows} rows), so their rows cannot be moved together. Nothing was "
                "changed; the shard may be damaged (`probehook store fsck`)."
            )
        layout = layout_of(parts)
        if recorded is not None and recorded != layout:
            raise StoreError(
                f"Cannot compact shard {shard}: its records say SAE {sae!r}'s features in "
                f"{group} are laid out as {recorded}, but its datasets are {layout}. Nothing "
                "was changed; the shard may be damaged."
            )
        moved.layouts[group] = layout
        for p in parts:
            dest = feature_dataset(phase, sae, p, layout)
            targets[f"{group}/{p}"] = dest
            owners[dest] = sae
    return targets


def _bytes(root: Path, shards: list[dict[str, Any]]) -> int:
    return sum((root / SHARD_DIR / s["name"]).stat().st_size for s in shards)
