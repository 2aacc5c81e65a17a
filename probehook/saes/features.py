"""What a request returns of one SAE: the top-k features of each token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SAEFeatures:
    """The ``k`` strongest features of each of ``n`` tokens, from one SAE.

    - ``indices``: int64 ``[n, k]``, descending by activation (|activation| for abstopk),
      ties toward the lower index, padded with -1 where fewer than ``k`` are non-zero;
    - ``values``: float32 ``[n, k]``, padded with 0; only non-zero activations appear;
    - ``l0``: int64 ``[n]``, the non-zero features of each token before the top-k cut.
    """

    indices: torch.Tensor
    values: torch.Tensor
    l0: torch.Tensor

    def __len__(self) -> int:
        return int(self.l0.shape[0])

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])

    def __getitem__(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``token``'s features, padding left out: ``(indices, values)``."""
        on = self.indices[token] >= 0
        return self.indices[token][on], self.values[token][on]

    def dense(self, d_sae: int) -> torch.Tensor:
        """``[n, d_sae]`` float32 with the kept activations in place (zeros elsewhere: what
        the cut dropped is not recovered)."""
        out = torch.zeros((len(self), d_sae), dtype=torch.float32)
        on = self.indices >= 0
        rows = torch.arange(len(self)).unsqueeze(1).expand_as(self.indices)
        out[rows[on], self.indices[on]] = self.values[on]
        return out

    def activation(self, feature: int) -> torch.Tensor:
        """``[n]`` float32: ``feature``'s activation on each token (0 where it is not among
        the kept ``k``)."""
        return torch.where(self.indices == feature, self.values, 0.0).sum(dim=1)

    def top(self, k: int) -> SAEFeatures:
        """The first ``k`` features of each token (the readout is sorted, so this is the top
        ``k``); ``l0`` is unchanged."""
        return SAEFeatures(self.indices[:, :k], self.values[:, :k], self.l0)

    @classmethod
    def unpack(cls, packed: torch.Tensor, k: int) -> SAEFeatures:
        """From the worker's packed float32 rows ``[n, 2K + 1]`` (K the engine's k >= ``k``)."""
        engine_k = (packed.shape[1] - 1) // 2
        return cls(
            packed[:, :k].to(torch.int64),
            packed[:, engine_k : engine_k + k].clone(),
            packed[:, 2 * engine_k].to(torch.int64),
        )

    @classmethod
    def empty(cls, k: int) -> SAEFeatures:
        return cls(
            torch.empty((0, k), dtype=torch.int64),
            torch.empty((0, k), dtype=torch.float32),
            torch.empty(0, dtype=torch.int64),
        )

    @classmethod
    def cat(cls, pieces: Sequence[SAEFeatures]) -> SAEFeatures:
        if len(pieces) == 1:
            return pieces[0]
        return cls(
            torch.cat([p.indices for p in pieces]),
            torch.cat([p.values for p in pieces]),
            torch.cat([p.l0 for p in pieces]),
        )

    def to_dict(self) -> dict[str, list]:
        """JSON-ready lists (the server's form)."""
        return {
            "indices": self.indices.tolist(),
            "values": self.values.tolist(),
            "l0": self.l0.tolist(),
        }

    def __repr__(self) -> str:
        return f"SAEFeatures(tokens={len(self)}, k={self.k})"
