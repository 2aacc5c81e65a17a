"""One writer per lane: an OS file lock on ``STORE/writer.lock`` (the root lane) or
``STORE/lanes/LANE/writer.lock``.

Appending to a lane repairs it first (cuts a torn manifest tail, deletes ``.tmp`` shards). With
two writers in one lane, that repair would destroy the other writer's shard in progress, so
every writer holds an exclusive ``flock`` on its lane's ``writer.lock`` from before the repair
until ``close()``. Writers of different lanes never touch each other's files. Readers never
take a lock. Creating a store (writing ``meta.json``) or checking a run against it happens
under a short blocking ``flock`` on ``STORE/create.lock`` (:func:`create_lock`), so two
writers that start at the same moment create it once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from probehook.errors import StoreError, StoreLockedError
from probehook.store.format import CREATE_LOCK, ROOT_LANE, WRITER_LOCK, lane_dir, lane_label

logger = logging.getLogger(__name__)

# A writer that has just won the lock writes its info a moment later: wait that long for it.
_INFO_RETRIES = 20
_INFO_RETRY_S = 0.01


class WriterLock:
    """Exclusive, non-blocking ``flock`` on ``STORE/writer.lock``, held until :meth:`release`.

    The kernel drops the lock when the holder's file is closed, which includes the holder being
    killed, so a lock left by a crashed writer never needs manual cleanup: the next writer takes
    it over (and logs who held it). ``flock`` belongs to an open file description, so two
    writers in one process conflict too, and a child made with a bare ``fork()`` (no ``exec``)
    while the lock is held shares it and keeps it alive.

    The file holds the holder's ``{"pid", "host", "since"}`` for error messages only; the flock
    is what excludes. It is emptied on release, so info left in it means the holder died.

    NFS: Linux emulates ``flock`` on NFS with byte-range locks held on the server, so it does
    exclude writers on different hosts, but the server may drop it after a network partition or
    a lease expiry, and some other network or FUSE filesystems keep ``flock`` local to one host.
    On such filesystems keep each store's writers on one host (or write to local disk).
    """

    def __init__(self, root: Path, fd: int, lane: str = ROOT_LANE) -> None:
        self.root = root
        self.lane = lane
        self.path = lane_dir(root, lane) / WRITER_LOCK
        self._fd: int | None = fd

    @staticmethod
    def check_free(root: str | os.PathLike[str], lane: str = ROOT_LANE) -> None:
        """Raise :class:`StoreLockedError` if a writer holds the lane's lock now; change
        nothing.

        For failing early (before a minute of engine start-up): the lock itself is taken
        later by :meth:`acquire`, which checks again.
        """
        path = lane_dir(Path(root), lane) / WRITER_LOCK
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(
                _locked_message(Path(root), _read_info(fd, wait=True), lane)
            ) from None
        except OSError:
            return  # no lock support: acquire() says so with the full explanation
        finally:
            os.close(fd)  # drops the probe's flock, if it got one

    @classmethod
    def acquire(cls, root: str | os.PathLike[str], lane: str = ROOT_LANE) -> WriterLock:
        """Take the lock of ``lane`` (default: the root lane) of the store directory ``root``
        (the lane's directory must exist) or raise :class:`StoreLockedError` naming the
        holder."""
        root = Path(root)
        path = lane_dir(root, lane) / WRITER_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(f"Cannot open the writer lock {path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_info(fd, wait=True)
            os.close(fd)
            raise StoreLockedError(_locked_message(root, holder, lane)) from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise StoreError(
                    f"The filesystem of {root} does not support file locks ({e}), so probehook "
                    "cannot make sure it is the only writer. Write the store to a local disk."
                ) from e
            raise StoreError(f"Cannot lock {path}: {e}") from e
        try:
            previous = _read_info(fd, wait=False)
            me = (os.getpid(), socket.gethostname())
            if previous and (previous.get("pid"), previous.get("host")) != me:
                # A clean release empties the file: info left there is from a writer that died.
                logger.warning(
                    "probehook store %s (%s): taking over the writer lock of pid %s on host %s "
                    "(since %s); that writer ended without closing the store",
                    root,
                    lane_label(lane),
                    previous.get("pid"),
                    previous.get("host"),
                    previous.get("since"),
                )
            info = {
                "pid": me[0],
                "host": me[1],
                "since": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)  # closing drops the flock too
            raise
        return cls(root, fd, lane)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the holder info, unlock and close. The file stays: unlinking it would let a
        writer that opened the old file and one that creates a new file both hold "the" lock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_info(fd: int, *, wait: bool) -> dict[str, Any] | None:
    """The holder info in the lock file, or None if it is empty or unreadable."""
    for attempt in range(_INFO_RETRIES if wait else 1):
        if attempt:
            time.sleep(_INFO_RETRY_S)
        try:
            size = os.fstat(fd).st_size
            info = json.loads(os.pread(fd, max(size, 1), 0)) if size else None
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict):
            return info
    return None


def _locked_message(root: Path, holder: dict[str, Any] | None, lane: str = ROOT_LANE) -> str:
    if holder is None:
        who = "another writer (it has not recorded its pid yet)"
    else:
        pid, host, since = holder.get("pid"), holder.get("host"), holder.get("since")
        who = f"pid {pid} on host {host} (since {since})"
        if (pid, host) == (os.getpid(), socket.gethostname()):
            who += ", that is this process: another ActivationStore or LLM(store=...) here"
    if lane == ROOT_LANE:
        return (
            f"The activation store at {root} is being written by {who}. One writer at a time "
            "may append to a store (to one lane of it). Close that writer (LLM.shutdown() or "
            "ActivationStore.close()) or wait for it to finish, write to another lane "
            "(for_writing(..., lane=NAME)) or to another store path. Reading with "
            "ActivationStore.open works meanwhile."
        )
    return (
        f"Lane {lane!r} of the activation store at {root} is being written by {who}. One "
        "writer at a time may append to a lane. Close that writer or wait for it to finish, "
        "or write to another lane. Reading with ActivationStore.open works meanwhile."
    )


@contextmanager
def create_lock(root: Path) -> Iterator[None]:
    """Hold ``STORE/create.lock`` (blocking ``flock``) while creating ``meta.json`` or checking
    a run against it. Held for milliseconds, never while waiting for anything else."""
    path = root / CREATE_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StoreError(f"Cannot open {path}: {e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise StoreError(
                    f"The filesystem of {root} does not support file locks ({e}), so probehook "
                    "cannot make sure writers do not collide. Write the store to a local disk."
                ) from e
            raise StoreError(f"Cannot lock {path}: {e}") from e
        yield
    finally:
        os.close(fd)  # drops the flock
