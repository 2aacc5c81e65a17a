"""The probe file: one safetensors file, tensors plus a JSON header in its metadata. No pickle.

tensors   weight [n_outputs, hidden], bias [n_outputs], optional mean [hidden], std [hidden]
          (float32)
metadata  {"probehook_probe": JSON {"format_version": 1, "hidden_size", "n_outputs", "layer",
          "kind", "label_names", "phase", "token", "name", "model_fingerprint", "metrics",
          "split": {"train": [store ids], "test": [store ids]} | null, "probehook_version"}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from probehook.errors import ProbeError
from probehook.probes.linear import LinearProbe, ProbeSplit

FORMAT_VERSION = 1
METADATA_KEY = "probehook_probe"
"""Key of the JSON header in the safetensors metadata of a probe file."""


def save_probe(probe: LinearProbe, path: str | os.PathLike[str]) -> Path:
    """Write ``probe`` to ``path`` (atomically: a crash never leaves half a probe)."""
    from safetensors.torch import save_file

    from probehook._version import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": probe.weight, "bias": probe.bias}
    if probe.mean is not None:
        tensors["mean"] = probe.mean
    if probe.std is not None:
        tensors["std"] = probe.std
    split = probe.split
    header = {
        "format_version": FORMAT_VERSION,
        "hidden_size": probe.hidden_size,
        "n_outputs": probe.n_outputs,
        "layer": probe.layer,
        "kind": probe.kind,
        "label_names": probe.label_names,
        "phase": probe.phase,
        "token": probe.token,
        "name": probe.name,
        "model_fingerprint": probe.model_fingerprint,
        "metrics": probe.metrics,
        "split": None if split is None else {"train": list(split.train), "test": list(split.test)},
        "probehook_version": __version__,
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, os.fspath(tmp), metadata={METADATA_KEY: json.dumps(header)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_probe(path: str | os.PathLike[str]) -> LinearProbe:
    """Read a probe file; anything damaged or foreign is a ProbeError naming the file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No probe file at {path}.")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as e:  # safetensors raises its own SafetensorError for any damage
        raise ProbeError(
            f"{path} is not a readable probe file ({e}); it may be truncated or not "
            "written by LinearProbe.save."
        ) from e
    header = _header(path, metadata)
    missing = [k for k in ("weight", "bias") if k not in tensors]
    missing += [k for k in ("layer", "kind") if k not in header]
    if missing:
        raise ProbeError(f"{path} is not a complete probe file: it lacks {missing}.")
    split = header.get("split")
    try:
        split = None if split is None else ProbeSplit(tuple(split["train"]), tuple(split["test"]))
        probe = LinearProbe(
            tensors["weight"],
            tensors["bias"],
            layer=header["layer"],
            kind=header["kind"],
            label_names=header.get("label_names"),
            phase=header.get("phase", "decode"),
            token=header.get("token", "last"),
            name=header.get("name"),
            mean=tensors.get("mean"),
            std=tensors.get("std"),
            model_fingerprint=header.get("model_fingerprint"),
            metrics=header.get("metrics"),
            split=split,
        )
    except (ProbeError, KeyError, TypeError) as e:
        raise ProbeError(f"{path} holds an invalid probe: {e}") from e
    if header.get("hidden_size", probe.hidden_size) != probe.hidden_size:
        raise ProbeError(
            f"{path}: its header says hidden size {header['hidden_size']} but its weight has "
            f"{probe.hidden_size}."
        )
    return probe


def _header(path: Path, metadata: dict[str, str]) -> dict[str, Any]:
    return json_header(
        path, metadata, METADATA_KEY, FORMAT_VERSION, ProbeError, "LinearProbe.save", "probe"
    )


def json_header(
    path: Path,
    metadata: dict[str, str],
    key: str,
    version: int,
    error: type[Exception],
    writer: str,
    kind: str,
) -> dict[str, Any]:
    """The JSON object under ``key`` in a safetensors file's metadata, of format ``version``;
    ``error`` naming the file otherwise. Shared by probe and steering-vector files."""
    if key not in metadata:
        raise error(
            f"{path} is a safetensors file without {key!r} metadata: it was not written by "
            f"{writer}."
        )
    try:
        header = json.loads(metadata[key])
    except ValueError as e:
        raise error(f"{path}: its {key!r} metadata is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise error(f"{path}: its {key!r} metadata is not a JSON object.")
    found = header.get("format_version")
    if found != version:
        raise error(
            f"{path} is {kind} format version {found!r}, but this probehook reads version "
            f"{version}; use the probehook release that wrote it."
        )
    return header
