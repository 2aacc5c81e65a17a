"""The worker's half of the transport (``probehook.core.transport``): one export's tensors
written back to back into a file the front end named, with a disk fallback when ``/dev/shm``
is full."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_warned_fallback = False


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
