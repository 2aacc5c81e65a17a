"""The steering op: adds each token's steering vector to a layer's residual stream, in place.

Like the capture tap (``probehook.worker.tap_op``) it is a ``torch.library.custom_op``, so it
stays in vLLM's compiled graph as one opaque call and reads only fixed buffers: ``index``
(one slot per token of the step, 0 for "not steered") and ``table`` (one row per slot, row 0
all zeros), both written by the worker before each forward pass. Neither the vectors nor the
requests are part of the graph, so changing them never recompiles, and CUDA-graph replay adds
whatever the buffers hold at replay time.
"""

from __future__ import annotations

import torch

from probehook.worker.tap_op import OP_NAMESPACE


@torch.library.custom_op(f"{OP_NAMESPACE}::steer", mutates_args=("hidden",))
def steer(hidden: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> None:
    """``hidden[t] += table[index[t]]`` for the step's tokens ``t < hidden.shape[0]``.

    ``hidden`` is ``[tokens, hidden]``: the layer's output (vLLM layers that defer the residual
    add return ``(hidden, residual)``; adding to either part adds to their sum, the stream).
    """
    slots = index[: hidden.shape[0]]
    # On a CPU the check is a few microseconds and skips the gather on unsteered steps. On a
    # GPU it would be a host sync, and a CUDA graph would freeze the branch it took at capture.
    if hidden.device.type == "cpu" and not bool(slots.any()):
        return
    hidden.add_(table.index_select(0, slots).to(hidden.dtype))


@steer.register_fake
def _(hidden: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> None:
    return None
