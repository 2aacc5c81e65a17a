"""How many shard files a reader may keep open.

A store of thousands of shards must not hold thousands of file handles, and may hold only as
many as the process can spare: engine sockets and the user's files need descriptors too.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any

MAX_OPEN_FILES = 128
"""The most shard files one reader keeps open; fewer when the process has fewer descriptors
left (see :func:`open_file_budget`)."""

INHERITED_FILES: list[Any] = []
"""In a forked child: shard files opened by the parent, kept referenced and never closed here
(see ``StoreReader._after_fork``)."""


def soft_nofile() -> int | None:
    """This process's soft RLIMIT_NOFILE (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def descriptors_in_use() -> int | None:
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(fd_dir)) - 1  # less the listing's own descriptor
    return None


def open_file_budget(soft_limit: int | None, in_use: int | None, held: int = 0) -> int:
    """How many shard files a reader may keep open: half of what the process has left under
    its soft open-file limit, counting the ``held`` files the reader already has as its own
    (the other half stays for everything else: engine sockets, the user's files). At most
    :data:`MAX_OPEN_FILES`, at least 1."""
    if soft_limit is None or in_use is None:
        return MAX_OPEN_FILES
    free = soft_limit - (in_use - held)
    return max(1, min(MAX_OPEN_FILES, free // 2))


def is_emfile(error: OSError) -> bool:
    # h5py sets errno from HDF5's message ("errno = 24"); the text is a fallback.
    return error.errno == errno.EMFILE or "Too many open files" in str(error)
