"""What both SAE readers share: the file names, the error, the fingerprint (the config, the
safetensors header and samples of the weights: :func:`fingerprint_of`), reading the tensors (or
only their shapes)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from probehook.errors import ProbehookError

SAELENS_WEIGHTS = "sae_weights.safetensors"
SPARSIFY_WEIGHTS = "sae.safetensors"
CONFIG = "cfg.json"


class SAEError(ProbehookError, ValueError):
    """An SAE cannot be read or used: a missing or damaged file, an architecture or hook
    probehook does not read, a size that does not match the model, a bad per-request name."""


FINGERPRINT_VERSION = 2
FINGERPRINT_PREFIX = f"v{FINGERPRINT_VERSION}:"
"""A fingerprint of this scheme reads ``"v2:<64 hex>"``; one written before it (the sha256 of
every byte, :func:`legacy_fingerprint_of`) is 64 hex characters with no prefix."""
SAMPLE_BYTES = 32 << 10
SAMPLES_PER_TENSOR = 16
"""A tensor's data of at most ``SAMPLES_PER_TENSOR * SAMPLE_BYTES`` (512 KiB) is hashed whole;
a larger one as that many samples of ``SAMPLE_BYTES``, evenly spaced, first and last
included."""
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


def fingerprint_of(folder: Path, weights_file: str) -> str:
    """Which SAE stored features came from: ``"v2:"`` and a sha256 of

    * ``cfg.json``, every byte;
    * the weights file's name and size, and its safetensors header, every byte: each
      tensor's name, dtype, shape and offsets (and the ``__metadata__``);
    * each tensor's data: whole for a tensor of at most 512 KiB (biases, thresholds,
      ``b_dec``: of a 16k-feature float32 SAE, all but ``W_enc`` and ``W_dec``); for a larger
      one, :data:`SAMPLES_PER_TENSOR` evenly spaced samples of :data:`SAMPLE_BYTES` (first
      and last bytes included), with their offsets.

    At most 512 KiB is read of each tensor (about 1 MiB of a standard or top-k SAE, however
    large; the whole file only where it is small), so ``SAE.load(weights=False)``, which an
    engine does in the user's process, costs a few reads instead of hashing 1-4 GB. Nothing
    depends on the folder's path, its mtime or the process: a copy of the folder, read
    anywhere, gives the same fingerprint.

    What it guarantees: a different config, tensor list, dtype, shape, file size or small
    tensor gives a different fingerprint, and so do weights that differ in a sampled region,
    which two separately trained SAEs (or two checkpoints of one training run) do wherever
    they are sampled. What it does not: an edit confined to unsampled bytes of a large
    tensor (say one feature's decoder row rewritten in place, same dtype and shape) may keep
    the fingerprint: it is not a checksum of the file. (A feature's SAELens encoder column
    has an entry in every row of ``W_enc``, so editing it is seen where a sample spans that
    column in some row: likely, not certain, for a wide SAE.)

    :func:`legacy_fingerprint_of` hashes every byte (what probehook recorded before this
    scheme); :func:`matches_fingerprint` compares a recorded fingerprint of either scheme with
    a folder."""
    digest = hashlib.sha256(b"probehook SAE fingerprint v2\0")
    config = (folder / CONFIG).read_bytes()
    _field(digest, config)
    file = folder / weights_file
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        _field(digest, weights_file.encode())
        _field(digest, str(size).encode())
        layout = _safetensors_layout(f, size)
        header, spans = layout if layout is not None else (b"", [(0, size)])
        _field(digest, header)
        for begin, end in spans:
            for offset, length in _samples(begin, end):
                f.seek(offset)
                data = f.read(length)
                _field(digest, f"{offset}+{len(data)}".encode())
                digest.update(data)
    return FINGERPRINT_PREFIX + digest.hexdigest()


def legacy_fingerprint_of(folder: Path, weights_file: str) -> str:
    """The fingerprint probehook recorded before :data:`FINGERPRINT_VERSION` 2: the sha256 of
    every byte of the config and the weights (reads the whole file)."""
    digest = hashlib.sha256()
    for name in (CONFIG, weights_file):
        with open(folder / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def matches_fingerprint(folder: str | os.PathLike[str], recorded: str) -> bool:
    """Whether the SAE in ``folder`` (SAELens or sparsify, as ``SAE.load`` picks its weights
    file) is the one a store's run recorded as ``recorded``: compared as :func:`fingerprint_of`
    computes it, or, for a fingerprint recorded before that scheme (no ``"v2:"`` prefix), as
    :func:`legacy_fingerprint_of` does (reading every byte)."""
    folder = Path(folder)
    weights_file = SAELENS_WEIGHTS if (folder / SAELENS_WEIGHTS).is_file() else SPARSIFY_WEIGHTS
    if recorded.startswith(FINGERPRINT_PREFIX):
        return fingerprint_of(folder, weights_file) == recorded
    return legacy_fingerprint_of(folder, weights_file) == recorded


def _field(digest: Any, data: bytes) -> None:
    """One length-prefixed field (so no two sequences of fields hash alike)."""
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def _safetensors_layout(f: BinaryIO, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """The header bytes (its 8-byte length included) and each tensor's data span in the file,
    in the header's order of names; None where the file is not a readable safetensors file
    (then the whole file is sampled as one span)."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        return None
    length = int.from_bytes(head, "little")
    if length > min(size - 8, _MAX_HEADER):
        return None
    header = f.read(length)
    try:
        parsed = json.loads(header)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    start = 8 + length
    spans = []
    for name in sorted(parsed):
        entry = parsed[name]
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= size - start
        ):
            return None
        spans.append((start + offsets[0], start + offsets[1]))
    return head + header, spans


def _samples(begin: int, end: int) -> list[tuple[int, int]]:
    """``(offset, length)`` reads covering ``[begin, end)`` whole, or sampling it."""
    total = end - begin
    if total <= SAMPLES_PER_TENSOR * SAMPLE_BYTES:
        return [(begin, total)]
    last = SAMPLES_PER_TENSOR - 1
    return [(begin + i * (total - SAMPLE_BYTES) // last, SAMPLE_BYTES) for i in range(last + 1)]


def read_tensors(file: Path, weights: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; with ``weights=False`` only their shapes and dtypes
    (tensors on the ``meta`` device: the header is read, not the data)."""
    from safetensors import safe_open

    try:
        if weights:
            from safetensors.torch import load_file

            return load_file(os.fspath(file))
        with safe_open(os.fspath(file), framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = f.get_slice(name)
                dtype = _DTYPES.get(part.get_dtype())
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has dtype {part.get_dtype()}")
                out[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
            return out
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise SAEError(f"{os.fspath(file)!r} is not readable: {e}") from e


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}  # fmt: skip
