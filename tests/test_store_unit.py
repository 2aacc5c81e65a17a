"""Activation store without vLLM: format, durability rules and reading."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from probehook.errors import StoreFormatError
from probehook.store import ActivationStore
from probehook.store.format import MANIFEST_FILE, META_FILE, SHARD_DIR
from probehook.store.writer import PendingRequest, RowBlock, ShardWriter

HIDDEN = 8
META = {
    "model": "m",
    "model_fingerprint": "abc",
    "dtype": "float32",
    "hidden_size": HIDDEN,
    "layers": [1, 3],
}


def fake_request(i: int, prompt_len: int = 4, n_out: int = 3, dtype=torch.float32):
    g = torch.Generator().manual_seed(i)
    record = {
        "id": f"r{i}",
        "prompt": f"p{i}",
        "prompt_token_ids": list(range(prompt_len)),
        "sampling_params": {"max_tokens": n_out},
        "completions": [
            {
                "index": 0,
                "token_ids": [10 + t for t in range(n_out)],
                "text": "x" * n_out,
                "finish_reason": "length",
            }
        ],
    }
    blocks = []
    for layer in (1, 3):
        blocks.append(
            RowBlock(
                "prefill", None, layer, 0, torch.randn(prompt_len, HIDDEN, generator=g).to(dtype)
            )
        )
        blocks.append(
            RowBlock(
                "decode",
                0,
                layer,
                prompt_len - 1,
                torch.randn(n_out, HIDDEN, generator=g).to(dtype),
            )
        )
    return PendingRequest(record, blocks)


def write(path: Path, requests, meta=META, **options) -> list[str]:
    """Write one run; return the store ids the store gave the requests."""
    store = ActivationStore.for_writing(path, meta, **options)
    ids = [store.add(r) for r in requests]
    store.flush()
    store.close()
    return ids


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    requests = [fake_request(i, prompt_len=3 + i, n_out=1 + i % 3) for i in range(6)]
    write(tmp_path / "s", requests, shard_bytes=600)  # small cap: several shards
    store = ActivationStore.open(tmp_path / "s")
    assert len(store) == 6 and store.info()["shards"] > 1 and store.dropped == []
    for r in requests:
        got = store[r.record["id"]]
        assert got.prompt == r.record["prompt"] and got.finish_reason == "length"
        for block in r.blocks:
            table = got.prefill_hidden_states if block.phase == "prefill" else got.hidden_states
            assert torch.equal(table[block.layer], block.rows)


def test_bfloat16_round_trip(tmp_path: Path) -> None:
    r = fake_request(0, dtype=torch.bfloat16)
    (store_id,) = write(tmp_path / "s", [r], meta={**META, "dtype": "bfloat16"})
    got = ActivationStore.open(tmp_path / "s")[store_id].hidden_states[3]
    assert got.dtype == torch.bfloat16 and torch.equal(got, r.blocks[3].rows)


def test_layer_matrix_index_and_batches(tmp_path: Path) -> None:
    requests = [fake_request(i, prompt_len=4, n_out=3) for i in range(5)]
    write(tmp_path / "s", requests, shard_bytes=500)
    store = ActivationStore.open(tmp_path / "s")
    matrix = store.layer(3, phase="decode")
    assert matrix.shape == (15, HIDDEN)
    expected = torch.cat([r.blocks[3].rows for r in requests])
    assert torch.equal(matrix[:], expected)
    assert torch.equal(matrix[4:11], expected[4:11])
    assert list(matrix.index["position"][:3]) == [3, 4, 5]
    assert list(matrix.index["token_id"][:3]) == [10, 11, 12]  # the token each row produced
    last = store.layer(1, phase="prefill", token="last")
    assert len(last) == 5 and list(last.index["position"]) == [3] * 5
    assert torch.equal(last[0], requests[0].blocks[0].rows[-1])
    seen = sum(len(rows) for rows, _ in store.batches(3, batch_size=4))
    assert seen == 15
    dataset = store.to_torch_dataset(3, labels=list(range(15)))
    row, label = dataset[7]
    assert torch.equal(row, expected[7]) and label == 7
    with pytest.raises(ValueError, match="valid phases"):
        store.layer(3, phase="middle")
    with pytest.raises(ValueError, match=r"captured layers \[1, 3\]"):
        store.layer(2)


def test_layer_of_a_writing_store_sees_each_flush(tmp_path: Path) -> None:
    """The segment index is built once and extended by each flush, never left stale."""
    requests = [fake_request(i, prompt_len=2 + i, n_out=2) for i in range(6)]
    store = ActivationStore.for_writing(tmp_path / "s", META, shard_bytes=400)
    for begin, end in ((0, 2), (2, 3), (3, 6)):
        for r in requests[begin:end]:
            store.add(r)
        store.flush()
        assert torch.equal(
            store.layer(1, phase="prefill")[:],
            torch.cat([r.blocks[0].rows for r in requests[:end]]),
        )
        last = store.layer(3, phase="decode", token="last")
        assert torch.equal(last[:], torch.stack([r.blocks[3].rows[-1] for r in requests[:end]]))
    store.close()


def test_an_add_during_a_flush_stays_counted_for_the_next_one(tmp_path: Path) -> None:
    """``probehook serve`` flushes from a thread while its event loop adds: a request added
    while a flush runs must still count as unflushed afterwards, so the next periodic flush
    commits it (it used to be wiped and wait for close, found by a CI run of the segmenter's
    server test)."""
    store = ActivationStore.for_writing(tmp_path / "s", META)
    store.add(fake_request(0))
    writer = store._require_writer()
    wait = writer.wait

    def wait_while_another_add_arrives(barrier) -> None:
        wait(barrier)
        store.add(fake_request(1))  # between the writer's flush and the store's bookkeeping

    writer.wait = wait_while_another_add_arrives
    store.flush()
    writer.wait = wait
    assert store.unflushed == 1
    store.flush()
    assert store.unflushed == 0 and {"r0", "r1"} <= {r.request_id for r in store.requests}
    store.close()


def test_append_run_and_refuse_other_model(tmp_path: Path) -> None:
    write(tmp_path / "s", [fake_request(0)])
    write(tmp_path / "s", [fake_request(1)])
    assert len(ActivationStore.open(tmp_path / "s")) == 2
    with pytest.raises(StoreFormatError, match="hidden_size is 8 but this run's is 16"):
        ActivationStore.for_writing(tmp_path / "s", {**META, "hidden_size": 16})


def test_not_a_store_and_version_mismatch(tmp_path: Path) -> None:
    with pytest.raises(StoreFormatError, match="not a probehook activation store"):
        ActivationStore.open(tmp_path)
    write(tmp_path / "s", [fake_request(0)])
    meta = json.loads((tmp_path / "s" / META_FILE).read_text())
    meta["format_version"] = 99
    (tmp_path / "s" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(StoreFormatError, match="version 99.*version 1"):
        ActivationStore.open(tmp_path / "s")


def test_interrupted_shard_and_torn_manifest_are_left_out(tmp_path: Path, caplog) -> None:
    write(tmp_path / "s", [fake_request(0), fake_request(1)])
    root = tmp_path / "s"
    (root / SHARD_DIR / "shard-dead.h5.tmp").write_bytes(b"\x89HDF partial")
    with open(root / MANIFEST_FILE, "a") as f:
        f.write('{"crc": 1, "record": {"kind": "request", "id": "ghost"')  # torn append
    with caplog.at_level(logging.INFO):  # a live writer has these too: not a warning
        store = ActivationStore.open(root)
    assert sorted(r.request_id for r in store.requests) == ["r0", "r1"]
    assert any("shard-dead.h5.tmp" in d for d in store.dropped)
    assert any("torn" in d for d in store.dropped)
    assert "shard-dead.h5.tmp" in caplog.text
    assert "ghost" not in store


def test_write_error_surfaces_from_flush(tmp_path: Path) -> None:
    """A file-size limit (like a full disk) makes the writer fail; flush must raise."""
    script = textwrap.dedent(f"""
        import resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        from probehook.errors import StoreError
        from probehook.store import ActivationStore
        from probehook.store.writer import PendingRequest, RowBlock, ShardWriter
        meta = {META!r}
        meta["hidden_size"] = 1024
        store = ActivationStore.for_writing({str(tmp_path / "s")!r}, meta)
        rows = torch.randn(256, 1024)
        store.add(PendingRequest({{"id": "big", "prompt": "", "prompt_token_ids": [0],
                                   "completions": []}},
                                 [RowBlock("decode", 0, 1, 0, rows)]))
        try:
            store.flush()
        except StoreError as e:
            print("STORE_ERROR", e)
        else:
            print("NO_ERROR")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "STORE_ERROR" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stderr[-2000:]  # no crash at exit either
    assert len(ActivationStore.open(tmp_path / "s")) == 0
    # The failed shard was never committed: it is deleted, not left for HDF5 to retry.
    assert not list((tmp_path / "s" / SHARD_DIR).glob("*.tmp"))


def test_backpressure_blocks_the_producer(tmp_path: Path, monkeypatch) -> None:
    """With the disk stalled, a producer submitting more than max_queue_bytes must wait."""
    release = threading.Event()
    write = ShardWriter._write
    stalled: list[PendingRequest] = []

    def stalled_write(self: ShardWriter, request: PendingRequest) -> None:
        if not stalled:  # the first request holds the writer thread: a stalled disk
            stalled.append(request)
            release.wait(timeout=30)
        write(self, request)

    monkeypatch.setattr(ShardWriter, "_write", stalled_write)
    requests = [fake_request(i) for i in range(10)]
    assert sum(r.nbytes for r in requests) > 4 * 1024
    store = ActivationStore.for_writing(tmp_path / "s", META, max_queue_bytes=1024)
    done = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for r in requests:
                store.add(r)
        except BaseException as e:
            errors.append(e)
        done.set()

    producer = threading.Thread(target=produce, daemon=True)
    try:
        producer.start()
        assert not done.wait(0.3), "the producer was not held back by a full queue"
        assert store._writer._queued_bytes <= 1024
    finally:
        release.set()
    producer.join(timeout=30)
    assert done.is_set() and not errors
    store.flush()
    assert len(store) == 10
    store.close()
    reader = ActivationStore.open(tmp_path / "s")
    for r in requests:
        got = reader[r.record["id"]]
        for block in r.blocks:
            table = got.prefill_hidden_states if block.phase == "prefill" else got.hidden_states
            assert torch.equal(table[block.layer], block.rows)


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_staged_writes_cut_at_chunk_ends_stay_exact(
    tmp_path: Path, monkeypatch, compression: str | None
) -> None:
    import probehook.store.appender as appender

    monkeypatch.setattr(appender, "STAGE_BYTES", 700)
    monkeypatch.setattr(appender, "CHUNK_BYTES", 5 * HIDDEN * 4)  # 5-row chunks
    requests = [fake_request(i, prompt_len=3 + i % 4, n_out=1 + i % 5) for i in range(30)]
    write(tmp_path / "s", requests, shard_bytes=5000, compression=compression)
    store = ActivationStore.open(tmp_path / "s")
    for r in requests:
        got = store[r.record["id"]]
        for block in r.blocks:
            table = got.prefill_hidden_states if block.phase == "prefill" else got.hidden_states
            assert torch.equal(table[block.layer], block.rows)
    expected = torch.cat([r.blocks[3].rows for r in requests])
    assert torch.equal(store.layer(3)[:], expected)


def test_append_after_crash_repairs_torn_tail(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write(root, [fake_request(0)])
    (root / SHARD_DIR / "shard-dead.h5.tmp").write_bytes(b"partial")
    with open(root / MANIFEST_FILE, "a") as f:
        f.write('{"crc": 1, "record": {"kind": "shard"')  # the crash tore this line
    write(root, [fake_request(1)])  # a new run appends after the crash
    store = ActivationStore.open(root)
    assert sorted(r.request_id for r in store.requests) == ["r0", "r1"]
    assert store.dropped == []
