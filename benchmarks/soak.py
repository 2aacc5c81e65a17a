"""Soak: ``probehook serve`` with a store under a steady, mixed load for a long time.

One server on the bundled tiny model (layers 0 and 3, one probe, one engine steering vector,
inline vectors allowed, a store flushed every second). A bounded client sends requests at a
steady rate, cycling through: captured completions, plain completions, steered ones, streams
steered by an inline vector, captured streams, streams aborted after their first chunk,
captured chat completions and steered requests that capture nothing.

Reported: the resident memory and open descriptors of each server process (the API server and
its engine core) at the start (after a warm-up), every minute, and at the end; requests lost
(an answer that is neither a 200 nor an intended abort, plus captured requests whose records
are not in the store after a graceful stop): must be 0; and the store's fsck.

``python benchmarks/soak.py --minutes 30`` (the issue's figure); writes
benchmarks/results/soak.json and soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
MIX = ("capture", "plain", "steered", "inline", "stream", "abort", "chat", "steer_only")
HIDDEN = 128  # the bundled tiny model's width
STEERED_LAYER = 2
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The tiny model has none: its chat is its prompts, concatenated."""


def body_of(kind: str, i: int) -> tuple[str, dict[str, Any], bool]:
    """(route, JSON body, streamed) of request ``i`` of ``kind``."""
    prompt = f"{i % 50}+{i % 7}="
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    capture = {"layers": [3], "probes": ["truth"]}
    if kind == "chat":
        chat = {"messages": [{"role": "user", "content": prompt}], "probehook": capture}
        return "/v1/chat/completions", {**base, **chat}, False
    options: dict[str, Any] | None = {
        "capture": capture,
        "plain": None,
        "steered": {**capture, "steer": {"up": 2.0}},
        "inline": {
            "probes": ["truth"],
            "steer": {"mine": 1.0},
            "steer_vectors": {"mine": {str(STEERED_LAYER): [0.01 * (i % 5)] * HIDDEN}},
        },
        "stream": capture,
        "abort": capture,
        "steer_only": {"steer": {"up": 1.0}},
    }[kind]
    body = {**base, "prompt": prompt}
    if options is not None:
        body["probehook"] = options
    return "/v1/completions", body, kind in ("inline", "stream", "abort")


async def one(client: Any, kind: str, i: int, plain: bool = False) -> tuple[str, str | None]:
    """Send request ``i``; returns (outcome, the request id the store files it under when it
    captured rows and finished). ``plain``: the server is plain vLLM (the same requests,
    without the probehook field, and nothing to check beyond the answer)."""
    route, body, streamed = body_of(kind, i)
    if plain:
        body.pop("probehook", None)
    if streamed:
        body["stream"] = True
        async with client.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                return f"{kind}: http {response.status_code}", None
            first_id = None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if kind == "abort":
                    return "aborted", None  # closing the stream aborts the request
                if line == "data: [DONE]":
                    break
                first_id = first_id or json.loads(line[6:]).get("id")
        stored = f"{first_id}-0" if kind == "stream" and not plain else None
        return "ok", stored
    response = await client.post(route, json=body)
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", "")[:120]
        return f"{kind}: http {response.status_code}: {message}", None
    answer = response.json()
    if plain:
        return "ok", None
    field = answer["choices"][0].get("probehook") or {}
    if kind in ("capture", "steered", "chat") and "3" not in field.get("hidden_states", {}):
        return "missing rows", None
    if kind in ("capture", "steered"):
        return "ok", f"{answer['id']}-0"
    return "ok", answer["id"] if kind == "chat" else None


def sample(root_pid: int) -> dict[str, dict[str, float]]:
    """RSS (MiB) and open descriptors of the server and each process it started."""
    import psutil

    root = psutil.Process(root_pid)
    out = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(process.cmdline()[1:4])[:60] or process.name()
            if process.name().startswith("VLLM::"):
                name = process.name()
            out[f"{process.pid} {name}"] = {
                "rss_mib": process.memory_info().rss / 2**20,
                "fds": process.num_fds(),
            }
        except psutil.NoSuchProcess:
            continue
    return out


async def drive(
    base_url: str, pid: int, minutes: float, rate: float, bound: int, plain: bool = False
) -> tuple[Counter, list[str], list[dict]]:
    import httpx

    outcomes: Counter = Counter()
    stored: list[str] = []
    samples: list[dict] = []
    gate = asyncio.Semaphore(bound)
    limits = httpx.Limits(max_connections=bound, max_keepalive_connections=bound)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def run(kind: str, i: int) -> None:
            try:
                outcome, request_id = await one(client, kind, i, plain)
            except Exception as e:  # noqa: BLE001 - counted as lost
                outcome, request_id = f"{type(e).__name__}", None
            finally:
                gate.release()
            outcomes[outcome if outcome in ("ok", "aborted") else f"lost: {outcome}"] += 1
            if request_id is not None:
                stored.append(request_id)

        # Warm-up: every kind once, outside the measurement.
        for i, kind in enumerate(MIX):
            await gate.acquire()
            await run(kind, -1 - i)
        outcomes.clear()
        stored.clear()
        samples.append({"t_s": 0.0, "processes": sample(pid)})
        start = time.monotonic()
        tasks = []
        i = 0
        next_sample = 60.0
        while (elapsed := time.monotonic() - start) < minutes * 60:
            if elapsed >= next_sample:
                samples.append({"t_s": round(elapsed, 1), "processes": sample(pid)})
                print(f"{elapsed / 60:.1f} min: {dict(outcomes)}", flush=True)
                next_sample += 60.0
            await gate.acquire()  # bounded: at most `bound` requests in flight
            tasks.append(asyncio.ensure_future(run(MIX[i % len(MIX)], i)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks = [t for t in tasks if not t.done()]
        await asyncio.gather(*tasks)
        await asyncio.sleep(2)  # let the server settle (aborts, flushes)
        samples.append({"t_s": round(time.monotonic() - start, 1), "processes": sample(pid)})
    return outcomes, stored, samples


def report_plain(name: str, args: Any, outcomes: Counter, samples: list[dict]) -> None:
    start, end = samples[0]["processes"], samples[-1]["processes"]
    minutes = samples[-1]["t_s"] / 60
    lines = [
        f"Plain `vllm serve`, the same requests without the probehook field: {args.minutes:g} "
        f"min at {args.rate:g}/s. Requests: {dict(outcomes)}.",
        "",
        "| process | RSS MiB start | RSS MiB end | MiB a minute | fds start | fds end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, first in start.items():
        last = end.get(key, {"rss_mib": float("nan"), "fds": -1})
        slope = (last["rss_mib"] - first["rss_mib"]) / minutes
        lines.append(
            f"| {key.split(' ', 1)[1]} | {first['rss_mib']:.0f} | {last['rss_mib']:.0f} | "
            f"{slope:.2f} | {first['fds']} | {last['fds']} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"requests": dict(outcomes), "samples": samples}, indent=2)
    )
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--bound", type=int, default=16, help="most requests in flight")
    parser.add_argument(
        "--plain-vllm",
        action="store_true",
        help="soak plain `vllm serve` with the same requests (no probehook field), to tell "
        "vLLM's own growth from probehook's; writes soak_vllm.json / .md",
    )
    args = parser.parse_args()

    import torch

    from probehook import ActivationStore, LinearProbe, SteeringVector
    from probehook.models import tiny_model_path
    from probehook.store.maintenance import fsck
    from probehook.testing import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="probehook-soak-"))
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1, HIDDEN, generator=g) / HIDDEN**0.5
    probe = LinearProbe(weight, torch.zeros(1), layer=3, kind="binary", name="truth")
    up = SteeringVector({STEERED_LAYER: torch.randn(HIDDEN, generator=g)})
    store = work / "store"
    argv = [str(tiny_model_path()), "--layers", "0,3", "--probe"]
    argv += [f"truth={probe.save(work / 'truth.safetensors')}", "--steer"]
    argv += [f"up={up.save(work / 'up.safetensors')}", "--allow-inline-steering"]
    (work / "chat.jinja").write_text(CHAT_TEMPLATE)
    argv += ["--store", str(store), "--store-flush-interval", "1", "--served-model-name", "tiny"]
    argv += ["--chat-template", str(work / "chat.jinja")]
    argv += ["--dtype", "float32", "--disable-log-stats", "--disable-uvicorn-access-log"]
    if args.plain_vllm:
        plain = [str(tiny_model_path()), "--served-model-name", "tiny", "--dtype", "float32"]
        plain += ["--chat-template", str(work / "chat.jinja"), "--disable-log-stats"]
        server = ServerProcess(plain, work / "server.log", program="vllm")
    else:
        server = ServerProcess(argv, work / "server.log")
    try:
        server.wait(1200)
        outcomes, stored, samples = asyncio.run(
            drive(
                server.base_url.removesuffix("/v1"),
                server.process.pid,
                args.minutes,
                args.rate,
                args.bound,
                args.plain_vllm,
            )
        )
    finally:
        server.stop()  # graceful: the store's close commits the rest
    if args.plain_vllm:
        name = "soak_vllm"
        report_plain(name, args, outcomes, samples)
        return
    found = {r.request_id for r in ActivationStore.open(store).requests}
    missing = sorted(set(stored) - found)
    report = fsck(store)
    lost = sum(n for k, n in outcomes.items() if k.startswith("lost")) + len(missing)
    start, end = samples[0]["processes"], samples[-1]["processes"]
    result = {
        "workload": vars(args),
        "requests": dict(outcomes),
        "captured_and_stored_expected": len(stored),
        "missing_from_store": missing[:20],
        "lost": lost,
        "fsck_ok": report.ok,
        "fsck": report.lines() if hasattr(report, "lines") else str(report),
        "samples": samples,
    }
    lines = [
        f"Soak of `probehook serve` (bundled tiny model, store, steering, inline vectors): "
        f"{args.minutes:g} min at {args.rate:g} requests/s, at most {args.bound} in flight, "
        f"mix {', '.join(MIX)}.",
        "",
        f"Requests: {dict(outcomes)}; captured requests expected in the store: {len(stored)}, "
        f"missing: {len(missing)}. **Lost: {lost}.** Store fsck: "
        f"{'ok' if report.ok else 'NOT OK'} ({report.requests} requests).",
        "",
        "| process | RSS MiB start | RSS MiB end | MiB a minute | fds start | fds end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    minutes = samples[-1]["t_s"] / 60
    for name, first in start.items():
        last = end.get(name, {"rss_mib": float("nan"), "fds": -1})
        slope = (last["rss_mib"] - first["rss_mib"]) / minutes
        lines.append(
            f"| {name.split(' ', 1)[1]} | {first['rss_mib']:.0f} | {last['rss_mib']:.0f} | "
            f"{slope:.2f} | {first['fds']} | {last['fds']} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=2, default=str))
    (RESULTS / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if lost:
        raise SystemExit(f"{lost} request(s) lost (see benchmarks/results/soak.json)")


if __name__ == "__main__":
    main()
