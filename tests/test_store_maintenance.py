"""A store that lives for months: damaged manifests, fsck, thousands of shards, compaction,
and appended runs that capture other layers. No vLLM engine: synthetic rows."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_store_unit import HIDDEN, META, fake_request, write

from probehook.errors import StoreCorruptError
from probehook.store import ActivationStore
from probehook.store.appender import DatasetAppender
from probehook.store.format import MANIFEST_FILE, SHARD_DIR
from probehook.store.maintenance import compact, fsck
from probehook.store.writer import PendingRequest, RowBlock


def corrupt_line(root: Path, number: int) -> None:
    """Flip a byte inside manifest line ``number`` (1-based), keeping its newline."""
    lines = (root / MANIFEST_FILE).read_bytes().split(b"\n")
    line = bytearray(lines[number - 1])
    line[len(line) // 2] ^= 0x20
    lines[number - 1] = bytes(line)
    (root / MANIFEST_FILE).write_bytes(b"\n".join(lines))


def line_of(root: Path, text: str) -> int:
    lines = (root / MANIFEST_FILE).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_bad_line_in_the_middle_loses_only_itself(tmp_path: Path, caplog) -> None:
    root = tmp_path / "s"
    first = write(root, [fake_request(0), fake_request(1)])
    second = write(root, [fake_request(2), fake_request(3)])
    corrupt_line(root, line_of(root, first[1]))
    before = (root / MANIFEST_FILE).read_bytes()
    with caplog.at_level(logging.WARNING):
        store = ActivationStore.open(root)
    # Readers skip the damaged line with a warning and keep everything after it.
    assert sorted(store._records) == sorted([first[0], *second])
    assert "corrupt" in caplog.text
    # Writers refuse to append rather than cut acknowledged records.
    with pytest.raises(StoreCorruptError, match=r"damaged line\(s\) \[\d+\].*fsck.*--repair"):
        ActivationStore.for_writing(root, META)
    assert (root / MANIFEST_FILE).read_bytes() == before


def test_complete_bad_last_line_is_not_cut(tmp_path: Path) -> None:
    """Only bytes after the last newline were never acknowledged; a whole bad line was."""
    root = tmp_path / "s"
    ids = write(root, [fake_request(0), fake_request(1)])
    corrupt_line(root, line_of(root, ids[1]))
    with pytest.raises(StoreCorruptError):
        ActivationStore.for_writing(root, META)


def test_fsck_reports_and_repair_keeps_every_verifiable_record(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = write(root, [fake_request(0), fake_request(1)])
    second = write(root, [fake_request(2)])
    corrupt_line(root, line_of(root, first[0]))
    (root / SHARD_DIR / "shard-dead.h5.tmp").write_bytes(b"partial")
    with open(root / MANIFEST_FILE, "ab") as f:
        f.write(b'{"crc": 1, "record": {"kind"')  # torn tail
    report = fsck(root)
    assert not report.ok and report.bad_lines and report.torn_tail_bytes > 0
    assert report.garbage_files == ["shard-dead.h5.tmp"]
    assert (root / SHARD_DIR / "shard-dead.h5.tmp").exists()  # a check changes nothing

    repaired = fsck(root, repair=True)
    assert repaired.ok and repaired.repaired
    backup = Path(repaired.backup)
    assert backup.exists() and b"partial" not in backup.read_bytes()
    assert not (root / SHARD_DIR / "shard-dead.h5.tmp").exists()
    store = ActivationStore.open(root)
    assert sorted(store._records) == sorted([first[1], *second]) and store.dropped == []
    assert fsck(root).ok
    # Appending works again, and nothing that was readable was lost.
    third = write(root, [fake_request(4)])
    assert sorted(ActivationStore.open(root)._records) == sorted([first[1], *second, *third])


def test_fsck_finds_rows_that_cannot_be_read(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write(root, [fake_request(0)])
    ids = write(root, [fake_request(1)])
    shard = ActivationStore.open(root)[ids[0]].record["shard"]
    (root / SHARD_DIR / shard).unlink()
    report = fsck(root)
    assert report.missing_shards == [shard] and report.unverifiable_requests == ids
    assert fsck(root, repair=True).ok
    assert len(ActivationStore.open(root)) == 1


def test_cli_fsck_and_compact(tmp_path: Path) -> None:
    root = tmp_path / "s"
    for i in range(3):
        write(root, [fake_request(i)])
    cli = [sys.executable, "-m", "probehook.cli", "store"]
    ok = subprocess.run([*cli, "fsck", str(root)], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr
    merged = subprocess.run([*cli, "compact", str(root)], capture_output=True, text=True)
    assert merged.returncode == 0 and "3 shards -> 1" in merged.stdout, merged.stderr
    corrupt_line(root, 2)
    bad = subprocess.run([*cli, "fsck", str(root)], capture_output=True, text=True)
    assert bad.returncode == 1 and "DAMAGED" in bad.stdout
    missing = subprocess.run([*cli, "fsck", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode != 0 and "not a probehook activation store" in missing.stderr


@pytest.fixture()
def few_file_handles():
    """A low open-file limit, so a reader that keeps every shard open fails as it would past
    about a thousand shards under the usual limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # 512 handles beyond what this process already holds (engines and sockets of earlier
    # tests in the same session hold hundreds): still far below 2000 shards.
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(in_use + 512, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_two_thousand_shards_read_then_compact(tmp_path: Path, few_file_handles) -> None:
    root = tmp_path / "s"
    store = ActivationStore.for_writing(root, META)
    requests = [fake_request(i, prompt_len=2, n_out=1) for i in range(2000)]
    for r in requests:
        store.add(r)
        store.flush()  # one shard per request, like one generate() per prompt
    store.close()
    expected = torch.cat([r.blocks[3].rows for r in requests])
    reader = ActivationStore.open(root)
    assert reader.info()["shards"] == 2000
    assert torch.equal(reader.layer(3)[:], expected)
    assert len(reader._files) <= reader.max_open_files
    reader.close()

    report = compact(root, shard_bytes=64 << 20, progress=False)
    assert report.shards_before == 2000 and report.shards_after == 1
    compacted = ActivationStore.open(root)
    assert compacted.info()["shards"] == report.shards_after
    assert len(list((root / SHARD_DIR).glob("*.h5"))) == report.shards_after
    assert torch.equal(compacted.layer(3)[:], expected)
    first = compacted[requests[0].record["id"]]
    assert torch.equal(first.prefill_hidden_states[1], requests[0].blocks[0].rows)
    assert fsck(root).ok


@pytest.mark.parametrize("stage", ["after_new_shards", "after_manifest"])
def test_compaction_killed_midway_keeps_every_request(tmp_path: Path, stage: str) -> None:
    """A kill before the manifest swap leaves unreferenced compact-* shards; after it, the
    replaced shards. Either way every request reads back, and cleanup removes the leftovers."""
    import probehook.store.maintenance as maintenance

    root = tmp_path / "s"
    ids = [write(root, [fake_request(i)])[0] for i in range(4)]
    expected = {i: ActivationStore.open(root)[i].hidden_states[3].clone() for i in ids}

    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed

    target = "rewrite_manifest" if stage == "after_new_shards" else "remove_replaced_shards"
    original = getattr(maintenance, target)
    maintenance.__dict__[target] = die
    try:
        with pytest.raises(Killed):
            compact(root, progress=False)
    finally:
        maintenance.__dict__[target] = original
    store = ActivationStore.open(root)
    assert {i: store[i].hidden_states[3] for i in ids}.keys() == expected.keys()
    for i in ids:
        assert torch.equal(store[i].hidden_states[3], expected[i])
    leftovers = fsck(root).garbage_files
    assert leftovers  # compact-* copies, or the replaced originals
    fsck(root, repair=True)
    assert fsck(root).garbage_files == [] and fsck(root).orphan_shards == []
    for i in ids:
        assert torch.equal(ActivationStore.open(root)[i].hidden_states[3], expected[i])


def request_with_layers(i: int, layers: list[int]) -> PendingRequest:
    request = fake_request(i)
    blocks = []
    for layer in layers:
        rows = torch.full((3, HIDDEN), float(i * 10 + layer))
        blocks.append(RowBlock("decode", 0, layer, 3, rows))
    return PendingRequest(request.record, blocks)


def test_appended_runs_with_other_layers(tmp_path: Path, caplog) -> None:
    root = tmp_path / "s"
    store = ActivationStore.for_writing(root, META)  # the store was created with [1, 3]
    store.begin_run({"capture": {"layers": [1, 3]}})
    a = store.add(request_with_layers(0, [1, 3]))
    store.flush()
    store.close()
    store = ActivationStore.for_writing(root, META)
    run_b = store.begin_run({"capture": {"layers": [2, 3]}})
    b = store.add(request_with_layers(1, [2, 3]))
    store.flush()
    store.close()

    reader = ActivationStore.open(root)
    assert reader.layers == [1, 2, 3] and reader.info()["layers"] == [1, 2, 3]
    assert reader[b].run == run_b and reader.run_layers(run_b) == [2, 3]
    with caplog.at_level(logging.WARNING):
        two = reader.layer(2)
    assert list(two.index["store_id"]) == [b] * 3 and torch.all(two[:] == 12.0)
    assert two.missing_runs == [reader[a].run] and reader[a].run in caplog.text
    three = reader.layer(3)
    assert three.missing_runs == [] and len(three) == 6
    with pytest.raises(ValueError, match=r"captured layers \[1, 2, 3\]"):
        reader.layer(0)


def test_an_appender_refuses_rows_of_another_type_or_width(tmp_path: Path) -> None:
    """A dataset holds one dtype and width: a chunk buffer of the first rows' dtype used to
    take later rows by casting (uint32 SAE indices cut to uint16 by compaction)."""
    with h5py.File(tmp_path / "f.h5", "w") as f:
        target = DatasetAppender(f, "decode/sae_s/indices", None)
        assert target.append(np.zeros((3, 6), dtype=np.uint16)) == 0
        assert target.append(np.zeros((0, 4), dtype=np.uint32)) == 3  # no rows: nothing to hold
        with pytest.raises(ValueError, match="decode/sae_s/indices.*uint16.*refusing uint32"):
            target.append(np.full((2, 6), 70_000, dtype=np.uint32))
        with pytest.raises(ValueError, match=r"\(6,\).*\(4,\)"):
            target.append(np.zeros((2, 4), dtype=np.uint16))
        target.close()
        assert f["decode/sae_s/indices"].shape == (3, 6)


def test_fsck_follows_each_sae_layout(tmp_path: Path) -> None:
    """fsck checks SAE segments in the dataset of their layout: after compacting runs of two
    layouts into one shard, damage to one layout's datasets costs only that run's requests."""
    from test_store_features import sae_run

    root = tmp_path / "s"
    small = sae_run(root, range(3), 512, 8)
    wide = sae_run(root, range(3, 6), 70_000, 4)
    compact(root, progress=False)
    assert fsck(root).ok
    store = ActivationStore.open(root)
    seg = store[next(iter(wide))].record["sae_segments"][0]
    assert seg["layout"] == "k4-uint32-float32"
    with h5py.File(root / SHARD_DIR / store[next(iter(wide))].record["shard"], "r+") as f:
        values = f[f"{seg['phase']}/sae_s/{seg['layout']}/values"]
        values.resize(0, axis=0)
    report = fsck(root)
    assert sorted(report.unverifiable_requests) == sorted(wide)
    assert fsck(root, repair=True).ok
    assert sorted(ActivationStore.open(root)._records) == sorted(small)
