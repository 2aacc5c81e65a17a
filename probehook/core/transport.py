"""Worker-to-front-end transport of captured rows: raw bytes in shared memory, no pickle.

The worker writes the tensors of one export back to back into a file the front end named
(under ``/dev/shm`` when it exists, so the bytes never touch a disk) and returns a small
manifest of dtype, shapes and offsets through vLLM's RPC. The front end maps the file, builds
tensors over it and unlinks it at once; the memory lives as long as the tensors do.

``/dev/shm`` can be small (Docker gives 64 MB by default). When a write there runs out of
space, the worker writes the same bytes to the second path the front end named, on disk, and
says so once in the log.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_warned_fallback = False

DTYPES = {
    str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


class Spool:
    """The front end's private export directories: tmpfs first, then disk as a fallback."""

    def __init__(self, shm: str | Path | None = "/dev/shm") -> None:
        dirs = []
        if shm is not None and Path(shm).is_dir():
            dirs.append(Path(tempfile.mkdtemp(prefix="probehook-", dir=shm)))
        dirs.append(Path(tempfile.mkdtemp(prefix="probehook-spill-")))
        for d in dirs:
            d.chmod(0o700)
        self.dirs = dirs

    def new_paths(self) -> list[str]:
        """One file name per directory, in the order the worker should try them."""
        name = f"export-{uuid.uuid4().hex}.bin"
        return [str(d / name) for d in self.dirs]

    def owns(self, path: str) -> bool:
        return any(Path(path).parent == d for d in self.dirs)

    def remove(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def write_tensors_with_fallback(
    paths: Sequence[str], tensors: Sequence[torch.Tensor]
) -> tuple[str, list[dict]]:
    """Write to the first path with room; return the path used and the manifest."""
    global _warned_fallback
    for i, path in enumerate(paths):
        try:
            return path, write_tensors(path, tensors)
        except OSError as e:
            if os.path.exists(path):
                os.unlink(path)
            if e.errno not in OUT_OF_SPACE or i == len(paths) - 1:
                raise
            if not _warned_fallback:
                logger.warning(
                    "probehook: %s is full (%s); captured rows now travel through %s on disk. "
                    "Give the container a larger /dev/shm (docker --shm-size) to keep them in "
                    "memory.",
                    os.path.dirname(path),
                    e.strerror,
                    os.path.dirname(paths[i + 1]),
                )
                _warned_fallback = True
    raise ValueError("no export path given")


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
