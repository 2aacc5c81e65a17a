"""Durability tested, not assumed: a writer is SIGKILLed at each stage of a shard commit.

The child commits request A, then dies while committing request B. A must survive bit-exact,
B must exist exactly when its manifest lines were fsynced, and the next writer must take the
stale lock over, clean up, and append. SIGKILL keeps the page cache, so this checks the order
of the commit steps (what a reader trusts at each point), not that fsync reaches the platter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_store_unit import META, fake_request

import probehook
from probehook.store import ActivationStore
from probehook.store.format import SHARD_DIR

REPO = Path(probehook.__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
STAGES = (
    "shard_written",
    "shard_fsynced",
    "shard_renamed",
    "dir_fsynced",
    "manifest_torn",
    "committed",
)
LAYERS = (1, 3)

CHILD = textwrap.dedent("""
    import hashlib, json, os, signal, sys
    from test_store_unit import META, fake_request
    import probehook.store.writer as writer
    from probehook.store import ActivationStore

    root, stage = sys.argv[1], sys.argv[2]

    def digest(request):
        h = hashlib.sha256()
        for block in request.blocks:  # layer 1 prefill, decode; layer 3 prefill, decode
            h.update(block.rows.contiguous().numpy().tobytes())
        return h.hexdigest()

    store = ActivationStore.for_writing(root, META)
    a, b = fake_request(0), fake_request(1)
    store.add(a)
    store.flush()  # A is acknowledged
    print(json.dumps({"A": digest(a), "B": digest(b)}), flush=True)

    def die(name):
        if name == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    writer.fault_hook = die
    store.add(b)
    store.flush()
    print("SURVIVED", flush=True)
""")


def digest(store: ActivationStore, request_id: str) -> str:
    """sha256 of a stored request's rows, in the order the child hashed them. Looked up by
    vLLM's request id: the store id also names a run the parent does not know."""
    got = next(r for r in store.requests if r.request_id == request_id)
    h = hashlib.sha256()
    for layer in LAYERS:
        h.update(got.prefill_hidden_states[layer].contiguous().numpy().tobytes())
        h.update(got.hidden_states[layer].contiguous().numpy().tobytes())
    return h.hexdigest()


def expected_digest(i: int) -> str:
    h = hashlib.sha256()
    for block in fake_request(i).blocks:
        h.update(block.rows.contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One store per stage, its writer killed there. The children run at once (import time
    dominates)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), str(TESTS), env.get("PYTHONPATH")) if p
    )
    base = tmp_path_factory.mktemp("killed")
    children = {
        stage: subprocess.Popen(
            [sys.executable, "-c", CHILD, str(base / stage), stage],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for stage in STAGES
    }
    results = {}
    for stage, child in children.items():
        out, err = child.communicate(timeout=120)
        results[stage] = {
            "root": base / stage,
            "pid": child.pid,
            "returncode": child.returncode,
            "stdout": out,
            "stderr": err,
        }
    return results


@pytest.mark.parametrize("stage", STAGES)
def test_kill_at_commit_stage(stage: str, killed: dict[str, dict[str, Any]], caplog) -> None:
    child = killed[stage]
    root: Path = child["root"]
    assert child["returncode"] == -signal.SIGKILL, child["stdout"] + child["stderr"]
    assert "SURVIVED" not in child["stdout"]
    digests = json.loads(child["stdout"].splitlines()[0])
    assert digests == {"A": expected_digest(0), "B": expected_digest(1)}

    store = ActivationStore.open(root)
    committed = stage == "committed"
    assert sorted(r.request_id for r in store.requests) == (["r0", "r1"] if committed else ["r0"])
    assert digest(store, "r0") == digests["A"]
    if committed:
        assert digest(store, "r1") == digests["B"]
    store.close()

    with caplog.at_level(logging.WARNING):
        writer = ActivationStore.for_writing(root, META)
    assert f"writer lock of pid {child['pid']} on host" in caplog.text
    writer.add(fake_request(2))
    writer.flush()
    writer.close()

    store = ActivationStore.open(root)
    expected = ["r0", "r1", "r2"] if committed else ["r0", "r2"]
    assert sorted(r.request_id for r in store.requests) == expected
    assert store.dropped == []
    assert not list((root / SHARD_DIR).glob("*.tmp"))
    assert digest(store, "r0") == digests["A"]
    assert digest(store, "r2") == expected_digest(2)
    if committed:
        assert digest(store, "r1") == digests["B"]
