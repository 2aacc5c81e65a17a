"""One replica of a collection: a capture-only ``probehook.LLM`` writing its own store lane.

The same class runs in the driver's process (one replica) or as a Ray actor (several).
"""

from __future__ import annotations

import os
from typing import Any


def lane_of(index: int) -> str:
    return f"replica-{index}"


class Replica:
    """A capture-only engine; :meth:`capture` returns once its batch is durable."""

    def __init__(self, spec: dict[str, Any], index: int) -> None:
        from probehook.adapter.frontend.offline import LLM

        self.index = index
        self.lane = lane_of(index)
        capture = spec["capture"]
        self.llm = LLM(
            spec["model"],
            layers=capture["layers"],
            probes=capture["probes"],
            capture_only=True,
            store=spec["store"],
            store_options={**spec["store_options"], "lane": self.lane},
            **spec["engine"],
        )

    def describe(self) -> dict[str, Any]:
        """What the engine captures (as its store run records it), its run id and pid."""
        assert self.llm.capture_config is not None and self.llm.store is not None
        return {
            "capture": self.llm.capture_config.to_dict(),
            "run": self.llm.store._run_id,
            "pid": os.getpid(),
            "lane": self.lane,
        }

    def capture(self, ids: list[str], prompts: list[Any]) -> dict[str, int]:
        outputs = self.llm.capture(_prompt_inputs(prompts), ids=ids, use_tqdm=False)
        return {"items": len(outputs), "tokens": sum(len(o.prompt_token_ids) for o in outputs)}

    def close(self) -> None:
        self.llm.shutdown()


def _prompt_inputs(prompts: list[Any]) -> list[Any]:
    # A list of ints is one prompt of token ids, which vLLM takes as a dict.
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
