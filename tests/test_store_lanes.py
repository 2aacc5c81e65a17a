"""Several writers into one store, one per lane (STORE/lanes/NAME/), read as one store.

No vLLM engine: synthetic rows (``fake_request``). Child processes write lanes at once, one is
SIGKILLed mid-commit; in-process tests cover locks, fsck, compact, readers and item ids.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_store_unit import META, fake_request

import probehook
from probehook.errors import StoreFormatError, StoreLockedError
from probehook.store import ActivationStore
from probehook.store.format import (
    LANES_DIR,
    MANIFEST_FILE,
    META_FILE,
    SHARD_DIR,
    WRITER_LOCK,
)
from probehook.store.lock import WriterLock
from probehook.store.maintenance import compact, fsck

REPO = Path(probehook.__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
LAYERS = (1, 3)
N_CHILD = 30  # requests per child lane

# Writes lane argv[2] with requests seeded argv[3].. (argv[4] of them, one flush each), after
# the go file argv[5] appears. Reports whether it wrote meta.json (slowed down on purpose, so
# that two creators without the create lock would both write it).
CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from test_store_unit import META, fake_request
    import probehook.store.store as store_module
    import probehook.store.writer as writer
    from probehook.store import ActivationStore

    root, lane, first, count, go = sys.argv[1:6]
    kill_at = sys.argv[6] if len(sys.argv) > 6 else None
    first, count = int(first), int(count)
    created = []
    original = store_module.write_json_atomic

    def slow_write(path, data):
        if Path(path).name == "meta.json":
            created.append(lane)
            time.sleep(0.5)
        original(path, data)

    store_module.write_json_atomic = slow_write
    print("READY", flush=True)
    while not os.path.exists(go):
        time.sleep(0.002)
    store = ActivationStore.for_writing(root, META, lane=lane)
    print(json.dumps({"created": bool(created)}), flush=True)
    for i in range(first, first + count):
        request = fake_request(i)
        request.record["item_id"] = f"item-{i}"
        if kill_at is not None and i == first + 1:
            def die(name):
                if name == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            writer.fault_hook = die
        store.add(request)
        store.flush()
        print(json.dumps({"acked": i}), flush=True)
        time.sleep(0.01)
    store.close()
    print("DONE", flush=True)
""")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), str(TESTS), env.get("PYTHONPATH")) if p
    )
    return env


def start_child(root: Path, lane: str, first: int, count: int, go: Path, kill_at=None):
    args = [sys.executable, "-c", CHILD, str(root), lane, str(first), str(count), str(go)]
    if kill_at:
        args.append(kill_at)
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
    )


def wait_ready(child: subprocess.Popen) -> None:
    line = child.stdout.readline()
    assert line.strip() == "READY", line + child.stderr.read()


def rows_of(i: int) -> dict[tuple[str, int], torch.Tensor]:
    request = fake_request(i)
    return {(b.phase, b.layer): b.rows for b in request.blocks}


def assert_bit_exact(record, seed: int) -> None:
    expected = rows_of(seed)
    for layer in LAYERS:
        assert torch.equal(record.prefill_hidden_states[layer], expected[("prefill", layer)])
        assert torch.equal(record.hidden_states[layer], expected[("decode", layer)])


def seed_of(record) -> int:
    return int(record.request_id[1:])


def write_lane(root: Path, lane: str | None, seeds, *, flush_each: bool = False, **kw) -> list:
    store = ActivationStore.for_writing(root, META, lane=lane, **kw)
    ids = []
    for i in seeds:
        request = fake_request(i)
        request.record["item_id"] = f"item-{i}"
        ids.append(store.add(request))
        if flush_each:
            store.flush()
    store.flush()
    store.close()
    return ids


def lane_files(root: Path, lane: str) -> dict[str, bytes]:
    base = root / LANES_DIR / lane
    return {
        str(p.relative_to(base)): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and p.name != WRITER_LOCK
    }


# -- several processes -----------------------------------------------------------------------


def test_two_processes_create_and_write_two_lanes_at_once(tmp_path: Path) -> None:
    """Both start at the same instant on a path that does not exist yet: one creates
    meta.json, the other appends to it; both write at once; readers meanwhile see consistent
    prefixes of each lane; the final store holds every record bit-exact."""
    root, go = tmp_path / "new" / "s", tmp_path / "go"
    children = {
        "a": start_child(root, "a", 0, N_CHILD, go),
        "b": start_child(root, "b", 100, N_CHILD, go),
    }
    for child in children.values():
        wait_ready(child)
    go.touch()
    seen_partial = False
    last = {"a": 0, "b": 0}
    try:
        while any(c.poll() is None for c in children.values()):
            if not (root / META_FILE).exists():
                time.sleep(0.01)
                continue
            store = ActivationStore.open(root)
            by_lane: dict[str, list[int]] = {"a": [], "b": []}
            for record in store.requests:
                by_lane[record.lane].append(seed_of(record))
            for lane, first in (("a", 0), ("b", 100)):
                got = by_lane[lane]
                # Each lane commits in order: what a reader sees is a prefix of it.
                assert got == list(range(first, first + len(got))), (lane, got)
                assert len(got) >= last[lane]  # never goes back
                last[lane] = len(got)
                if 0 < len(got) < N_CHILD:
                    seen_partial = True
            for record in list(store.requests)[-2:]:
                assert_bit_exact(record, seed_of(record))
            store.close()
        outputs = {lane: c.communicate(timeout=60) for lane, c in children.items()}
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
    for lane, (out, err) in outputs.items():
        assert children[lane].returncode == 0, err
        assert out.strip().endswith("DONE"), out + err
    created = [json.loads(out.splitlines()[0])["created"] for out, _ in outputs.values()]
    assert sorted(created) == [False, True]  # meta.json written once
    assert (
        not list(root.glob("*.tmp"))
        and json.loads((root / META_FILE).read_text())["hidden_size"] == META["hidden_size"]
    )
    assert seen_partial  # the reads above really ran while the writers were writing

    store = ActivationStore.open(root)
    assert store.lanes == ["", "a", "b"]
    assert len(store) == 2 * N_CHILD and store.dropped == []
    seeds = [seed_of(r) for r in store.requests]
    assert seeds == [*range(N_CHILD), *range(100, 100 + N_CHILD)]  # root, then lanes by name
    for record in store.requests:
        assert_bit_exact(record, seed_of(record))
    # The root lane holds nothing: neither writer wrote into it.
    assert not (root / MANIFEST_FILE).exists()
    assert not list((root / SHARD_DIR).iterdir())


def test_killed_lane_writer_leaves_other_lanes_alone_and_is_repaired(tmp_path: Path) -> None:
    """Lane "k" is SIGKILLed with half a manifest line written, while lane "live" has a shard
    in progress (.tmp) in this process. Lane "done" is byte-for-byte untouched, the live
    writer's .tmp survives the repair of "k", and reopening "k" keeps every acknowledged
    record."""
    root, go = tmp_path / "s", tmp_path / "go"
    done_ids = write_lane(root, "done", range(200, 204))
    before = lane_files(root, "done")
    live = ActivationStore.for_writing(root, META, lane="live")
    live.add(fake_request(300))
    while not list((root / LANES_DIR / "live" / SHARD_DIR).glob("*.tmp")):
        time.sleep(0.005)
    child = start_child(root, "k", 0, 3, go, kill_at="manifest_torn")
    wait_ready(child)
    go.touch()
    out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, out + err
    acked = [json.loads(line)["acked"] for line in out.splitlines() if "acked" in line]
    assert acked == [0]  # request 0 acknowledged; killed while committing request 1

    reader = ActivationStore.open(root)
    assert any("lanes/k/manifest.jsonl tail" in d for d in reader.dropped)
    assert sorted(seed_of(r) for r in reader.requests) == [0, 200, 201, 202, 203]
    assert lane_files(root, "done") == before

    writer = ActivationStore.for_writing(root, META, lane="k")  # takes the dead lock over
    assert (root / LANES_DIR / "k" / MANIFEST_FILE).read_bytes().endswith(b"\n")  # tail cut
    writer.add(fake_request(5))
    writer.flush()
    writer.close()
    assert lane_files(root, "done") == before
    assert list((root / LANES_DIR / "live" / SHARD_DIR).glob("*.tmp"))  # not touched
    live.flush()
    live.close()
    store = ActivationStore.open(root)
    assert store.dropped == []
    assert sorted(seed_of(r) for r in store.requests) == [0, 5, 200, 201, 202, 203, 300]
    for record in store.requests:
        assert_bit_exact(record, seed_of(record))
    assert [r.store_id for r in store.requests if r.lane == "done"] == done_ids


# -- locks ------------------------------------------------------------------------------------


def test_one_writer_per_lane_and_lanes_do_not_share_locks(tmp_path: Path) -> None:
    root = tmp_path / "s"
    a = ActivationStore.for_writing(root, META, lane="a")
    with pytest.raises(StoreLockedError, match=r"Lane 'a' of the activation store .* pid"):
        ActivationStore.for_writing(root, META, lane="a")
    WriterLock.check_free(root)  # a lane writer does not hold the root lane's lock
    with pytest.raises(StoreLockedError):
        WriterLock.check_free(root, "a")
    b = ActivationStore.for_writing(root, META, lane="b")
    main = ActivationStore.for_writing(root, META)  # the root lane, as a single writer
    with pytest.raises(StoreLockedError, match="The activation store at"):
        ActivationStore.for_writing(root, META)
    ids = {}
    for store, seeds, name in ((b, (20, 21), "b"), (main, (0, 1), ""), (a, (10,), "a")):
        ids[name] = []
        for i in seeds:
            ids[name].append(store.add(fake_request(i)))
        store.flush()
    # A writer's store reads every lane (as of its opening) and its own new records, in
    # store order: root lane, then lanes by name, though "b" committed first.
    a.close()
    b.close()
    main.close()
    store = ActivationStore.open(root)
    assert store.lanes == ["", "a", "b"]
    assert [r.store_id for r in store.requests] == ids[""] + ids["a"] + ids["b"]
    for record in store.requests:
        assert_bit_exact(record, seed_of(record))
    info = store.info()
    assert info["lanes"] == {"": 2, "a": 1, "b": 2} and info["requests"] == 5
    # Lane writers keep to their own directory.
    assert sorted(p.name for p in (root / LANES_DIR / "a").iterdir()) == [
        MANIFEST_FILE,
        SHARD_DIR,
        WRITER_LOCK,
    ]


def test_writer_store_reads_other_lanes_in_store_order(tmp_path: Path) -> None:
    root = tmp_path / "s"
    b_ids = write_lane(root, "b", (20,))
    a = ActivationStore.for_writing(root, META, lane="a")
    a_id = a.add(fake_request(10))
    a.flush()
    assert [r.store_id for r in a.requests] == [a_id, *b_ids]  # "a" sorts before "b"
    assert [str(i) for i in a.layer(3).index["store_id"]][:3] == [a_id] * 3
    assert a[b_ids[0]].lane == "b" and a[a_id].lane == "a"
    a.close()


def test_old_single_writer_store_is_the_root_lane(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = write_lane(root, None, (0,))
    assert not (root / LANES_DIR).exists()
    store = ActivationStore.open(root)
    assert store.lanes == [""] and store[first[0]].lane == "" and store.dropped == []
    assert store[first[0]].record["shard"].startswith("shard-")  # keys as before
    second = write_lane(root, "x", (1,))
    store = ActivationStore.open(root)
    assert [r.store_id for r in store.requests] == first + second
    assert store[second[0]].record["shard"].startswith("lanes/x/shard-")


@pytest.mark.parametrize("name", ["", ".", ".hidden", "a/b", "a b", "x" * 65, "ü", "../up"])
def test_bad_lane_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=r"Invalid store lane name .*1-64 characters"):
        ActivationStore.for_writing(tmp_path / "s", META, lane=name)
    assert not (tmp_path / "s").exists()


def test_good_lane_names(tmp_path: Path) -> None:
    for name in ("x" * 64, "a.b-c_1", "replica-0", "0"):
        write_lane(tmp_path / "s", name, ())
    assert ActivationStore.open(tmp_path / "s").lanes == ["", "0", "a.b-c_1", "replica-0", "x" * 64]


def test_lane_writer_checks_appendability(tmp_path: Path) -> None:
    from probehook.errors import StoreFormatError

    root = tmp_path / "s"
    write_lane(root, "a", (0,))
    with pytest.raises(StoreFormatError, match="hidden_size"):
        ActivationStore.for_writing(root, {**META, "hidden_size": 16}, lane="b")
    with pytest.raises(StoreFormatError, match="model_fingerprint"):
        ActivationStore.for_writing(root, {**META, "model_fingerprint": "zzz"}, lane="b")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreFormatError, match="not empty"):
        ActivationStore.for_writing(foreign, META, lane="a")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


# -- reading ----------------------------------------------------------------------------------


def test_layer_batches_and_datasets_span_lanes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    ids = write_lane(root, None, (0,)) + write_lane(root, "b", (2, 3)) + write_lane(root, "a", (1,))
    store = ActivationStore.open(root)
    order = [0, 1, 2, 3]  # root, lane a, lane b
    expected = torch.cat([rows_of(i)[("decode", 3)] for i in order])
    matrix = store.layer(3)
    assert torch.equal(matrix[:], expected)
    assert torch.equal(matrix.take([11, 0, 5]), expected[[11, 0, 5]])
    assert torch.equal(torch.cat(list(matrix.iter_blocks(5))), expected)
    by_seed = dict(zip((0, 2, 3, 1), ids, strict=True))
    assert list(matrix.index["store_id"]) == [by_seed[i] for i in order for _ in range(3)]
    batches = list(store.batches(3, batch_size=4))
    assert torch.equal(torch.cat([b for b, _ in batches]), expected)
    last = store.layer(1, phase="prefill", token="last")
    assert torch.equal(last[:], torch.stack([rows_of(i)[("prefill", 1)][-1] for i in order]))
    dataset = store.to_torch_dataset(3)
    assert torch.equal(dataset[4], expected[4])
    hf = store.to_hf_dataset(3, cache_dir=tmp_path / "hf").with_format("numpy")
    assert list(hf["store_id"][:]) == list(matrix.index["store_id"])
    assert torch.equal(torch.from_numpy(np.stack(hf["activations"][:])), expected)
    assert store.layers == [1, 3] and len(store.runs) == 3
    assert store.info()["shards"] == 3 and store.info()["lanes"] == {"": 1, "a": 1, "b": 2}


def test_item_ids(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, "a", (0, 1))
    plain = ActivationStore.for_writing(root, META, lane="b")
    no_item = plain.add(fake_request(5))  # a record without an item id
    plain.flush()
    assert plain.item_ids() == {"item-0", "item-1"}  # its own committed records count too
    with_item = fake_request(6)
    with_item.record["item_id"] = "item-6"
    plain.add(with_item)
    assert plain.item_ids() == {"item-0", "item-1"}  # not committed yet
    plain.flush()
    assert plain.item_ids() == {"item-0", "item-1", "item-6"}  # kept up to date by flush
    plain.close()
    store = ActivationStore.open(root)
    assert store.item_ids() == {"item-0", "item-1", "item-6"}
    assert store[no_item].item_id is None
    assert {r.item_id for r in store.requests} == {"item-0", "item-1", "item-6", None}


def test_item_ids_read_no_shard(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "s"
    write_lane(root, "a", range(5))
    store = ActivationStore.open(root)

    def no_reads(*args, **kwargs):
        raise AssertionError("item_ids() opened a shard")

    monkeypatch.setattr(store, "_open_shard", no_reads)
    assert store.item_ids() == {f"item-{i}" for i in range(5)}


def test_same_store_id_in_two_lanes_keeps_one(tmp_path: Path, caplog) -> None:
    root = tmp_path / "s"
    ids = write_lane(root, "a", (0, 1))
    shutil.copytree(root / LANES_DIR / "a", root / LANES_DIR / "b")  # the same records again
    store = ActivationStore.open(root)
    assert len(store) == 2 and sorted(r.store_id for r in store.requests) == sorted(ids)
    assert all(r.lane == "b" for r in store.requests)  # the later lane in store order wins
    shadowed = [d for d in store.dropped if "shadowed" in d]
    assert len(shadowed) == 2 and all("lanes/a/" in d and "lanes/b/" in d for d in shadowed)
    for record in store.requests:
        assert_bit_exact(record, seed_of(record))


def test_reader_leaves_out_odd_entries_under_lanes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, "a", (0,))
    (root / LANES_DIR / ".hidden").mkdir()
    (root / LANES_DIR / "stray.txt").write_text("x")
    store = ActivationStore.open(root)
    assert store.lanes == ["", "a"] and len(store) == 1
    assert any(".hidden" in d for d in store.dropped)


# -- fsck and compact -------------------------------------------------------------------------


def corrupt_middle_line(manifest: Path) -> int:
    lines = manifest.read_bytes().split(b"\n")
    number = len(lines) // 2  # 1-based line in the middle, before good lines
    line = bytearray(lines[number - 1])
    line[len(line) // 2] ^= 0x20
    lines[number - 1] = bytes(line)
    manifest.write_bytes(b"\n".join(lines))
    return number


def run_cli(*args: str) -> tuple[int, str]:
    from probehook.cli import main

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            main(["store", *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()


def test_fsck_checks_and_repairs_each_lane(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, None, (0,))
    write_lane(root, "a", (1, 2))
    b_ids = write_lane(root, "b", (3, 4, 5), flush_each=True)
    report = fsck(root)
    assert report.ok and [r.lane for r in report.all_lanes()] == ["", "a", "b"]
    code, out = run_cli("fsck", str(root))
    assert code == 0 and "OK" in out and "in 3 lanes" in out and "lane 'b': 3 requests" in out

    number = corrupt_middle_line(root / LANES_DIR / "b" / MANIFEST_FILE)
    (root / LANES_DIR / "a" / SHARD_DIR / "shard-dead.h5.tmp").write_bytes(b"partial")
    report = fsck(root)
    assert not report.ok and report.lane_ok  # the root lane is fine, lane b is not
    assert report.lanes[1].lane == "b" and report.lanes[1].bad_lines == [number]
    assert report.lanes[0].garbage_files == ["shard-dead.h5.tmp"]
    code, out = run_cli("fsck", str(root))
    assert code == 1 and f"lane 'b': damaged manifest line(s): [{number}]" in out
    assert "lane 'a': interrupted or replaced files (removable)" in out
    assert "DAMAGED" in out
    with pytest.raises(Exception, match=r"damaged line\(s\)"):
        ActivationStore.for_writing(root, META, lane="b")
    ActivationStore.for_writing(root, META, lane="a").close()  # other lanes still append

    code, out = run_cli("fsck", str(root), "--repair")
    assert code == 0 and "lane 'b': repaired; the previous manifest is kept as" in out
    assert fsck(root).ok and not (root / LANES_DIR / "a" / SHARD_DIR / "shard-dead.h5.tmp").exists()
    store = ActivationStore.open(root)
    kept = [r.store_id for r in store.requests if r.lane == "b"]
    assert len(kept) == 2 and set(kept) < set(b_ids) and store.dropped == []
    assert len(store) == 5
    for record in store.requests:
        assert_bit_exact(record, seed_of(record))


def test_fsck_repair_skips_a_lane_with_a_live_writer(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, "a", (0,))
    write_lane(root, "b", (1,))
    with open(root / LANES_DIR / "b" / MANIFEST_FILE, "ab") as f:
        f.write(b'{"crc": 1, "rec')  # a torn tail to repair
    live = ActivationStore.for_writing(root, META, lane="a")
    live.add(fake_request(2))
    tmp_dir = root / LANES_DIR / "a" / SHARD_DIR
    while not list(tmp_dir.glob("*.tmp")):
        time.sleep(0.005)
    before = (root / LANES_DIR / "a" / MANIFEST_FILE).read_bytes()
    report = fsck(root, repair=True)
    a, b = report.lanes
    assert a.skipped and "Lane 'a'" in a.skipped and not a.repaired
    assert b.repaired and b.torn_tail_bytes and b.skipped is None
    assert list(tmp_dir.glob("*.tmp"))  # the live writer's shard in progress is untouched
    assert (root / LANES_DIR / "a" / MANIFEST_FILE).read_bytes() == before
    assert "lane 'a': skipped, not repaired: Lane 'a'" in "\n".join(report.lines())
    live.flush()
    live.close()
    assert sorted(seed_of(r) for r in ActivationStore.open(root).requests) == [0, 1, 2]
    assert fsck(root).ok


def test_compact_merges_within_each_lane(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, None, (0, 1), flush_each=True)
    write_lane(root, "a", (2, 3, 4), flush_each=True)
    write_lane(root, "b", (5, 6), flush_each=True)
    before = ActivationStore.open(root)
    order = [r.store_id for r in before.requests]
    expected = before.layer(3)[:].clone()
    assert before.info()["shards"] == 7
    report = compact(root, progress=False)
    assert set(report.lanes) == {"", "a", "b"} and report.skipped == {}
    assert report.shards_before == 7 and report.shards_after == 3
    for lane in ("", "a", "b"):
        shard_dir = (root / LANES_DIR / lane if lane else root) / SHARD_DIR
        assert len(list(shard_dir.glob("*.h5"))) == 1
    after = ActivationStore.open(root)
    assert [r.store_id for r in after.requests] == order and after.dropped == []
    assert torch.equal(after.layer(3)[:], expected)
    for record in after.requests:
        assert_bit_exact(record, seed_of(record))
        assert record.record["shard"].startswith(f"lanes/{record.lane}/" if record.lane else "c")
    assert fsck(root).ok


def test_compact_skips_a_lane_with_a_live_writer(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, "a", (0, 1), flush_each=True)
    write_lane(root, "b", (2, 3), flush_each=True)
    live = ActivationStore.for_writing(root, META, lane="a")
    before = lane_files(root, "a")
    code, out = run_cli("compact", str(root))
    assert code == 0 and "lane 'a': skipped: Lane 'a'" in out
    assert "lane 'b': 2 shards -> 1" in out
    assert lane_files(root, "a") == before
    live.close()
    store = ActivationStore.open(root)
    assert sorted(seed_of(r) for r in store.requests) == [0, 1, 2, 3]


def test_store_info_cli_names_lanes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_lane(root, None, (0,))
    write_lane(root, "a", (1, 2))
    code, out = run_cli("info", str(root))
    assert code == 0 and "lanes: (root): 1, a: 2" in out


def test_a_store_another_writer_creates_meanwhile_is_not_foreign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving the lanes benchmark met: writer B sees no meta.json, then writer A
    writes meta.json and its shards folder, then B lists the folder. What B lists is a store
    being created, not a foreign folder: B appends (before, it refused with "is not an
    activation store" and its lane's process died)."""
    from probehook.store import appendable

    ActivationStore.for_writing(tmp_path / "s", {"hidden_size": 4}, lane="w0").close()
    real_exists = Path.exists
    first = [True]

    def exists(path: Path) -> bool:  # meta.json is absent at B's first look, only
        if path.name == "meta.json" and first[0]:
            first[0] = False
            return False
        return real_exists(path)

    monkeypatch.setattr(Path, "exists", exists)
    appendable.check_appendable(tmp_path / "s", {"hidden_size": 4})
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreFormatError, match="is not an activation store"):
        appendable.check_appendable(foreign, {"hidden_size": 4})
