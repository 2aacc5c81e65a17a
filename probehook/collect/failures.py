"""How a collection stops when a replica fails: its own module, so that the driver
(:mod:`probehook.collect.collector`) and the pools that run the replicas
(:mod:`probehook.collect.local_pool`, :mod:`probehook.collect.ray_pool`) import it without
importing each other."""

from __future__ import annotations

from probehook.errors import ProbehookError


class CollectionError(ProbehookError, RuntimeError):
    """A collection stopped before every item was captured (a replica died, an engine failed).
    Everything committed stays in the store; rerunning the same collection finishes the rest."""


def replica_failed(replica: int, lane: str, error: BaseException) -> CollectionError:
    """The error a collection stops with when a replica (or its engine) fails."""
    return CollectionError(
        f"Replica {replica} ({lane}) failed: {type(error).__name__}: {error}\nEvery batch a "
        "replica returned is in the store; rerun the same collection to capture the rest "
        "(items already stored are skipped)."
    )
