"""Probes inside the worker: every probe of an engine as one fused matmul per layer per step.

The front end turns each :class:`~probehook.LinearProbe` into a :class:`ProbeSpec` (plain
arrays: the weight with its input normalisation folded in, the bias, and the activation),
which reaches the worker once, in the bank file its loader reads at model load. The worker's
:class:`ProbeBank` stacks the specs of each layer into one weight matrix, so a step costs one
``[rows, hidden] @ [outputs, hidden]^T`` per tapped layer, on the device, on the rows the step
keeps. Only the resulting scores (float32, one column per probe output) are copied to the host.

No vLLM imports: ``probehook.adapter``'s loader builds the bank at model load.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from probehook.core.probe_spec import SCORES_SLOT, ProbeSpec, columns_of


class ProbeBank:
    """The fused probes of one worker, callable on a recorder's staged rows.

    Called with ``staged`` (``[rows, hidden]`` of each bank layer, in :attr:`layers` order:
    one tensor ``[len(layers), rows, hidden]`` or a list of views), it returns ``[1, rows,
    width]`` float32 scores, activations applied, so the host receives final scores.
    """

    slots = (SCORES_SLOT,)
    dtype = torch.float32

    def __init__(self, specs: Sequence[ProbeSpec], device: torch.device | str) -> None:
        if not specs:
            raise ValueError("a ProbeBank needs at least one probe")
        self.specs = list(specs)
        self.columns = columns_of(self.specs)
        self.width = max(c.hi for c in self.columns.values())
        self.layers = tuple(sorted({s.layer for s in self.specs}))
        # Per layer: stacked weight [outputs, hidden] and bias, and the activations of the
        # column groups (softmax needs its group; sigmoid/identity are per column). The
        # [outputs, hidden] layout is what F.linear wants: on CPU it runs a few probes about
        # three times faster than addmm with the transposed weight.
        self._fused: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._groups: list[tuple[str, int, int]] = []
        for layer in self.layers:
            group = [s for s in sorted(self.specs, key=lambda s: s.layer) if s.layer == layer]
            weight = np.concatenate([s.weight for s in group])
            bias = np.concatenate([s.bias for s in group])
            self._fused.append(
                (
                    torch.from_numpy(np.ascontiguousarray(weight)).to(device),
                    torch.from_numpy(bias.copy()).to(device),
                )
            )
            for spec in group:
                cols = self.columns[spec.name]
                self._groups.append((spec.activation, cols.lo, cols.hi))
        self._groups = _merge_sigmoid_runs(self._groups)

    def __call__(self, staged: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [
            torch.nn.functional.linear(staged[i].float(), weight, bias)
            for i, (weight, bias) in enumerate(self._fused)
        ]
        raw = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        for activation, lo, hi in self._groups:
            if activation == "sigmoid":
                torch.sigmoid_(raw[:, lo:hi])
            elif activation == "softmax":
                raw[:, lo:hi] = torch.softmax(raw[:, lo:hi], dim=1)
        return raw.unsqueeze(0)


def _merge_sigmoid_runs(groups: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Adjacent sigmoid columns as one range (one op per step instead of one per probe);
    identity columns need no op at all."""
    merged: list[tuple[str, int, int]] = []
    for activation, lo, hi in groups:
        if activation == "identity":
            continue
        if (
            activation == "sigmoid"
            and merged
            and merged[-1][0] == "sigmoid"
            and merged[-1][2] == lo
        ):
            merged[-1] = ("sigmoid", merged[-1][1], hi)
        else:
            merged.append((activation, lo, hi))
    return merged
