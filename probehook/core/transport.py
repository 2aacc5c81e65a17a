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

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_warned_fallback = False

DTYPES = {
    str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def map_file(path: str, size: int) -> Any:
    """A private, writable (copy-on-write) mapping of ``path`` that holds no file descriptor.

    Python's ``mmap`` keeps a duplicate of the file's descriptor until the map is collected,
    so every export whose tensors a user keeps (``outs.append(llm.generate([p])[0])`` in a
    loop) would hold one descriptor, and a long loop would run out of them. Mapped through libc
    the descriptor is closed at once; the mapping is unmapped when the last tensor over it is
    gone (``torch.frombuffer`` keeps the buffer alive). Falls back to ``mmap`` where libc's
    ``mmap`` cannot be reached.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = _libc()
        address = None
        if libc is not None:
            address = libc.mmap(None, size, _PROT_RW, mmap.MAP_PRIVATE, fd, 0)
            if address in (None, _MAP_FAILED):
                address = None
        if address is None:
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
    buffer = (ctypes.c_char * size).from_address(address)
    weakref.finalize(buffer, libc.munmap, address, size)
    return buffer


_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


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
    with open(path, "wb", buffering=WRITE_BUFFER) as f:
        for tensor in tensors:
            data = tensor
            if data.device.type != "cpu" or data.requires_grad or not data.is_contiguous():
                data = data.detach().to("cpu").contiguous()
            nbytes = data.nbytes
            if nbytes:
                f.write(_bytes_of(data))
            entries.append({"offset": offset, "shape": list(data.shape), "dtype": str(data.dtype)})
            offset += nbytes
    return entries


WRITE_BUFFER = 1 << 20
"""Small tensors (one pooled request's rows) are gathered into writes of this size."""


def _bytes_of(data: torch.Tensor) -> memoryview:
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: write its bits
        return memoryview(data.view(torch.int16).numpy()).cast("B")
    return memoryview(data.numpy()).cast("B")


def read_tensors(path: str, entries: Sequence[dict]) -> list[torch.Tensor]:
    """Map the file written by :func:`write_tensors` and return tensors over it; unlink it."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in entries]
        buf = map_file(path, size)
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
