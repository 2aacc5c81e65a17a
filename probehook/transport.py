"""Worker-to-front-end transport of captured rows: raw bytes in shared memory, no pickle.

The worker writes the tensors of one export back to back into a file the front end named
(under ``/dev/shm`` when it exists, so the bytes never touch a disk) and returns a small
manifest of dtype, shapes and offsets through vLLM's RPC. The front end maps the file, builds
tensors over it and unlinks it at once; the memory lives as long as the tensors do.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

DTYPES = {
    str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def spool_dir() -> Path:
    """A private directory for export files: tmpfs when available."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix="probehook-", dir=base))
    path.chmod(0o700)
    return path


def new_export_path(directory: Path) -> str:
    return str(directory / f"export-{uuid.uuid4().hex}.bin")


def write_tensors(path: str, tensors: Sequence[torch.Tensor]) -> list[dict]:
    """Write tensors back to back; return ``[{"offset", "shape", "dtype"}]`` per tensor."""
    entries = []
    offset = 0
    with open(path, "wb") as f:
        for tensor in tensors:
            data = tensor.detach().to("cpu").contiguous()
            nbytes = data.numel() * data.element_size()
            if nbytes:
                f.write(memoryview(data.view(torch.uint8).numpy()))
            entries.append({"offset": offset, "shape": list(data.shape), "dtype": str(data.dtype)})
            offset += nbytes
    return entries


def read_tensors(path: str, entries: Sequence[dict]) -> list[torch.Tensor]:
    """Map the file written by :func:`write_tensors` and return tensors over it; unlink it."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in entries]
        with open(path, "r+b") as f:
            buf = mmap.mmap(f.fileno(), size)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    tensors = []
    for e in entries:
        dtype = DTYPES[e["dtype"]]
        count = 1
        for dim in e["shape"]:
            count *= dim
        if count == 0:
            tensors.append(torch.empty(e["shape"], dtype=dtype))
            continue
        flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=e["offset"])
        tensors.append(flat.view(e["shape"]))
    return tensors
