"""Store write throughput: one writer process against two writer processes, each its own lane.

The same total bytes go into a fresh store on tmpfs (``/dev/shm``, so the disk is not what is
measured) either from one process writing the root lane or from two processes writing lanes
``w0`` and ``w1`` at once. Requests look like the engine's: float32 ``[rows, hidden]`` per
layer, a few layers, flushed every ``--flush-every`` requests (one ``generate()`` batch each).

Processes, not threads: h5py holds one global lock for every HDF5 call in a process, so two
writer threads in one process would take turns; separate processes (``spawn`` start method:
no forked HDF5/torch state) each have their own. The two workers live for the whole run and
build their requests once, before any timing. A run is timed from the moment both workers
are released (``for_writing`` included) to the last ``close()``. One-writer and two-writer
runs alternate over ``--rounds`` rounds (which goes first alternates too), medians reported,
plus the median of each round's two/one ratio.

Control: the same bytes written raw (``ndarray.tofile`` into one file per writer, fsync at each
flush) by one process and by two, in the same rounds. Its two/one ratio is what the machine
allows (free cores, memory bandwidth): on a machine whose cores are busy with other work, two
processes cannot be faster than one, store or not. Writes results/store_lanes.{json,md}.
``--smoke``: a few seconds' check that it still runs (benchmarks/smoke.py: a few small
requests, one round, nothing written).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import smoke  # benchmarks/smoke.py

RESULTS = Path(__file__).parent / "results"


def make_requests(n: int, rows: int, hidden: int, layers: int, seed: int) -> list:
    import torch

    from probehook.store.writer import PendingRequest, RowBlock

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        record = {"id": f"r{seed}-{i}", "prompt": "", "prompt_token_ids": [0] * rows}
        record["completions"] = []
        blocks = [
            RowBlock("prefill", None, layer, 0, torch.randn(rows, hidden, generator=g))
            for layer in range(layers)
        ]
        out.append(PendingRequest(record, blocks))
    return out


def worker(conn, go, n: int, rows: int, hidden: int, layers: int, seed: int) -> None:
    """Build ``n`` requests once; then, per command, write the first ``count`` of them into
    ``lane`` of ``root`` when ``go`` is set, and reply with (start, end) monotonic times."""
    from probehook.store import ActivationStore

    requests = make_requests(n, rows, hidden, layers, seed)
    meta = {
        "model": "bench",
        "model_fingerprint": "x",
        "dtype": "float32",
        "hidden_size": hidden,
        "layers": list(range(layers)),
    }
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            return
        root, lane, count, flush_every, raw = command
        conn.send("armed")
        go.wait()
        start = time.monotonic()
        if raw:
            os.makedirs(root, exist_ok=True)
            with open(os.path.join(root, f"{lane or 'root'}.bin"), "wb") as f:
                for i, request in enumerate(requests[:count]):
                    for block in request.blocks:
                        block.rows.numpy().tofile(f)
                    if (i + 1) % flush_every == 0:
                        f.flush()
                        os.fsync(f.fileno())
                f.flush()
                os.fsync(f.fileno())
            conn.send((start, time.monotonic()))
            continue
        store = ActivationStore.for_writing(root, meta, lane=lane)
        for i, request in enumerate(requests[:count]):
            store.add(request)
            if (i + 1) % flush_every == 0:
                store.flush()
        store.flush()
        store.close()
        conn.send((start, time.monotonic()))


def timed_run(
    workers, go, root: Path, plan: list[tuple[int, str | None, int]], flush_every, raw=False
):
    """Run ``plan`` ([(worker, lane, count)]) at once; return seconds to the last close."""
    shutil.rmtree(root, ignore_errors=True)
    go.clear()
    for index, lane, count in plan:
        workers[index][1].send((str(root), lane, count, flush_every, raw))
    for index, _, _ in plan:
        assert workers[index][1].recv() == "armed"
    go.set()
    times = [workers[index][1].recv() for index, _, _ in plan]
    elapsed = max(end for _, end in times) - min(start for start, _ in times)
    if raw:
        shutil.rmtree(root, ignore_errors=True)
        return elapsed
    from probehook.store import ActivationStore

    store = ActivationStore.open(root)  # check: every request is there
    assert len(store) == sum(count for _, _, count in plan), len(store)
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=96, help="total, split over writers")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--flush-every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm", help="where the store is written (tmpfs)")
    smoke.add_flag(parser)
    args = smoke.shrink(
        parser.parse_args(), requests=8, rows=16, hidden=128, layers=2, flush_every=2, rounds=1
    )
    half = args.requests // 2
    total = 2 * half  # the same bytes either way
    nbytes = total * args.rows * args.hidden * 4 * args.layers
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    workers = []
    for index, count in enumerate((total, half)):
        parent, child = ctx.Pipe()
        size = (args.rows, args.hidden, args.layers)
        process = ctx.Process(target=worker, args=(child, go, count, *size, index))
        process.start()
        workers.append((process, parent))
    for _, conn in workers:
        assert conn.recv() == "ready"
    work = Path(tempfile.mkdtemp(prefix="probehook-lanes-", dir=args.dir))
    one: list[float] = []
    two: list[float] = []
    ratios: list[float] = []
    raw_one: list[float] = []
    raw_two: list[float] = []
    raw_ratios: list[float] = []
    try:
        for round_ in range(args.rounds):
            runs = [
                ("one", [(0, None, total)], False),
                ("two", [(0, "w0", half), (1, "w1", half)], False),
                ("raw one", [(0, None, total)], True),
                ("raw two", [(0, "w0", half), (1, "w1", half)], True),
            ]
            got = {}
            for name, plan, raw in runs if round_ % 2 == 0 else runs[::-1]:
                seconds = timed_run(workers, go, work / "s", plan, args.flush_every, raw)
                got[name] = nbytes / seconds
            one.append(got["one"])
            two.append(got["two"])
            ratios.append(got["two"] / got["one"])
            raw_one.append(got["raw one"])
            raw_two.append(got["raw two"])
            raw_ratios.append(got["raw two"] / got["raw one"])
            print(
                f"round {round_}: store one writer {got['one'] / 1e6:.0f} MB/s, two writers "
                f"{got['two'] / 1e6:.0f} MB/s, ratio {ratios[-1]:.2f}; raw ratio "
                f"{raw_ratios[-1]:.2f}; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        for _, conn in workers:
            conn.send(None)
        for process, _ in workers:
            process.join(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    med_one, med_two = statistics.median(one), statistics.median(two)
    raw_med_one, raw_med_two = statistics.median(raw_one), statistics.median(raw_two)
    report = {
        "workload": {**vars(args), "requests": total, "bytes": nbytes, "cpus": os.cpu_count()},
        "median_MB_per_s": {
            "one writer": round(med_one / 1e6, 1),
            "two writers": round(med_two / 1e6, 1),
        },
        "ratio_of_medians": round(med_two / med_one, 3),
        "median_round_ratio": round(statistics.median(ratios), 3),
        "raw_median_MB_per_s": {
            "one writer": round(raw_med_one / 1e6, 1),
            "two writers": round(raw_med_two / 1e6, 1),
        },
        "raw_ratio_of_medians": round(raw_med_two / raw_med_one, 3),
        "raw_median_round_ratio": round(statistics.median(raw_ratios), 3),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "rounds": [
            {
                "one_MB_per_s": round(a / 1e6, 1),
                "two_MB_per_s": round(b / 1e6, 1),
                "ratio": round(r, 3),
                "raw_ratio": round(q, 3),
            }
            for a, b, r, q in zip(one, two, ratios, raw_ratios, strict=True)
        ],
        "target_ratio": 1.6,
    }
    lines = [
        f"Workload: {total} requests x {args.layers} layers x {args.rows} rows x {args.hidden} "
        f"fp32 = {nbytes / 1e6:.0f} MB into a new store on {args.dir}, flushed every "
        f"{args.flush_every} requests; {args.rounds} interleaved rounds, {os.cpu_count()} CPUs.",
        "",
        "| writers | median MB/s | ratio |",
        "| --- | --- | --- |",
        f"| one process, root lane | {med_one / 1e6:.0f} | 1.0 |",
        f"| two processes, lanes w0 and w1 (half each) | {med_two / 1e6:.0f} | "
        f"{report['ratio_of_medians']} |",
        f"| control: raw `tofile`, one process | {raw_med_one / 1e6:.0f} | 1.0 |",
        f"| control: raw `tofile`, two processes | {raw_med_two / 1e6:.0f} | "
        f"{report['raw_ratio_of_medians']} |",
        "",
        f"Median of the per-round store ratios: {report['median_round_ratio']} (target >= 1.6); "
        "rounds: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + ". Raw control per round: "
        + ", ".join(f"{r:.2f}" for r in raw_ratios)
        + f". Load average after the run: {report['load_average_after']}.",
    ]
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "store_lanes.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / "store_lanes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    smoke.done(args)


if __name__ == "__main__":
    main()
