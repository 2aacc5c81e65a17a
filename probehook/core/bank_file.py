"""The banks a worker allocates at model load: the engine's probes and its first steering
vectors, with the steering bank's capacity. The front end encodes them (safetensors bytes,
base64) into ``model_loader_extra_config``, which vLLM hands to every worker wherever it runs
(a Ray node of its own included: no path on the user's machine) and keeps out of the
compile-cache key and out of the config it logs; the loader decodes them inside vLLM's memory
profiling, so the KV cache is sized around the banks, as it is around the SAEs. safetensors'
own format: no pickle. No vLLM."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import numpy as np

from probehook.core.probe_spec import ACTIVATIONS, ProbeSpec
from probehook.core.steering_wire import DEFAULT_CAPACITY, VectorRows

_META_KEY = "probehook_banks"
_FORMAT = 1


@dataclass
class WorkerBanks:
    """What a worker's banks start with: probes (``ProbeSpec``), the steering bank's capacity
    and its first vectors (``{name: VectorRows}``; more come by RPC)."""

    probes: list[ProbeSpec] = field(default_factory=list)
    steering_capacity: int = DEFAULT_CAPACITY
    vectors: dict[str, VectorRows] = field(default_factory=dict)
    """``VectorRows`` each (a plain ``{layer: vector}`` encodes as an addition)."""

    def encode(self) -> str:
        """The banks as text: base64 of a safetensors blob (arrays, and the names, layers and
        capacity in its metadata)."""
        from safetensors.numpy import save

        tensors: dict[str, np.ndarray] = {}
        probes = []
        for i, spec in enumerate(self.probes):
            tensors[f"probe.{i}.weight"] = np.ascontiguousarray(spec.weight, dtype=np.float32)
            tensors[f"probe.{i}.bias"] = np.ascontiguousarray(spec.bias, dtype=np.float32)
            probes.append({"name": spec.name, "layer": spec.layer, "activation": spec.activation})
        vectors = []
        for j, (name, rows) in enumerate(self.vectors.items()):
            if not isinstance(rows, VectorRows):  # {layer: vector}: an addition
                rows = VectorRows(dict(rows))
            for layer, vector in rows.writes.items():
                tensors[f"vector.{j}.{int(layer)}"] = np.ascontiguousarray(vector, np.float32)
            for layer, unit in (rows.units or {}).items():
                tensors[f"unit.{j}.{int(layer)}"] = np.ascontiguousarray(unit, np.float32)
            vectors.append({"name": name, "layers": [int(layer) for layer in rows.writes],
                            "op": rows.op, "params": rows.params,
                            "units": rows.units is not None})  # fmt: skip
        meta = {"format": _FORMAT, "probes": probes, "vectors": vectors,
                "steering_capacity": int(self.steering_capacity)}  # fmt: skip
        blob = save(tensors, metadata={_META_KEY: json.dumps(meta)})
        return base64.b64encode(blob).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> WorkerBanks:
        """What :meth:`encode` wrote."""
        from safetensors.numpy import load

        blob = base64.b64decode(text.encode("ascii"), validate=True)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        raw = (header.get("__metadata__") or {}).get(_META_KEY)
        if raw is None:
            raise ValueError(f"not probehook's banks (no {_META_KEY!r} in the metadata)")
        meta = json.loads(raw)
        if meta.get("format") != _FORMAT:
            raise ValueError(f"banks of format {meta.get('format')!r}, not {_FORMAT}")
        arrays = load(blob)
        probes = []
        for i, p in enumerate(meta["probes"]):
            if p["activation"] not in ACTIVATIONS:
                raise ValueError(f"activation {p['activation']!r}; valid: {ACTIVATIONS}")
            probes.append(ProbeSpec(str(p["name"]), int(p["layer"]), arrays[f"probe.{i}.weight"],
                                    arrays[f"probe.{i}.bias"], str(p["activation"])))  # fmt: skip
        vectors = {}
        for j, v in enumerate(meta["vectors"]):
            layers = [int(layer) for layer in v["layers"]]
            writes = {layer: arrays[f"vector.{j}.{layer}"] for layer in layers}
            units = {layer: arrays[f"unit.{j}.{layer}"] for layer in layers} if v.get("units") \
                else None  # fmt: skip
            vectors[str(v["name"])] = VectorRows(writes, units, str(v.get("op", "add")),
                                                 dict(v.get("params") or {}))  # fmt: skip
        return cls(probes, int(meta["steering_capacity"]), vectors)
