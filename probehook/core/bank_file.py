"""The banks a worker allocates at model load, as one file: the engine's probes and its first
steering vectors, with the steering bank's capacity. The front end writes the file before the
engine starts and names it in ``model_loader_extra_config`` (outside the compile-cache key);
the loader reads it inside vLLM's memory profiling, so the KV cache is sized around the
banks, as it is around the SAEs. Arrays travel in a safetensors file, not in vLLM's config or
RPC: no pickle, and nothing large in a config vLLM logs and copies. No vLLM."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from probehook.core.probe_spec import ACTIVATIONS, ProbeSpec
from probehook.core.steering_wire import DEFAULT_CAPACITY

_META_KEY = "probehook_banks"
_FORMAT = 1


@dataclass
class WorkerBanks:
    """What a worker's banks start with: probes (``ProbeSpec``), the steering bank's capacity
    and its first vectors (``{name: {layer: float32 [hidden]}}``; more come by RPC)."""

    probes: list[ProbeSpec] = field(default_factory=list)
    steering_capacity: int = DEFAULT_CAPACITY
    vectors: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)

    def write(self, path: str | os.PathLike) -> None:
        from safetensors.numpy import save_file

        tensors: dict[str, np.ndarray] = {}
        probes = []
        for i, spec in enumerate(self.probes):
            tensors[f"probe.{i}.weight"] = np.ascontiguousarray(spec.weight, dtype=np.float32)
            tensors[f"probe.{i}.bias"] = np.ascontiguousarray(spec.bias, dtype=np.float32)
            probes.append({"name": spec.name, "layer": spec.layer, "activation": spec.activation})
        vectors = []
        for j, (name, by_layer) in enumerate(self.vectors.items()):
            for layer, vector in by_layer.items():
                tensors[f"vector.{j}.{int(layer)}"] = np.ascontiguousarray(vector, np.float32)
            vectors.append({"name": name, "layers": [int(layer) for layer in by_layer]})
        meta = {"format": _FORMAT, "probes": probes, "vectors": vectors,
                "steering_capacity": int(self.steering_capacity)}  # fmt: skip
        save_file(tensors, os.fspath(path), metadata={_META_KEY: json.dumps(meta)})

    @classmethod
    def read(cls, path: str | os.PathLike) -> WorkerBanks:
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="numpy") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            if raw is None:
                raise ValueError(f"{path} is not a probehook bank file (no {_META_KEY!r})")
            meta = json.loads(raw)
            if meta.get("format") != _FORMAT:
                raise ValueError(f"{path}: bank file format {meta.get('format')!r}, not {_FORMAT}")
            probes = []
            for i, p in enumerate(meta["probes"]):
                if p["activation"] not in ACTIVATIONS:
                    raise ValueError(f"activation {p['activation']!r}; valid: {ACTIVATIONS}")
                probes.append(ProbeSpec(str(p["name"]), int(p["layer"]),
                                        f.get_tensor(f"probe.{i}.weight"),
                                        f.get_tensor(f"probe.{i}.bias"),
                                        str(p["activation"])))  # fmt: skip
            vectors = {
                str(v["name"]): {
                    int(layer): f.get_tensor(f"vector.{j}.{int(layer)}") for layer in v["layers"]
                }  # fmt: skip
                for j, v in enumerate(meta["vectors"])
            }
        return cls(probes, int(meta["steering_capacity"]), vectors)


class BankFile:
    """A bank file in a private temporary folder of its own, removed by :meth:`discard` once
    the engine has loaded (or with this object, if the engine never starts)."""

    def __init__(self, banks: WorkerBanks) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="probehook-banks-")
        self.path = str(Path(self._dir.name) / "banks.safetensors")
        banks.write(self.path)

    def discard(self) -> None:
        self._dir.cleanup()
