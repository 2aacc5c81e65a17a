"""The worker-to-front-end transport: raw bytes, and a disk fallback when /dev/shm is full.

A symlink to ``/dev/full`` stands in for a full tmpfs: the kernel answers every write to it
with ENOSPC, exactly what a full ``/dev/shm`` answers.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from probehook.frontend.transport_reader import read_tensors
from probehook.worker import transport_writer
from probehook.worker.transport_writer import write_tensors, write_tensors_with_fallback


@pytest.fixture()
def full_and_disk(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    if not Path("/dev/full").exists():
        pytest.skip("/dev/full is missing on this machine")  # Linux always has it
    monkeypatch.setattr(transport_writer, "_warned_fallback", False)
    (tmp_path / "shm").mkdir()
    (tmp_path / "disk").mkdir()
    full = tmp_path / "shm" / "export.bin"
    full.symlink_to("/dev/full")
    return full, tmp_path / "disk" / "export.bin"


def tensors() -> list[torch.Tensor]:
    return [
        torch.randn(2, 3, 8),
        torch.arange(12, dtype=torch.bfloat16).view(3, 4),
        torch.empty(2, 0, 8),
    ]


def test_round_trip_is_exact(tmp_path: Path) -> None:
    sent = tensors()
    path = str(tmp_path / "export.bin")
    got = read_tensors(path, write_tensors(path, sent))
    assert not Path(path).exists()  # unlinked once mapped
    for a, b in zip(sent, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_full_shm_falls_back_to_disk_and_says_so_once(full_and_disk, caplog) -> None:
    full, disk = full_and_disk
    sent = tensors()
    with caplog.at_level(logging.WARNING, logger=transport_writer.__name__):
        path, entries = write_tensors_with_fallback([str(full), str(disk)], sent)
        assert path == str(disk)
        assert not full.is_symlink()  # the failed file is removed
        for a, b in zip(sent, read_tensors(path, entries), strict=True):
            assert torch.equal(a, b)
        full.symlink_to("/dev/full")
        write_tensors_with_fallback([str(full), str(disk)], sent)
    warnings = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(warnings) == 1
    assert "--shm-size" in warnings[0].getMessage()


def test_no_room_anywhere_raises(full_and_disk) -> None:
    full, _ = full_and_disk
    with pytest.raises(OSError) as err:
        write_tensors_with_fallback([str(full)], tensors())
    assert err.value.errno == errno.ENOSPC


def test_other_errors_are_not_hidden_by_the_fallback(tmp_path: Path) -> None:
    missing_dir = tmp_path / "gone" / "export.bin"
    with pytest.raises(FileNotFoundError):
        write_tensors_with_fallback([str(missing_dir), str(tmp_path / "export.bin")], tensors())
    assert not (tmp_path / "export.bin").exists()


def test_kept_tensors_hold_no_file_descriptor(tmp_path: Path) -> None:
    """A user who keeps every output of a loop keeps every export's tensors: they must not
    hold a descriptor each (Python's mmap would), or a long loop runs out of them. The memory
    is unmapped once the last tensor over it is gone."""
    import gc
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def maps_of(directory: Path) -> int:
        return Path("/proc/self/maps").read_text().count(str(directory))

    before = open_fds()
    kept = []
    for i in range(300):
        path = str(tmp_path / f"export-{i}.bin")
        sent = [torch.full((4, 8), float(i))]
        kept.append(read_tensors(path, write_tensors(path, sent))[0][1:])
    assert open_fds() <= before + 2, open_fds() - before
    assert all(float(t[0, 0]) == i for i, t in enumerate(kept))
    assert maps_of(tmp_path) == 300
    kept[7].add_(1)  # copy-on-write: writable, and the file is not touched
    del kept
    gc.collect()
    assert maps_of(tmp_path) == 0


def test_a_dropped_spool_removes_its_folders(tmp_path: Path) -> None:
    """A session nobody closed (a unit test's, an LLM never shut down) leaves no folder in
    /dev/shm or the temp folder: the spool removes its own when it is collected, and
    remove() twice is harmless."""
    import gc

    from probehook.frontend.transport_reader import Spool

    spool = Spool(shm=tmp_path)
    dirs = list(spool.dirs)
    assert len(dirs) == 2 and all(d.is_dir() for d in dirs)
    del spool
    gc.collect()
    assert not any(d.exists() for d in dirs)
    spool = Spool(shm=tmp_path)
    spool.remove()
    spool.remove()
    assert not any(d.exists() for d in spool.dirs)
