"""SAEs inside the worker: the top-k features of every kept row, on the device.

The loader reads each SAE's folder once, at model load (inside vLLM's memory profiling, so the
KV cache is sized around the weights), onto the model's device. A step's kept rows of the SAE
layers come in as a recorder's staged rows; :class:`SAEBank` runs one encoder GEMM per SAE
(tiled over rows), the architecture's epilogue and the top-k, and only ``[rows, 2k + 1]``
float32 per SAE (indices, values, l0: :func:`probehook.saes.encode.read_top_k`) leaves the
device. A step in which no request asked for SAE features gathers no rows, so it does no SAE
work at all (the recorder skips it).

No vLLM imports: the loader builds the bank through the readout's ``worker_bank``
(:func:`sae_bank`), from the instances' settings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from probehook.outputs.top_k import pad_top_k
from probehook.saes.encode import SAEWeights, read_top_k
from probehook.worker.top_k_bank import read_selected


class SAEBank:
    """The SAEs of one worker, callable on a recorder's staged rows (``[rows, hidden]`` of
    each bank layer, in :attr:`layers` order): returns ``[len(slots), rows, 2k + 1]``."""

    dtype = torch.float32

    def __init__(
        self,
        saes: Mapping[str, tuple[int, SAEWeights]],
        k: int,
        decoders: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]] | None = None,
    ) -> None:
        if not saes:
            raise ValueError("an SAEBank needs at least one SAE")
        self.slots = tuple(saes)
        """The SAE names, in the order of the output's first dimension."""
        self.k = int(k)
        self.width = 2 * self.k + 1
        self.layers = tuple(sorted({layer for layer, _ in saes.values()}))
        self._saes = [(self.layers.index(layer), weights) for layer, weights in saes.values()]
        self._decoders = dict(decoders or {})

    def weights_of(self, name: str) -> SAEWeights:
        return self._saes[self.slots.index(name)][1]

    def decoder_of(self, name: str) -> torch.Tensor:
        """An SAE's decoder rows (a clamp term writes with them), read from its folder the
        first time a clamp asks (a bank without clamps never holds them)."""
        decoder = self._decoders[name]
        if callable(decoder):
            decoder = self._decoders[name] = decoder()
        return decoder

    selective = True
    """The recorder hands it each SAE's rows (``slot_rows``): an SAE runs only on the rows of
    the requests that asked for it."""

    def __call__(
        self,
        staged: torch.Tensor | Sequence[torch.Tensor],
        slot_rows: Sequence[np.ndarray] | None = None,
    ) -> torch.Tensor:
        """``slot_rows``: each SAE's rows (positions in ``staged``); the other rows of its
        output are padding (no feature: -1, 0, l0 0), which no request reads. None: every SAE
        on every row."""
        rows = staged[0].shape[0]
        device = staged[0].device
        out = torch.empty((len(self._saes), rows, self.width), dtype=self.dtype, device=device)
        for slot, (layer_slot, weights) in enumerate(self._saes):
            asked = None if slot_rows is None else slot_rows[slot]
            if asked is None or len(asked) == rows:  # written in place: no copy
                read_top_k(weights, staged[layer_slot], self.k, out[slot])
                continue
            read = functools.partial(read_top_k, weights, k=self.k)
            pad = functools.partial(pad_top_k, k=self.k)
            read_selected(out[slot], pad, staged[layer_slot], asked, read)
        return out


def sae_bank(
    readout: Any, instances: Mapping[str, Mapping[str, Any]], k: int, model: Any
) -> SAEBank:
    """``SAEReadout.worker_bank``: each SAE read from its folder (``instances[name]["path"]``)
    onto the model's device (``model.device``), its encoder in the instance's ``dtype`` (None:
    its own); an SAE's decoder rows are read when a clamp asks for them (``decoder_of``)."""
    from probehook.saes import SAE

    saes = {}
    decoders = {}
    for name, settings in instances.items():
        sae = SAE.load(settings["path"], layer=int(settings["layer"]))
        dtype = settings.get("dtype")
        weights = sae.weights.to(model.device, getattr(torch, dtype) if dtype else None)
        saes[name] = (sae.layer, weights)
        decoders[name] = functools.partial(_decoder, settings, model.device)
    return SAEBank(saes, int(k), decoders)


def _decoder(settings: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    from probehook.saes import SAE

    sae = SAE.load(settings["path"], layer=int(settings["layer"]))
    assert sae.W_dec is not None
    return sae.W_dec.to(device)
