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
    layer's norm; their sum is the residual stream after the layer. Rows are ``[tokens,
    hidden]``: the loader flattens the Transformers backend's ``[1, tokens, hidden]`` first.
    """
    if hidden.dim() != 2 or (residual is not None and residual.shape != hidden.shape):
        # Say what went wrong instead of a broadcast error from deep inside the engine.
        raise ValueError(
            f"probehook::tap takes [tokens, hidden] rows, got hidden {tuple(hidden.shape)}"
            f"{'' if residual is None else f' and residual {tuple(residual.shape)}'}: the "
            "layer-output adapter in probehook/adapter/worker/surgery.py does not fit this model."
        )
    rows = out[: hidden.shape[0]]
    if residual is None:
        rows.copy_(hidden)
    else:
        torch.add(hidden, residual, out=rows)


@tap.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
    return None
