"""Host index arrays onto the device without a stream sync."""

from __future__ import annotations

import numpy as np
import torch


def on_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device``, copied without waiting: a blocking host-to-device
    copy synchronizes the stream, which stalls every step under async scheduling (and fails
    ``torch.cuda.set_sync_debug_mode("error")``). A copy from pageable memory is staged before
    the call returns, so the array may change after."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
