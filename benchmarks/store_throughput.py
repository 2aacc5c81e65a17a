"""Store write/read throughput against plain numpy file I/O on the same bytes, in one run.

Raw write: ``ndarray.tofile`` + fsync per file (the disk's sequential ceiling as Python sees
it). Raw read: ``np.fromfile`` of the same bytes. Both sides see the same page cache state,
rounds are interleaved with the write order alternating, medians reported. Writes
results/store_throughput.{json,md}. ``--smoke``: a second's check that it still runs
(benchmarks/smoke.py: a few small requests, one round, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import smoke  # benchmarks/smoke.py
import torch

from probehook.store import ActivationStore
from probehook.store.writer import PendingRequest, RowBlock

RESULTS = Path(__file__).parent / "results"


def make_requests(n: int, rows: int, hidden: int, layers: list[int]) -> list[PendingRequest]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        record = {"id": f"r{i}", "prompt": "", "prompt_token_ids": [0] * rows, "completions": []}
        blocks = [
            RowBlock("prefill", None, layer, 0, torch.randn(rows, hidden, generator=g))
            for layer in layers
        ]
        out.append(PendingRequest(record, blocks))
    return out


def store_write(root: Path, requests: list[PendingRequest], hidden: int, layers: list[int]):
    meta = {
        "model": "bench",
        "model_fingerprint": "x",
        "dtype": "float32",
        "hidden_size": hidden,
        "layers": layers,
    }
    start = time.perf_counter()
    store = ActivationStore.for_writing(root, meta)
    for r in requests:
        store.add(r)
    store.flush()
    store.close()
    return time.perf_counter() - start


def raw_write(root: Path, requests: list[PendingRequest], layers: list[int]) -> float:
    root.mkdir(parents=True)
    start = time.perf_counter()
    for slot, layer in enumerate(layers):
        with open(root / f"layer_{layer}.bin", "wb") as f:
            for r in requests:
                r.blocks[slot].rows.numpy().tofile(f)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def compacted_read(work: Path, args: argparse.Namespace) -> dict[str, float]:
    """One layer read from a store of ``args.small_shards`` one-request shards after
    ``compact``, against the same bytes written as one shard (medians over rounds)."""
    from probehook.store.maintenance import compact

    requests = make_requests(args.small_shards, 16, args.hidden, [0])
    meta = {"model": "bench", "model_fingerprint": "x", "dtype": "float32"}
    meta |= {"hidden_size": args.hidden, "layers": [0]}
    many = ActivationStore.for_writing(work / "many", meta)
    for r in requests:
        many.add(r)
        many.flush()  # one shard per request, like one generate() per prompt
    many.close()
    compact(work / "many", progress=False)
    store_write(work / "one", requests, args.hidden, [0])
    times: dict[str, list[float]] = {"compacted": [], "one shard": []}
    for _ in range(args.rounds):
        for name, path in (("compacted", work / "many"), ("one shard", work / "one")):
            store = ActivationStore.open(path)
            start = time.perf_counter()
            store.layer(0, phase="prefill")[:]
            times[name].append(time.perf_counter() - start)
            store.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reads", type=int, default=4, help="reads of each side per round")
    parser.add_argument("--small-shards", type=int, default=2000)
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(),
        requests=8,
        rows=16,
        hidden=128,
        layers=2,
        rounds=1,
        reads=2,
        small_shards=20,
    )
    layers = list(range(args.layers))
    requests = make_requests(args.requests, args.rows, args.hidden, layers)
    nbytes = sum(r.nbytes for r in requests)
    layer_bytes = nbytes // len(layers)
    work = Path(tempfile.mkdtemp(prefix="probehook-bench-", dir=os.getcwd()))
    samples: dict[str, list[float]] = {
        k: [] for k in ("raw write", "store write", "raw read", "store read", "store open")
    }
    try:
        for round_ in range(args.rounds):
            shutil.rmtree(work / "raw", ignore_errors=True)
            shutil.rmtree(work / "store", ignore_errors=True)
            # Alternate which side writes first: the disk's writeback state drifts in a run.
            writes = [
                ("raw write", lambda: raw_write(work / "raw", requests, layers)),
                ("store write", lambda: store_write(work / "store", requests, args.hidden, layers)),
            ]
            for name, write in writes if round_ % 2 == 0 else writes[::-1]:
                os.sync()  # write back what earlier rounds left dirty: neither side pays for it
                samples[name].append(nbytes / write())
            os.sync()
            store = ActivationStore.open(work / "store")
            # Several reads a round, alternating which side goes first: one read of a layer
            # from the page cache takes about 15 ms, so a single timing is mostly noise.
            for read in range(args.reads):
                for name in ("raw read", "store read")[:: 1 if read % 2 == 0 else -1]:
                    start = time.perf_counter()
                    if name == "raw read":
                        raw = np.fromfile(work / "raw" / "layer_1.bin", dtype=np.float32)
                    else:
                        got = store.layer(1, phase="prefill")[:]
                    samples[name].append(layer_bytes / (time.perf_counter() - start))
            assert np.array_equal(got.numpy().ravel(), raw)
            store.close()
            start = time.perf_counter()
            ActivationStore.open(work / "store").close()
            samples["store open"].append(time.perf_counter() - start)
        shutil.rmtree(work / "raw", ignore_errors=True)
        shutil.rmtree(work / "store", ignore_errors=True)
        compacted = compacted_read(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    report = {
        "workload": {**vars(args), "bytes": nbytes},
        "MB_per_s": {k: round(v / 1e6, 1) for k, v in med.items() if k != "store open"},
        "store_open_ms": round(med["store open"] * 1e3, 2),
        "write_ratio": round(med["store write"] / med["raw write"], 3),
        "read_ratio": round(med["store read"] / med["raw read"], 3),
        "compacted_read_s": round(compacted["compacted"], 4),
        "one_shard_read_s": round(compacted["one shard"], 4),
        "compacted_vs_one_shard_time": round(compacted["compacted"] / compacted["one shard"], 3),
    }
    lines = [
        f"Workload: {args.requests} requests x {args.layers} layers x {args.rows} rows x "
        f"{args.hidden} fp32 = {nbytes / 1e6:.0f} MB, {args.rounds} interleaved rounds.",
        "",
        "| path | median MB/s | ratio to raw |",
        "| --- | --- | --- |",
        f"| raw write (tofile + fsync) | {med['raw write'] / 1e6:.0f} | 1.0 |",
        f"| store write (flush = fsync + rename + manifest) | {med['store write'] / 1e6:.0f} | "
        f"{report['write_ratio']} |",
        f"| raw read (fromfile, one layer) | {med['raw read'] / 1e6:.0f} | 1.0 |",
        f"| store read (`store.layer(L)[:]`) | {med['store read'] / 1e6:.0f} | "
        f"{report['read_ratio']} |",
        "",
        f"Opening the store (manifest parse and segment index, {args.requests} requests) takes "
        f"{report['store_open_ms']} ms, once per `ActivationStore.open`; reads are timed on the "
        f"open store, {args.reads} per side per round, alternating which side goes first.",
        "",
        f"One layer across {args.small_shards} one-request shards after `compact`: "
        f"{report['compacted_read_s']} s; the same bytes written as one shard: "
        f"{report['one_shard_read_s']} s (time ratio {report['compacted_vs_one_shard_time']}, "
        "target <= 1.2).",
    ]
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "store_throughput.json").write_text(json.dumps(report, indent=2))
        (RESULTS / "store_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
