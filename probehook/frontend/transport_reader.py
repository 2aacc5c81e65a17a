"""The front end's half of the transport (``probehook.core.transport``): its private export
directories, and tensors mapped over the file the worker wrote (no pickle, no descriptor
kept)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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

from probehook.core.transport import DTYPES


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
        # Removed with the spool (or at exit) even where nobody calls remove().
        self._remove = weakref.finalize(self, _remove_dirs, list(dirs))

    def new_paths(self) -> list[str]:
        """One file name per directory, in the order the worker should try them."""
        name = f"export-{uuid.uuid4().hex}.bin"
        return [str(d / name) for d in self.dirs]

    def owns(self, path: str) -> bool:
        return any(Path(path).parent == d for d in self.dirs)

    def remove(self) -> None:
        self._remove()


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


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
