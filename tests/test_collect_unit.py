"""Collections without an engine: items and ids, the skip of stored items, reruns refused,
CPU groups, Ray missing, bad arguments, capture-only refusals at construction."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest

from probehook.collect import collector
from probehook.collect.items import make_items, read_items
from probehook.collect.ray_pool import cpu_groups
from probehook.errors import CaptureConfigError, MissingExtraError


def test_prompts_files_give_items_with_ids(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    lines = ['"plain"', '{"prompt": "no id"}', "", '{"id": "doc-7", "prompt": "with id"}']
    lines.append('{"id": 12, "prompt": [1, 5, 14]}')
    jsonl.write_text("\n".join(lines) + "\n")
    items = read_items(jsonl)
    assert [(i.id, i.prompt) for i in items] == [
        ("1", "plain"),
        ("2", "no id"),
        ("doc-7", "with id"),
        ("12", [1, 5, 14]),
    ]
    text = tmp_path / "p.txt"
    text.write_text("first\n\nthird\n")
    assert [(i.id, i.prompt) for i in read_items(text)] == [("1", "first"), ("3", "third")]
    assert [i.id for i in make_items(["a", "b"])] == ["0", "1"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n',
            r"Duplicate item ids.*\['a'\]",
        ),
        ('{"id": true, "prompt": "x"}\n', "must be a string or an int"),
        ('{"text": "x"}\n', "expected a JSON string"),
        ("{broken\n", "not valid JSON"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompts_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(CaptureConfigError, match=message):
        read_items(path)


def test_duplicate_ids_name_a_few(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": k % 7, "prompt": "x"}) + "\n" for k in range(20)))
    with pytest.raises(CaptureConfigError, match=r"\['0', '1', '2', '3', '4'\] and 2 more"):
        read_items(path)


class FakePool:
    """Stands in for the replicas: records the batches it is given."""

    size = 1
    given: list[list[str]] = []

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.queue: list[Any] = []

    def describe(self) -> dict[str, Any]:
        return {"capture": collector.capture_record(self.spec["model"], [1], None, {})}

    def lane(self, replica: int) -> str:
        return "replica-0"

    def submit(self, replica: int, batch: list[Any]) -> None:
        self.queue.append(batch)

    def busy(self) -> bool:
        return bool(self.queue)

    def next_done(self) -> tuple[int, dict[str, int]]:
        batch = self.queue.pop(0)
        FakePool.given.append([item.id for item in batch])
        return 0, {"items": len(batch), "tokens": 3 * len(batch)}

    def close(self) -> None:
        pass


def _store_with_items(root: Path, item_ids: list[str], capture: dict[str, Any]) -> None:
    from probehook.store import ActivationStore
    from probehook.store.writer import PendingRequest

    store = ActivationStore.for_writing(root, {"hidden_size": 4, "dtype": "float32"})
    store.begin_run({"capture": capture})
    for k, item_id in enumerate(item_ids):
        store.add(PendingRequest({"id": str(k), "item_id": item_id, "prompt_token_ids": [1]}))
    store.close()


def test_a_rerun_skips_stored_items(llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import probehook.collect.local_pool as local_pool

    monkeypatch.setattr(local_pool, "LocalPool", FakePool)
    FakePool.given = []
    capture = collector.capture_record(str(llama_dir), [1], None, {})
    _store_with_items(tmp_path / "s", ["1", "3"], capture)
    result = collector.collect(
        llama_dir, ["a", "b", "c", "d", "e"], store=tmp_path / "s", layers=[1], batch_size=2
    )
    assert FakePool.given == [["0", "2"], ["4"]]
    assert (result.items, result.skipped, result.captured, result.tokens) == (5, 2, 3, 9)
    # Nothing left to do: no engine is built at all.
    _store_with_items(tmp_path / "t", ["0", "1"], capture)
    done = collector.collect(llama_dir, ["a", "b"], store=tmp_path / "t", layers=[1])
    assert (done.skipped, done.captured) == (2, 0)


def test_a_rerun_with_other_capture_options_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    other = collector.capture_record(str(llama_dir), [2], None, {})
    _store_with_items(tmp_path / "s", ["1"], other)
    with pytest.raises(CaptureConfigError, match=r"'layers': \[2\].*'layers': \[1\]"):
        collector.collect(llama_dir, ["a"], store=tmp_path / "s", layers=[1])


def _hold_lane(root: str, ready: Any, release: Any) -> None:
    from probehook.store.lock import WriterLock

    lock = WriterLock.acquire(root, "replica-0")
    ready.set()
    release.wait(30)
    lock.release()


def test_stored_items_are_read_once_no_writer_holds_a_lane(tmp_path: Path, monkeypatch) -> None:
    """A killed driver's replicas may still be writing: the rerun waits for their lanes."""
    capture = {"layers": [1]}
    _store_with_items(tmp_path / "s", ["x"], capture)
    (tmp_path / "s" / "lanes" / "replica-0").mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lane, args=(str(tmp_path / "s"), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        monkeypatch.setattr(collector, "SWEEP_SECONDS", 0.5)
        with pytest.raises(collector.CollectionError, match="replica-0"):
            collector.committed_items(tmp_path / "s", capture)
        monkeypatch.setattr(collector, "SWEEP_SECONDS", 30)
        release.set()
        assert collector.committed_items(tmp_path / "s", capture) == {"x"}
        # Opened once; twice only after a wait (what the killed writer committed counts).
        from probehook.store import ActivationStore

        opened = []
        real_open = ActivationStore.open
        monkeypatch.setattr(
            ActivationStore, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k)
        )
        assert collector.committed_items(tmp_path / "s", capture) == {"x"}
        assert len(opened) == 1
    finally:
        release.set()
        holder.join(30)


def test_cpu_groups_split_the_cores() -> None:
    assert cpu_groups(2, [0, 1]) == [[0], [1]]
    assert cpu_groups(3, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3], [4]]
    with pytest.raises(CaptureConfigError, match="replicas=3, but this process may use 2"):
        cpu_groups(3, [0, 1])


def test_ray_missing_names_the_extra(monkeypatch) -> None:
    from probehook.collect.ray_pool import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'probehook\[ray\]'"):
        import_ray()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts": "just one string"}, "is a string"),
        ({"replicas": 0}, "replicas=0 must be a positive int"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"layers": None}, "needs layers"),
        ({"include_decode": True}, "set by the collection itself"),
        ({"ids": ["a", "a"]}, "Duplicate item ids"),
    ],
)
def test_bad_collection_arguments(llama_dir: Path, tmp_path: Path, kwargs, message) -> None:
    args: dict[str, Any] = {"prompts": ["a", "b"], "store": tmp_path / "s", "layers": [1]}
    args.update(kwargs)
    with pytest.raises(CaptureConfigError, match=message):
        collector.collect(llama_dir, **args)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include_decode": True}, "capture_only=True with include_decode=True"),
        ({"include_prefill": False}, "include_prefill=False"),
        ({"last_decode_token": True}, "last_decode_token=True"),
        ({"runner": "generate"}, "runner='generate'"),
        ({"layers": None}, "needs something to capture"),
    ],
)
def test_capture_only_refusals_at_construction(llama_dir: Path, kwargs, message) -> None:
    from probehook import LLM

    args = {"layers": [1], "capture_only": True, **kwargs}
    with pytest.raises(CaptureConfigError, match=message):
        LLM(str(llama_dir), **args)


def test_capture_only_refuses_monitors_and_steering(llama_dir: Path) -> None:
    import torch
    from helpers import random_probes

    from probehook import LLM, ProbeMonitor, SteeringVector

    probes = random_probes(128)
    with pytest.raises(CaptureConfigError, match="capture_only=True with monitors="):
        LLM(
            str(llama_dir),
            layers=[1],
            capture_only=True,
            probes=probes,
            monitors=[ProbeMonitor("truth", 0.5)],
        )
    vector = SteeringVector({1: torch.ones(128)}, name="v")
    with pytest.raises(CaptureConfigError, match="capture_only=True with steering="):
        LLM(str(llama_dir), layers=[1], capture_only=True, steering={"v": vector})
