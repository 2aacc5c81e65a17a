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

pytestmark = pytest.mark.engine


def test_dropped_llm_is_released_and_its_store_committed(
    llama_dir: Path, tmp_path: Path, engine_defaults: dict
) -> None:
    from helpers import random_probes, reference_steering

    from probehook import LLM, ActivationStore, SamplingParams

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
