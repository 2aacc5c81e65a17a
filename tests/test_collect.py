"""Collections: capture-only replicas writing one store, resumed after SIGKILLs.

One collection of 400 items. `probehook capture --capture-only` (one replica, in its own
process) is killed twice at random points after some items were committed: its engine (the
collection stops and says to rerun), then the whole process group. The rerun on two Ray
replicas (one of the suite's two Ray starts; examples/collect_and_probe.py is the other)
finishes it: every item is then in the store exactly once, its rows equal to Hugging Face's,
the two replicas' lanes beside the first run's.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from engine_layout import USERS_LAYOUT_ENV

from probehook.testing import hf_residual_stream

# The topology set's capture-only replica and Ray replicas (tests/README.md): the first run's
# engine core and worker are processes of their own (the engine core is killed alone); the
# two Ray replicas are actors of their own, each hosting its engine in-process, as does the
# run killed with its whole process group.
pytestmark = [pytest.mark.engine, pytest.mark.topology]


def _prompts(count: int) -> dict[str, str]:
    return {f"doc-{k:04d}": f"{k}+{k % 7}={k + k % 7}. " * (1 + k % 6) for k in range(count)}


def _assert_each_item_once_equal_hf(store_path: Path, prompts: dict[str, str], model: Path) -> Any:
    from probehook.store import ActivationStore
    from probehook.store.maintenance import fsck

    store = ActivationStore.open(store_path)
    counts = Counter(record.item_id for record in store.requests)
    assert set(counts) == set(prompts) and set(counts.values()) == {1}, counts.most_common(3)
    assert fsck(store_path).ok
    by_item = {record.item_id: record for record in store.requests}
    for item_id in random.Random(0).sample(sorted(prompts), 8):
        record = by_item[item_id]
        assert record.prompt == prompts[item_id]
        ref = hf_residual_stream(model, record.prompt_token_ids)
        assert (record.prefill_hidden_states[1] - ref[1]).abs().max().item() <= 1e-3, item_id
    return store


# -- resume after SIGKILL --------------------------------------------------------------------


def _command(model: Path, prompts: Path, store: Path) -> list[str]:
    return [
        sys.executable, "-m", "probehook.cli", "capture",
        "--model", str(model), "--layers", "1", "--prompts", str(prompts),
        "--store", str(store), "--batch-size", "2", "--eager",
        "--max-model-len", "256", "--dtype", "float32",
    ]  # fmt: skip


def _stored(store: Path) -> int:
    from probehook.store import ActivationStore

    return len(ActivationStore.open(store)) if (store / "meta.json").is_file() else 0


def _start(command: list[str], log: Path, layout: dict[str, str]) -> subprocess.Popen:
    """``layout``: engine_layout.USERS_LAYOUT_ENV, or {} for the suite's in-process default."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **layout}
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _wait_for_items(process: subprocess.Popen, store: Path, at_least: int, log: Path) -> None:
    deadline = time.monotonic() + 240
    while _stored(store) < at_least:
        if process.poll() is not None:
            pytest.fail(f"the collection ended before {at_least} items:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {at_least} items after 240 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)


def _engine_core_pid(driver: int) -> int:
    """The pid of the driver's vLLM engine-core process (comm ``VLLM::EngineCor``)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text()
        except OSError:
            continue
        comm, _, rest = fields.partition("(")[2].rpartition(")")
        if "EngineCor" in comm and int(rest.split()[1]) == driver:
            return int(stat.parent.name)
    raise AssertionError(f"no engine-core child of {driver}")


def test_collection_resumes_after_sigkills_and_finishes_on_two_ray_replicas(
    llama_dir: Path, tmp_path: Path
) -> None:
    prompts = _prompts(400)
    prompts_path = tmp_path / "items.jsonl"
    prompts_path.write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in prompts.items())
    )
    store = tmp_path / "store"
    command = _command(llama_dir, prompts_path, store)
    one_replica = [*command, "--capture-only"]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    print(f"kill points seed {seed}")
    for kill in ("engine", "group"):
        before = _stored(store)
        log = tmp_path / f"run-{kill}.log"
        run = _start(one_replica, log, USERS_LAYOUT_ENV if kill == "engine" else {})
        _wait_for_items(run, store, before + rng.randrange(1, 60), log)
        time.sleep(rng.random() * 0.1)
        if kill == "engine":  # the replica's engine dies: the collection stops, says rerun
            os.kill(_engine_core_pid(run.pid), signal.SIGKILL)
            assert run.wait(timeout=120) != 0
            assert "rerun the same collection" in log.read_text(), log.read_text()[-3000:]
        else:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=60)
        assert _stored(store) < len(prompts), "killed too late to test anything"
    before = _stored(store)
    log = tmp_path / "run-last.log"
    run = _start([*command, "--replicas", "2"], log, {})
    assert run.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    report = json.JSONDecoder().raw_decode(text[text.index('{\n  "store"') :])[0]
    assert report["skipped (already stored)"] == before
    assert report["captured"] == len(prompts) - before
    assert sorted(report["replicas"]) == ["replica-0", "replica-1"]
    assert all(counts["items"] > 0 for counts in report["replicas"].values())
    # One bar for the collection, not one per replica: every refresh shows the whole
    # collection's total and a count that never goes back (tqdm may print 100% twice: at the
    # last update and again when it closes).
    bars = re.findall(r"collect:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", text)
    assert bars and {int(total) for _, total in bars} == {len(prompts)}, bars
    counts = [int(done) for done, _ in bars]
    assert counts == sorted(counts) and counts[-1] == len(prompts), counts
    stored = _assert_each_item_once_equal_hf(store, prompts, llama_dir)
    assert (
        Counter(r.lane for r in stored.requests)["replica-1"]
        == report["replicas"]["replica-1"]["items"]
    )
