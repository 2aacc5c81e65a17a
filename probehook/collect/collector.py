"""A collection: many prompts through capture-only engines into one store, resumable.

The driver (this module, in the user's process) reads the items, skips every item id the store
already holds, cuts the rest into batches and keeps each replica busy with two batches at a
time. A replica (:mod:`probehook.collect.replica`) is a capture-only ``probehook.LLM`` writing
its own lane of the store; a batch it returns is durable. One replica runs in this process;
several run as Ray actors (:mod:`probehook.collect.ray_pool`).

Exactly once: a rerun first waits until no writer holds any lane of the store (the replicas of
a killed driver die with it; their locks go with them), then reads the committed item ids. Each
item is then given to one replica once. A replica that dies stops the collection with an
error; what it committed stays, and the rerun finishes the rest.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probehook.collect.failures import CollectionError
from probehook.collect.items import Item, make_items, read_items
from probehook.errors import CaptureConfigError, StoreLockedError

if TYPE_CHECKING:
    from probehook.store import ActivationStore

DEFAULT_BATCH = 256
IN_FLIGHT = 2  # batches per replica: one running, one queued behind it
SWEEP_SECONDS = 120.0


@dataclass
class CollectResult:
    """What a collection did."""

    store: Path
    items: int
    """Items asked for."""
    skipped: int
    """Items already in the store before this run (resumed)."""
    captured: int
    tokens: int
    """Prompt tokens captured by this run."""
    seconds: float
    replicas: int
    per_replica: dict[str, dict[str, int]] = field(default_factory=dict)
    """Items and tokens per replica lane."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def collect(
    model: str | os.PathLike[str],
    prompts: Sequence[Any] | os.PathLike[str],
    *,
    store: str | os.PathLike[str],
    layers: Any = None,
    probes: Any = None,
    ids: Sequence[Any] | None = None,
    replicas: int = 1,
    batch_size: int = DEFAULT_BATCH,
    progress: bool = True,
    ray_address: str | None = None,
    replica_logs: bool = False,
    store_options: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> CollectResult:
    """Capture the prompt rows of every item into ``store``, skipping the items it already
    holds; return what was done.

    Args:
        model: as for :class:`probehook.LLM`.
        prompts: a sequence of prompts (strings or token-id lists) with ``ids`` (None: each
            prompt's index), or a path (``pathlib.Path``) of a prompts file: ``.jsonl`` lines
            ``{"id": ..., "prompt": ...}`` (or a JSON string / ``{"prompt": ...}``: the line
            number is the id), any other extension one prompt per line (ids: line numbers).
        store: the store directory; replica ``k`` writes its lane ``replica-k``.
        layers, probes: what to capture, as for ``LLM(..., capture_only=True)``.
        replicas: engines. 1 runs in this process; more run as Ray actors (``pip install
            'probehook[ray]'``), on the local machine or on the cluster at ``ray_address``.
        batch_size: prompts per batch; a batch a replica returns is durable.
        ray_address: a Ray cluster to run the replicas on (None: a local Ray, started and
            stopped here, unless this process already started one).
        replica_logs: show the Ray replicas' engine logs here (default: they stay in Ray's
            session logs, ``/tmp/ray/session_latest/logs``; errors come back either way).
        store_options: as for ``LLM`` (``shard_bytes``, ``compression``, ...).
        progress: one progress bar for the whole collection (items/s, tokens/s).
        **engine_kwargs: passed to every replica's ``LLM`` (vLLM engine arguments).
    """
    model = os.fspath(model)
    items = _items(prompts, ids)
    replicas = _positive("replicas", replicas)
    batch_size = _positive("batch_size", batch_size)
    if layers is None and probes is None:
        raise CaptureConfigError("A collection needs layers=[...] or probes={...} to capture.")
    for key in ("capture_only", "include_decode", "store", "store_options"):
        if key in engine_kwargs:
            raise CaptureConfigError(
                f"{key}= is set by the collection itself (capture-only engines, one lane of "
                "the store per replica); drop it."
            )
    root = Path(store)
    expected = capture_record(model, layers, probes, engine_kwargs)
    committed = committed_items(root, expected)
    todo = [item for item in items if item.id not in committed]
    result = CollectResult(
        store=root,
        items=len(items),
        skipped=len(items) - len(todo),
        captured=0,
        tokens=0,
        seconds=0.0,
        replicas=replicas,
    )
    if not todo:
        return result
    spec = {
        "model": model,
        "store": os.fspath(root),
        "capture": {"layers": layers, "probes": probes},
        "store_options": dict(store_options or {}),
        "engine": engine_kwargs,
    }
    replicas = min(replicas, -(-len(todo) // batch_size))  # no idle engines
    result.replicas = replicas
    if replicas == 1 and ray_address is None:
        from probehook.collect.local_pool import LocalPool

        pool: Any = LocalPool(spec)
    else:
        from probehook.collect.ray_pool import RayPool

        pool = RayPool(spec, replicas, ray_address, replica_logs)
    started = time.perf_counter()
    try:
        described = pool.describe()["capture"]
        if described != expected:
            raise CollectionError(
                f"The replicas capture {described}, not {expected} as the driver expected; "
                "this is a probehook bug, please report it."
            )
        _run(pool, todo, batch_size, result, progress)
        result.seconds = time.perf_counter() - started  # capture time: no start-up, no close
    finally:
        pool.close()
    return result


def committed_items(root: Path, ours: dict[str, Any]) -> set[str]:
    """Item ids the store holds, once :func:`check_rerun` accepts it and no writer holds any
    of its lanes (a killed collection's replicas may take a moment to die; their lanes are
    waited for, and their last commits count). The store is opened once, twice only when a
    lane had to be waited for."""
    from probehook.store import ActivationStore
    from probehook.store.format import META_FILE

    if not (root / META_FILE).is_file():
        return set()
    store = ActivationStore.open(root)
    check_rerun(store, ours)
    if _wait_for_writers(root):
        store = ActivationStore.open(root)
    return store.item_ids()


def _wait_for_writers(root: Path) -> bool:
    """Wait until no writer holds a lane of the store at ``root``; whether any did."""
    from probehook.store.format import list_lanes
    from probehook.store.lock import WriterLock

    deadline = time.monotonic() + SWEEP_SECONDS
    waited = False
    for lane in list_lanes(root)[0]:
        while True:
            try:
                WriterLock.acquire(root, lane).release()
                break
            except StoreLockedError as e:
                waited = True
                if time.monotonic() > deadline:
                    raise CollectionError(
                        f"{e} A collection reads the items already stored only when no writer "
                        "holds the store; stop the other writer (or wait for it) and rerun."
                    ) from e
                time.sleep(0.5)
    return waited


def capture_record(model: str, layers: Any, probes: Any, engine_kwargs: dict[str, Any]) -> dict:
    """What a replica's store run will record under ``capture`` (its resolved capture
    options), worked out before any engine starts."""
    from transformers import AutoConfig

    from probehook.capture_config import CaptureConfig, resolve_layers

    if layers is None:
        return CaptureConfig(layers=(), include_prefill=True, include_decode=False).to_dict()
    config = AutoConfig.from_pretrained(
        model,
        revision=engine_kwargs.get("revision"),
        trust_remote_code=bool(engine_kwargs.get("trust_remote_code", False)),
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return CaptureConfig(
        layers=resolve_layers(layers, int(text.num_hidden_layers)),
        include_prefill=True,
        include_decode=False,
    ).to_dict()


def check_rerun(store: ActivationStore, ours: dict[str, Any]) -> None:
    """Refuse a collection whose capture options differ from the store's runs (rows of two
    kinds under one item id set would be a trap); names both."""
    root = store.root
    for run_id, run in store.runs.items():
        theirs = run.get("capture")
        if theirs is not None and theirs != ours:
            raise CaptureConfigError(
                f"The store at {root} holds run {run_id} captured with {theirs}, but this "
                f"collection captures {ours}. Resume with the same layers and options, or "
                "collect into a new store path."
            )


def _run(pool: Any, todo: list[Item], batch_size: int, result: CollectResult, bar_on: bool) -> None:
    from tqdm.auto import tqdm

    batches = deque(todo[i : i + batch_size] for i in range(0, len(todo), batch_size))
    bar = tqdm(
        total=result.items,
        initial=result.skipped,
        desc="collect",
        unit="item",
        disable=not bar_on,
        dynamic_ncols=True,
    )
    started = time.perf_counter()
    try:
        for replica in range(pool.size):
            for _ in range(IN_FLIGHT):
                if batches:
                    pool.submit(replica, batches.popleft())
        while pool.busy():
            replica, done = pool.next_done()  # raises CollectionError when a replica died
            lane = pool.lane(replica)
            counts = result.per_replica.setdefault(lane, {"items": 0, "tokens": 0})
            counts["items"] += done["items"]
            counts["tokens"] += done["tokens"]
            result.captured += done["items"]
            result.tokens += done["tokens"]
            bar.update(done["items"])
            elapsed = time.perf_counter() - started
            bar.set_postfix(tok_s=f"{result.tokens / max(elapsed, 1e-9):,.0f}", refresh=False)
            if batches:
                pool.submit(replica, batches.popleft())
    finally:
        bar.close()


def _items(prompts: Any, ids: Sequence[Any] | None) -> list[Item]:
    if isinstance(prompts, os.PathLike):
        if ids is not None:
            raise CaptureConfigError("ids= is for a list of prompts; a prompts file has its own.")
        return read_items(prompts)
    if isinstance(prompts, str | bytes):
        raise CaptureConfigError(
            f"prompts={prompts[:60]!r} is a string: pass a list of prompts, or a "
            "pathlib.Path to a prompts file."
        )
    items = make_items(list(prompts), ids)
    if not items:
        raise CaptureConfigError("No prompts to collect.")
    return items


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CaptureConfigError(f"{name}={value!r} must be a positive int.")
    return value
