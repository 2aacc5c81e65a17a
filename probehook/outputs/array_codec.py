"""Arrays in JSON: a tensor as ``{"dtype", "shape", "data"}``, its raw little-endian bytes in
base64 (never pickle). Output processors write hidden states this way in a server's response
(``probehook.outputs.captures``); clients read them back with :func:`decode_array`.

This module knows nothing about vLLM.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def encode_array(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}``: the tensor's raw little-endian bytes in base64."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
    }


def decode_array(obj: Mapping[str, Any]) -> np.ndarray:
    """The array an :func:`encode_array` object holds, as numpy. ``bfloat16`` has no numpy
    dtype; it comes back as float32 holding the same values exactly."""
    try:
        dtype, shape, data = obj["dtype"], obj["shape"], base64.b64decode(obj["data"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not an encoded array (dtype, shape, data): {e}") from None
    if dtype == "bfloat16":  # the top half of a float32
        wide = np.frombuffer(data, dtype="<u2").astype("<u4") << 16
        return wide.view("<f4").reshape(shape)
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
