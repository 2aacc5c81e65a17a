"""The offline engine raises when its engine-core process dies, instead of waiting forever.

vLLM 0.32's ``SyncMPClient`` notices a dead engine core (its monitor thread sets
``resources.engine_dead`` and shuts the client down), but the thread that fills
``outputs_queue`` then just stops, so ``LLM.generate``/``encode`` block in
``outputs_queue.get()``, and a pending ``collective_rpc`` in ``future.result()``, for good. A
collection's replica whose engine dies would hang its whole collection. This watcher hands the
waiting calls vLLM's own ``EngineDeadError`` once the engine is marked dead.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

POLL_SECONDS = 0.5


def raise_on_engine_death(engine_core: Any) -> None:
    """Watch a ``SyncMPClient`` (other clients are left alone: they have no such wait)."""
    resources = getattr(engine_core, "resources", None)
    if resources is None or not hasattr(engine_core, "outputs_queue"):
        return
    client = weakref.ref(engine_core)
    stop = threading.Event()
    weakref.finalize(engine_core, stop.set)

    def watch() -> None:
        while not stop.wait(POLL_SECONDS):
            if not getattr(resources, "engine_dead", False):
                continue
            alive = client()
            if alive is None:
                return
            from vllm.v1.engine.exceptions import EngineDeadError

            alive.outputs_queue.put_nowait(EngineDeadError())
            for future in list(getattr(alive, "utility_results", {}).values()):
                if not future.done():
                    future.set_exception(EngineDeadError())
            return

    threading.Thread(target=watch, name="probehook-engine-death", daemon=True).start()
