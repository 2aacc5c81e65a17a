"""Several replicas as Ray actors, on this machine or on a Ray cluster.

Why Ray actors (and not Ray Data's ``map_batches``): a replica is a stateful engine that writes
its own store lane and acknowledges each batch once it is durable; the activations never travel
back to the driver, only counts. Actors give exactly that (one long-lived engine per actor,
a method call per batch, the driver deciding what each replica does next, which is what makes
resume exact), with none of Ray Data's block shuffling through the object store.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from probehook.collect.failures import replica_failed
from probehook.collect.items import Item
from probehook.collect.replica import Replica, lane_of
from probehook.errors import CaptureConfigError, MissingExtraError

OBJECT_STORE_BYTES = 256 << 20  # batches of prompts and counts only: activations stay local


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise MissingExtraError(
            "Collections with replicas > 1 run on Ray, which is not installed: "
            "pip install 'probehook[ray]'."
        ) from e
    return ray


def cpu_groups(replicas: int, cores: list[int]) -> list[list[int]]:
    """This machine's cores split between the replicas (contiguous groups, as even as can be);
    each replica's vLLM binds its threads to its own group."""
    if replicas > len(cores):
        raise CaptureConfigError(
            f"replicas={replicas}, but this process may use {len(cores)} CPU cores "
            f"({cores}); a CPU replica needs at least one core of its own. Use replicas <= "
            f"{len(cores)}, or a Ray cluster (ray_address=...)."
        )
    size, extra = divmod(len(cores), replicas)
    groups, start = [], 0
    for k in range(replicas):
        end = start + size + (1 if k < extra else 0)
        groups.append(cores[start:end])
        start = end
    return groups


class RayPool:
    def __init__(
        self, spec: dict[str, Any], replicas: int, address: str | None, logs: bool = False
    ) -> None:
        import torch

        ray = self.ray = import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            local = address is None
            ray.init(
                address=address,
                include_dashboard=False,
                num_cpus=len(os.sched_getaffinity(0)) if local else None,
                object_store_memory=OBJECT_STORE_BYTES if local else None,
                configure_logging=False,
                # The replicas' engine logs stay in Ray's session logs (/tmp/ray/session_*/logs)
                # unless asked for: the driver shows one progress bar. Errors still come back.
                log_to_driver=logs,
            )
        self.local = address is None
        self.size = replicas
        remote = ray.remote(max_restarts=0, max_concurrency=1)(Replica)
        self.actors = []
        if torch.cuda.is_available():  # one GPU per replica (Ray sets CUDA_VISIBLE_DEVICES)
            options: list[dict[str, Any]] = [{"num_gpus": 1} for _ in range(replicas)]
        elif self.local:
            groups = cpu_groups(replicas, sorted(os.sched_getaffinity(0)))
            options = [
                {
                    "num_cpus": len(group),
                    "runtime_env": {
                        "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, group))}
                    },
                }
                for group in groups
            ]
        else:
            options = [{"num_cpus": 1} for _ in range(replicas)]
        self.actors = [remote.options(**options[k]).remote(spec, k) for k in range(replicas)]
        self._pending: dict[Any, int] = {}
        try:
            self._described = [self._get(a.describe.remote(), k) for k, a in enumerate(self.actors)]
        except BaseException:
            self.close()
            raise

    def describe(self) -> dict[str, Any]:
        first = dict(self._described[0])
        first["runs"] = [d["run"] for d in self._described]
        return first

    def lane(self, replica: int) -> str:
        return lane_of(replica)

    def submit(self, replica: int, batch: list[Item]) -> None:
        ref = self.actors[replica].capture.remote([i.id for i in batch], [i.prompt for i in batch])
        self._pending[ref] = replica

    def busy(self) -> bool:
        return bool(self._pending)

    def next_done(self) -> tuple[int, dict[str, int]]:
        ready, _ = self.ray.wait(list(self._pending), num_returns=1)
        replica = self._pending.pop(ready[0])
        return replica, self._get(ready[0], replica)

    def _get(self, ref: Any, replica: int) -> Any:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            raise replica_failed(replica, lane_of(replica), e) from e

    def close(self) -> None:
        closing = [actor.close.remote() for actor in self.actors]  # in parallel
        for ref in closing:
            with contextlib.suppress(Exception):  # a dead replica: nothing to flush
                self.ray.get(ref, timeout=120)
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self._owns_ray:
            self.ray.shutdown()
