"""Dropping the last reference to an engine releases it, as in vLLM.

``del llm`` (or running again the notebook cell that builds ``llm``) must end the engine:
nothing of probehook's (a session's closures, a finalizer, a thread) may keep it alive. The
engine here runs in-process, so "released" is the engine object being collected (its
processes, in the user's layout, end with it through vLLM's own finalizer); the store it
wrote is then committed and unlocked, with nobody calling close().
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from probehook.store import ActivationStore

pytestmark = pytest.mark.engine


def test_dropped_llm_is_released_and_its_store_committed(
    llama_dir: Path, tmp_path: Path, engine_defaults: dict
) -> None:
    from helpers import random_probes, reference_steering

    from probehook import LLM, SamplingParams

    store = tmp_path / "store"
    llm = LLM(
        str(llama_dir),
        layers=[0, 3],
        include_prefill=True,
        enforce_eager=True,
        probes=random_probes(128),
        steering={"up": reference_steering()},
        store=store,
        **engine_defaults,
    )
    params = SamplingParams(
        max_tokens=3, temperature=0, extra_args={"probehook": {"steer": {"up": 1.0}}}
    )
    (out,) = llm.generate(["1+2="], params, use_tqdm=False)
    assert out.probe_scores and out.store_id is not None
    engine_core = weakref.ref(llm.llm_engine.engine_core.engine_core)  # in-process EngineCore
    front_end = weakref.ref(llm)
    del llm, out
    gc.collect()
    assert front_end() is None, "something of probehook's still holds the dropped LLM"
    assert engine_core() is None
    reopened = ActivationStore.for_writing(store, ActivationStore.open(store).meta)  # unlocked
    assert len(list(reopened.requests)) == 1
    reopened.close()


def test_shutdown_stops_the_engine_when_the_store_fails_to_close(
    llama_dir: Path, tmp_path: Path, engine_defaults: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from probehook import LLM
    from probehook.errors import StoreError

    llm = LLM(
        str(llama_dir), layers=[0], enforce_eager=True, store=tmp_path / "s", **engine_defaults
    )
    store, engine_core = llm.store, llm.llm_engine.engine_core
    stopped = []
    shutdown = engine_core.shutdown
    monkeypatch.setattr(engine_core, "shutdown", lambda: (stopped.append(1), shutdown()))
    close = store.close

    def failing_close() -> None:
        raise StoreError("disk gone")

    monkeypatch.setattr(store, "close", failing_close)
    with pytest.raises(StoreError, match="disk gone"):
        llm.shutdown()
    assert stopped == [1]  # the engine stopped all the same
    close()


def test_dropped_async_llm_is_released_and_a_failed_start_leaks_nothing(
    llama_dir: Path, tmp_path: Path, engine_defaults: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncLLM`` (its engine core is a process of its own, whatever the layout):

    - a capture start whose stream connect fails leaves nothing open (the store's lock, the
      spool, the receiver thread; issue 37, item 4), and a later request starts it again;
    - dropped with capture, probes, steering and a store, the engine is collected, its engine
      core process ends and its store is committed and unlocked (item 8)."""
    import asyncio
    import threading

    import psutil
    from helpers import random_probes, reference_steering

    from probehook import AsyncLLM, SamplingParams
    from probehook.adapter.frontend import setup

    store = tmp_path / "store"
    started: list[tuple] = []
    start = setup.start
    monkeypatch.setattr(
        setup, "start", lambda *a, **k: started.append(start(*a, **k)) or started[-1]
    )  # noqa: E501

    def receivers() -> int:
        return sum(t.name == "probehook-stream" for t in threading.enumerate())

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}

    async def main() -> tuple[weakref.ref, set[int]]:
        engine = AsyncLLM(
            str(llama_dir),
            layers=[0, 3],
            include_prefill=True,
            enforce_eager=True,
            probes=random_probes(128),
            steering={"up": reference_steering()},
            store=store,
            **engine_defaults,
        )
        core = {  # vLLM names its engine core process (not multiprocessing's resource tracker)
            p.pid
            for p in psutil.Process().children(recursive=True)
            if p.pid not in children_before and p.name().startswith("VLLM::")
        }
        rpc, threads = engine.collective_rpc, receivers()

        async def connect_fails(method: str, *args: object, **kwargs: object) -> object:
            if method == "probehook_stream_connect":
                raise RuntimeError("staged: the stream connect fails")
            return await rpc(method, *args, **kwargs)

        engine.collective_rpc = connect_fails
        with pytest.raises(RuntimeError, match="staged"):
            await engine.start_capture()
        ((session, _, _),) = started
        assert not any(d.exists() for d in session.spool.dirs)
        assert receivers() == threads
        ActivationStore.for_writing(store, ActivationStore.open(store).meta).close()  # unlocked
        del engine.collective_rpc
        params = SamplingParams(
            max_tokens=3, temperature=0, extra_args={"probehook": {"steer": {"up": 1.0}}}
        )
        async for out in engine.generate("1+2=", params):  # noqa: B007 - the last one
            pass
        assert out.probe_scores and out.store_id is not None
        front_end = weakref.ref(engine)
        del engine, out
        gc.collect()
        return front_end, core

    front_end, core = asyncio.run(main())
    gc.collect()
    assert front_end() is None, "something of probehook's still holds the dropped AsyncLLM"
    assert core, "the engine core process was not found"
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in core], timeout=30)
    assert not alive, f"engine core processes {alive} outlived their AsyncLLM"
    reopened = ActivationStore.for_writing(store, ActivationStore.open(store).meta)  # unlocked
    assert len(list(reopened.requests)) == 1
    reopened.close()
