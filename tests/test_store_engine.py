"""The store on a real engine: streaming writes, unique ids, appends, and kill -9."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from probehook.errors import StoreFormatError
from probehook.store import ActivationStore

pytestmark = pytest.mark.engine


def digest(tensors: dict[int, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for layer in sorted(tensors):
        h.update(tensors[layer].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_generate_streams_into_store(
    llama_dir: Path, engine_defaults: dict, tmp_path: Path
) -> None:
    from helpers import random_probes

    from probehook import LLM, SamplingParams

    path = tmp_path / "run"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(
        str(llama_dir),
        layers=[1, 3],
        include_prefill=True,
        enforce_eager=True,
        probes=random_probes(128),
        store=path,
        store_options={"shard_bytes": 4096},
        **engine_defaults,
    )
    try:
        first = llm.generate(["1+2=", "12+34="], params, use_tqdm=False)
        second = llm.generate(["1+2="], params, use_tqdm=False)
        # Durable as soon as generate() returned: an independent reader sees every request.
        reader = ActivationStore.open(path)
        ids = [o.store_id for o in first + second]
        assert len(set(ids)) == 3 and all(i in reader for i in ids)
        # vLLM's request ids are left alone: the store's id is a separate attribute.
        assert [o.request_id for o in first + second] == ["0", "1", "2"]
        for out in first + second:
            stored = reader[out.store_id]
            assert stored.request_id == out.request_id
            assert stored.prompt == out.prompt
            assert stored.output_token_ids == list(out.outputs[0].token_ids)
            assert digest(stored.hidden_states) == digest(out.hidden_states)
            assert digest(stored.prefill_hidden_states) == digest(out.prefill_hidden_states)
            # Runtime probe scores are stored with the request, exactly.
            assert sorted(stored.probe_scores) == sorted(out.probe_scores)
            for name, scores in out.probe_scores.items():
                assert torch.equal(stored.probe_scores[name], scores)
                assert torch.equal(
                    stored.prefill_probe_scores[name], out.prefill_probe_scores[name]
                )
        assert reader.info()["shards"] >= 2
    finally:
        llm.shutdown()
    with pytest.raises(StoreFormatError, match="model_fingerprint"):
        ActivationStore.for_writing(path, {**reader.meta, "model_fingerprint": "other"})


CHILD = textwrap.dedent("""
    import gc, hashlib, json, os, resource, sys, torch
    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.store import ActivationStore

    def digest(tensors):
        h = hashlib.sha256()
        for layer in sorted(tensors):
            h.update(tensors[layer].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def low_limit(path):
        \"\"\"A store of 91 one-request shards read with the open-file limit lowered to 64
        beside a live engine.\"\"\"
        llm = LLM(str(tiny_model_path()), layers=[1], enforce_eager=True, store=path,
                  dtype="float32", max_model_len=64, gpu_memory_utilization=0.1)
        params = SamplingParams(max_tokens=1, temperature=0)
        expected = {}
        for i in range(91):  # one generate() per prompt: 91 small shards
            out = llm.generate([f"{i}+1="], params, use_tqdm=False)[0]
            expected[out.store_id] = out.hidden_states[1].clone()
            del out  # a live output's rows hold a descriptor (the transport's mmap)
        gc.collect()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))  # the engine is up
        result = {"in_use": len(os.listdir("/proc/self/fd")) - 1}
        reader = ActivationStore.open(path)
        try:
            result["max_open_files"] = reader.max_open_files
            result["shards"] = reader.info()["shards"]
            result["each"] = all(
                torch.equal(reader[i].hidden_states[1], rows) for i, rows in expected.items()
            )
            result["matrix"] = torch.equal(reader.layer(1)[:], torch.cat(list(expected.values())))
            result["open"] = len(reader._files)
        except OSError as e:
            result["error"] = repr(e)
        reader.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        llm.shutdown()
        print("RESULT " + json.dumps(result), flush=True)

    def acknowledged_until_killed(model, store):
        \"\"\"Batch after batch into a store, each batch's ids and digests printed once
        generate() returned, until the parent kills the process.\"\"\"
        llm = LLM(model, layers=[0, 2], include_prefill=True, enforce_eager=True, store=store,
                  dtype="float32", max_model_len=256, gpu_memory_utilization=0.1)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for batch in range(1000):
            outs = llm.generate([f"{batch}+{i}=" for i in range(8)], params, use_tqdm=False)
            acked = {o.store_id: digest(o.hidden_states) for o in outs}
            print("ACK " + json.dumps(acked), flush=True)

    if __name__ == "__main__":
        low_limit(sys.argv[3])  # one process, one vLLM import, for both tests
        acknowledged_until_killed(sys.argv[1], sys.argv[2])
""")


@pytest.fixture(scope="module")
def child(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The child's low-limit result, then the requests it acknowledged before it was killed
    with SIGKILL in the middle of a batch, and its stores."""
    work = tmp_path_factory.mktemp("child")
    script = work / "child.py"
    script.write_text(CHILD)
    killed, low = work / "killed", work / "low_limit"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    errors = work / "stderr.log"  # a file: an unread pipe would fill and stall the child
    with errors.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(script), str(llama_dir), str(killed), str(low)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    result, acked, log = None, {}, []
    try:
        deadline = time.time() + 600
        while len(acked) < 24 and time.time() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            log.append(line)
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            elif line.startswith("ACK "):  # vLLM logs to stdout too
                acked.update(json.loads(line[4:]))
        time.sleep(0.3)  # land the kill in the middle of the next batch
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    tail = "".join(log[-40:]) + errors.read_text(errors="replace")[-3000:]
    return {"result": result, "acked": acked, "killed": killed, "tail": tail}


def test_kill_9_keeps_every_returned_request(child: dict[str, Any]) -> None:
    acked = child["acked"]
    assert len(acked) >= 24, "the child did not get far enough to test anything:\n" + child["tail"]
    reopened = ActivationStore.open(child["killed"])  # must not raise
    for store_id, expected in acked.items():
        assert digest(reopened[store_id].hidden_states) == expected
    # Whatever else is in the store is complete, never garbage.
    for record in reopened.requests:
        assert len(record.hidden_states[0]) == len(record.output_token_ids)


def test_reading_many_shards_under_a_low_open_file_limit_beside_an_engine(
    child: dict[str, Any],
) -> None:
    """A process holding a real engine, its open-file limit lowered to 64 after start-up,
    reads a store of 91 one-request shards: the reader's handle cache must fit what is
    left (a fixed cache of 128 failed with EMFILE). In the child process (the limit stays
    there), before it runs the kill -9 test's engine."""
    result = child["result"]
    assert result is not None, child["tail"]
    assert "error" not in result, result
    assert result["shards"] == 91 and result["each"] and result["matrix"], result
    assert result["in_use"] < 64 and result["open"] <= result["max_open_files"] < 64, result


def test_cli_capture_and_info(llama_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps(p) for p in ["1+2=", {"prompt": "12+34="}, "5+5="]) + "\n"
    )
    store = tmp_path / "cli-store"
    from probehook.cli import main

    # `probehook capture` in this process, its engine in-process (the console script runs in
    # a child below, for `store info`: a process that imports no vLLM)
    main(
        ["capture", "--model", str(llama_dir), "--layers", "1,3", "--prompts", str(prompts)]
        + ["--store", str(store), "--prefill", "--max-tokens", "3", "--eager"]
        + ["--max-model-len", "128"]
    )
    exe = Path(sys.executable).parent / "probehook"
    reopened = ActivationStore.open(store)
    assert sorted(r.prompt for r in reopened.requests) == ["1+2=", "12+34=", "5+5="]
    assert all(len(r.hidden_states[3]) == 3 for r in reopened.requests)
    info = subprocess.run(
        [str(exe), "store", "info", str(store)], capture_output=True, text=True, timeout=60
    )
    assert info.returncode == 0 and "requests: 3" in info.stdout
    missing = subprocess.run(
        [str(exe), "store", "info", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "not a probehook activation store" in missing.stderr
