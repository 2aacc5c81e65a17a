"""Steering's write kind ``"add"``: adds each token's steering vector to a layer's residual
stream, in place, inside the write op (``probehook.worker.write_op``).

It reads two fixed buffers: ``index`` (one slot per token of the step, 0 for "not steered")
and ``table`` (one row per slot, row 0 all zeros), both written by the worker before each
forward pass. Neither the vectors nor the requests are part of the graph, so changing them
never recompiles, and CUDA-graph replay adds whatever the buffers hold at replay time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probehook.worker.write_op import write_kind


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


ADD_TENSORS = 2
"""The buffers an ``"add"`` term takes: the index and the table."""


@write_kind("add")
def add(
    hidden: torch.Tensor, residual: torch.Tensor | None, tensors: Sequence[torch.Tensor], _: str
) -> None:
    index, table = tensors
    steer(hidden, index, table)
