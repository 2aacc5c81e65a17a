"""One store, two threads: ``probehook serve`` adds finished requests from one thread while its
periodic flush commits from another (issue 37, item 2). Adds and flushes race here as fast as
they can, with Python switching threads every microsecond so that the interleavings a busy
server meets in weeks happen in a second."""

from __future__ import annotations

import errno
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_store_unit import META, fake_request

from probehook.errors import StoreError
from probehook.store import ActivationStore
from probehook.store.writer import PendingRequest, ShardWriter

ADDS = 3000


@pytest.fixture(autouse=True)
def busy_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _race(store: ActivationStore, adds: int) -> tuple[list[str], list[BaseException]]:
    """Adds ``adds`` one-row requests from this thread while another flushes in a loop;
    returns the store ids acknowledged and every error raised by either thread."""
    done = threading.Event()
    errors: list[BaseException] = []

    def flusher() -> None:
        while not done.is_set():
            try:
                store.flush()
            except BaseException as e:  # noqa: BLE001 - the test counts them
                errors.append(e)

    thread = threading.Thread(target=flusher)
    thread.start()
    acked = []
    try:
        for i in range(adds):
            try:
                acked.append(store.add(fake_request(i, prompt_len=1, n_out=1)))
            except StoreError as e:
                errors.append(e)
    finally:
        done.set()
        thread.join()
    return acked, errors


def test_a_flusher_racing_many_adds_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = ActivationStore.for_writing(path, META, shard_bytes=32 << 10)
    acked, errors = _race(store, ADDS)
    assert errors == []
    # What the store counts as not yet durable is exactly what it has not committed.
    assert store.unflushed == len(store._adding)
    store.flush()
    assert store.unflushed == 0
    assert {r.store_id for r in store.requests} == set(acked)  # every commit seen in memory
    store.close()
    assert {r.store_id for r in ActivationStore.open(path).requests} == set(acked)
    assert len(acked) == ADDS


def test_a_write_error_is_reported_once_and_names_what_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills once, mid-race: it is reported once (by one of the two threads, or by
    close() when the writer meets it after both stopped), naming every acknowledged request
    that is not on disk; every other acknowledged request is."""
    write = ShardWriter._write

    def disk_full_once(self: ShardWriter, request: PendingRequest) -> None:
        if request.record["request_id"] == "r1200":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, request)

    monkeypatch.setattr(ShardWriter, "_write", disk_full_once)
    path = tmp_path / "s"
    store = ActivationStore.for_writing(path, META, shard_bytes=32 << 10)
    acked, errors = _race(store, ADDS)
    try:
        store.close()  # the writer may meet the full disk after both threads stopped
    except StoreError as e:
        errors.append(e)
    monkeypatch.undo()
    assert len(errors) == 1, [str(e)[:200] for e in errors]
    (error,) = errors
    assert isinstance(error, StoreError) and "The disk is full" in str(error)
    lost = set(error.lost)
    durable = {r.store_id for r in ActivationStore.open(path).requests}
    assert any(s.endswith("-r1200") for s in lost)
    assert not lost & durable
    assert durable | lost == set(acked)
    # Still appendable after the report.
    again = ActivationStore.for_writing(path, META)
    later = again.add(fake_request(ADDS))
    again.close()
    assert later in {r.store_id for r in ActivationStore.open(path).requests}


def test_a_writer_without_an_index_keeps_ids_not_records(tmp_path: Path) -> None:
    """``probehook serve``'s store (``keep_index=False``): what it commits stays out of its
    in-memory records, which grew by about 4 KB a request in a 30-minute soak (issue 37); the
    ids it wrote still refuse a duplicate, and the store on disk has everything."""
    from probehook.errors import DuplicateStoreIdError

    path = tmp_path / "s"
    store = ActivationStore.for_writing(path, META, keep_index=False)
    ids = [store.add(fake_request(i, prompt_len=1, n_out=1)) for i in range(50)]
    store.flush()
    assert len(store) == 0 and store._records == {}  # nothing of the records is held
    with pytest.raises(DuplicateStoreIdError):
        store.add(fake_request(7, prompt_len=1, n_out=1))
    store.close()
    assert {r.store_id for r in ActivationStore.open(path).requests} == set(ids)
