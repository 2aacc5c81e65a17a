"""One writer at a time: the store's writer lock, in one process and across processes."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_store_unit import META, fake_request

import probehook
from probehook.errors import StoreError, StoreLockedError
from probehook.store import ActivationStore
from probehook.store.format import MANIFEST_FILE, SHARD_DIR, WRITER_LOCK
from probehook.store.writer import PendingRequest, ShardWriter

REPO = Path(probehook.__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# Commits r0, leaves r1 in an open .tmp shard, says READY, then waits for a line on stdin.
CHILD_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from test_store_unit import META, fake_request
    from probehook.store import ActivationStore

    root = Path(sys.argv[1])
    store = ActivationStore.for_writing(root, META)
    store.add(fake_request(0))
    store.flush()
    store.add(fake_request(1))
    while not list((root / "shards").glob("*.tmp")):
        time.sleep(0.01)
    print("READY", flush=True)
    sys.stdin.readline()
    store.close()
""")


def start_child_writer(root: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), str(TESTS), env.get("PYTHONPATH")) if p
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_WRITER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    ready, _, _ = select.select([child.stdout], [], [], 60)
    line = child.stdout.readline() if ready else ""
    if line.strip() != "READY":
        child.kill()
        pytest.fail(f"child writer did not start: {line!r} {child.communicate()[1]}")
    return child


def wait_for_tmp_shard(root: Path) -> list[Path]:
    deadline = time.monotonic() + 30
    while not tmp_shards(root):
        assert time.monotonic() < deadline, "the writer thread never opened a shard"
        time.sleep(0.01)
    return tmp_shards(root)


def assert_rows_equal(store: ActivationStore, request: PendingRequest) -> None:
    # Look up by vLLM's request id: the store id also names the run, unknown here.
    wanted = request.record.get("request_id", request.record["id"])
    got = next(r for r in store.requests if r.request_id == wanted)
    for block in request.blocks:
        table = got.prefill_hidden_states if block.phase == "prefill" else got.hidden_states
        assert torch.equal(table[block.layer], block.rows)


def tmp_shards(root: Path) -> list[Path]:
    return sorted((root / SHARD_DIR).glob("*.tmp"))


def test_lock_error_is_exported_and_a_store_error() -> None:
    assert issubclass(StoreLockedError, StoreError)
    assert probehook.StoreLockedError is StoreLockedError
    assert "StoreLockedError" in probehook.__all__
    assert probehook.store.StoreLockedError is StoreLockedError


def test_second_writer_in_the_same_process_is_refused(tmp_path: Path, caplog) -> None:
    root = tmp_path / "s"
    first = ActivationStore.for_writing(root, META)
    holder = json.loads((root / WRITER_LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(StoreLockedError) as refused:
        ActivationStore.for_writing(root, META)
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert f"since {holder['since']}" in message
    assert "this process" in message and "another store path" in message
    first.add(fake_request(0))
    first.flush()
    first.close()
    assert (root / WRITER_LOCK).read_text() == ""  # released: no holder recorded
    with caplog.at_level(logging.WARNING):
        again = ActivationStore.for_writing(root, META)  # closed cleanly: no takeover
    again.close()
    assert "taking over" not in caplog.text
    assert len(ActivationStore.open(root)) == 1


def test_writer_in_another_process_holds_the_lock(tmp_path: Path, caplog) -> None:
    root = tmp_path / "s"
    child = start_child_writer(root)
    try:
        with pytest.raises(StoreLockedError, match=f"pid {child.pid} on host "):
            ActivationStore.for_writing(root, META)
    finally:
        child.communicate("\n", timeout=60)  # the child flushes r1 and closes
    assert child.returncode == 0
    with caplog.at_level(logging.WARNING):
        store = ActivationStore.for_writing(root, META)
    store.close()
    assert "taking over" not in caplog.text
    assert sorted(r.request_id for r in ActivationStore.open(root).requests) == ["r0", "r1"]


def test_refused_writer_leaves_the_live_shard_alone(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = ActivationStore.for_writing(root, META, shard_bytes=1 << 20)
    requests = [fake_request(i) for i in range(3)]
    first.add(requests[0])
    first.flush()
    first.add(requests[1])
    first.add(requests[2])
    live = wait_for_tmp_shard(root)
    manifest = (root / MANIFEST_FILE).read_bytes()
    with pytest.raises(StoreLockedError):
        ActivationStore.for_writing(root, META)
    assert tmp_shards(root) == live and (root / MANIFEST_FILE).read_bytes() == manifest
    first.flush()  # would fail if the refused writer had "repaired" the live .tmp away
    first.close()
    store = ActivationStore.open(root)
    assert len(store) == 3 and store.dropped == [] and not tmp_shards(root)
    for r in requests:
        assert_rows_equal(store, r)


def test_killed_writer_lock_is_taken_over(tmp_path: Path, caplog) -> None:
    root = tmp_path / "s"
    child = start_child_writer(root)
    with pytest.raises(StoreLockedError, match=f"pid {child.pid}"):
        ActivationStore.for_writing(root, META)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    interrupted = tmp_shards(root)
    assert len(interrupted) == 1
    reader = ActivationStore.open(root)  # a reader neither repairs nor needs the lock
    assert [r.request_id for r in reader.requests] == ["r0"]
    assert tmp_shards(root) == interrupted
    with caplog.at_level(logging.WARNING):
        store = ActivationStore.for_writing(root, META)
    host = socket.gethostname()
    assert f"writer lock of pid {child.pid} on host {host}" in caplog.text
    assert not tmp_shards(root)  # removed only once the lock was ours
    store.add(fake_request(2))
    store.flush()
    store.close()
    reader = ActivationStore.open(root)
    assert sorted(r.request_id for r in reader.requests) == ["r0", "r2"]
    assert reader.dropped == []
    for i in (0, 2):
        assert_rows_equal(reader, fake_request(i))


def test_readers_open_while_a_writer_holds_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "s"
    writer = ActivationStore.for_writing(root, META)
    requests = [fake_request(i) for i in range(4)]
    for r in requests[:3]:
        writer.add(r)
    writer.flush()
    writer.add(requests[3])  # not flushed: readers must not see it
    holder = (root / WRITER_LOCK).read_bytes()
    for _ in range(2):  # two readers at once, both without the lock
        reader = ActivationStore.open(root)
        assert sorted(r.request_id for r in reader.requests) == ["r0", "r1", "r2"]
        for r in requests[:3]:
            assert_rows_equal(reader, r)
    assert (root / WRITER_LOCK).read_bytes() == holder
    writer.flush()
    writer.close()
    assert len(ActivationStore.open(root)) == 4


def test_a_failed_writer_still_releases_the_lock(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "s"

    def failing_write(self: ShardWriter, request: PendingRequest) -> None:
        raise OSError(28, "No space left on device")

    store = ActivationStore.for_writing(root, META)
    thread = store._writer._thread
    with monkeypatch.context() as patch:
        patch.setattr(ShardWriter, "_write", failing_write)
        store.add(fake_request(0))
        with pytest.raises(StoreError, match="No space left"):
            store.close()
    assert not thread.is_alive()  # stopped before the lock went, so nothing can touch a .tmp
    again = ActivationStore.for_writing(root, META)  # the lock was released all the same
    again.add(fake_request(1))
    again.flush()
    again.close()
    assert [r.request_id for r in ActivationStore.open(root).requests] == ["r1"]
