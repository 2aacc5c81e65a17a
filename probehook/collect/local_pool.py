"""One replica in the driver's own process (no Ray): batches run one after another."""

from __future__ import annotations

from collections import deque
from typing import Any

from probehook.collect.failures import replica_failed
from probehook.collect.items import Item
from probehook.collect.replica import Replica


class LocalPool:
    size = 1

    def __init__(self, spec: dict[str, Any]) -> None:
        self.replica = Replica(spec, 0)
        self._queue: deque[list[Item]] = deque()

    def describe(self) -> dict[str, Any]:
        described = self.replica.describe()
        return {**described, "runs": [described["run"]]}

    def lane(self, replica: int) -> str:
        return self.replica.lane

    def submit(self, replica: int, batch: list[Item]) -> None:
        self._queue.append(batch)

    def busy(self) -> bool:
        return bool(self._queue)

    def next_done(self) -> tuple[int, dict[str, int]]:
        batch = self._queue.popleft()
        try:
            return 0, self.replica.capture([i.id for i in batch], [i.prompt for i in batch])
        except Exception as e:  # the engine died or failed: stop, keep what is committed
            self._queue.clear()
            raise replica_failed(0, self.replica.lane, e) from e

    def close(self) -> None:
        self.replica.close()
