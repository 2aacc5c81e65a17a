"""The capture tap: a custom op that copies a layer's residual stream into a preallocated buffer.

Being a ``torch.library.custom_op`` is what lets the tap survive ``torch.compile`` (the op stays
in the graph as an opaque call) and CUDA-graph capture (the copy kernel writes to a fixed
address, so replay fills the same buffer). Python forward hooks added after compilation would
be silently skipped, so the tap is installed when the model is loaded, before vLLM compiles it.
"""

from __future__ import annotations

import torch

OP_NAMESPACE = "probehook"


@torch.library.custom_op(f"{OP_NAMESPACE}::tap", mutates_args=("out",))
def tap(hidden: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write ``hidden + residual`` (or ``hidden`` alone) into ``out[:num_tokens]``.

    vLLM decoder layers return ``(hidden, residual)`` with the residual add fused into the next
    layer's norm; their sum is the residual stream after the layer.
    """
    rows = out[: hidden.shape[0]]
    if residual is None:
        rows.copy_(hidden)
    else:
        torch.add(hidden, residual, out=rows)


@tap.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
    return None
