"""Worker-to-front-end transport of captured rows: raw bytes in shared memory, no pickle.

The worker writes the tensors of one export back to back into a file the front end named
(under ``/dev/shm`` when it exists, so the bytes never touch a disk) and returns a small
manifest of ``{"offset", "shape", "dtype"}`` per tensor through vLLM's RPC. The front end maps
the file, builds tensors over it and unlinks it at once; the memory lives as long as the
tensors do.

``/dev/shm`` can be small (Docker gives 64 MB by default). When a write there runs out of
space, the worker writes the same bytes to the second path the front end named, on disk, and
says so once in the log.

The two halves: ``probehook.worker.transport_writer`` (in the worker) and
``probehook.frontend.transport_reader`` (in the user's process). This module holds what both
read: the dtypes a manifest may name.
"""

from __future__ import annotations

import torch

DTYPES = {
    str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}
"""The dtypes a transport manifest (or a stream message) may name, by ``str(dtype)``."""
