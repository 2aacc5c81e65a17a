"""One step's context, as every bank may read it: built once per step by the adapter from
vLLM's batch (``probehook.adapter.worker.runner_v1.step_context``) and handed to the
recorders, so no bank reaches into the runner.

It answers, for the step's flat rows (the tokens the forward pass computed, batch order):
which request and position each row is, the token that came after it (known before sampling
for a prompt row or an older position; drawn by this step's sampling for a request's newest
row) and, on the host, which rows wait for that draw, so a bank never asks the device which
rows those are (a host sync a step on a GPU). The phases: :meth:`StepContext.with_sampled`
is the same step after sampling. What a readout reads beyond its rows lives here too, as the
adapter provides it (``parts``: the attention readout's reader of keys from the paged KV cache),
so a readout that needs it declares it (``reads_step``) and the table hands it over.

No vLLM imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probehook.worker.on_device import on_device


@dataclass(frozen=True)
class StepContext:
    """One step's batch as the banks see it (host arrays are views of vLLM's, read-only)."""

    req_ids: tuple[str, ...]
    """The step's requests, in batch order."""
    query_start: np.ndarray
    """``[len(req_ids) + 1]``: request ``i``'s rows are ``query_start[i]:query_start[i + 1]``."""
    computed: np.ndarray
    """``[len(req_ids)]``: the position of each request's first row in this step."""
    token_ids: np.ndarray
    """``[>= len(req_ids), max_len]``: each request's tokens so far (prompt, then output)."""
    num_tokens: np.ndarray
    """``[len(req_ids)]``: how many of them are known (before this step's sampling)."""
    device: torch.device
    sampled: torch.Tensor | None = None
    """``[len(req_ids), >= 1]``: this step's sampled tokens (None: before sampling, or a step
    that samples nothing)."""
    parts: Mapping[str, Any] = field(default_factory=dict)
    """What else the adapter hands the readouts that read the step (``reads_step``), by name:
    ``"attention"``, the reader of a batch request's keys from a layer's paged cache and of
    the layer's kernel terms (``probehook.adapter.worker.runner_v1.AttentionReader``)."""
    request_terms: Callable[[int, str], Mapping[str, Any] | None] = lambda row, source: None
    """What the request at a batch index asks of a top-k readout's rows beyond its instances
    (``TopKReadout.request_terms``: attention's spans), by the readout's source."""

    def request_of(self, rows: np.ndarray) -> np.ndarray:
        """Each row's request, as its batch index."""
        return np.searchsorted(self.query_start, rows, side="right") - 1

    def position_of(self, rows: np.ndarray) -> np.ndarray:
        """Each row's position in its request's sequence."""
        req = self.request_of(rows)
        return self.computed[req] + (rows - self.query_start[req])

    def _after(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        req = self.request_of(rows)
        after = self.computed[req] + (rows - self.query_start[req]) + 1
        return req, after, after < self.num_tokens[req]

    def unknown(self, rows: np.ndarray) -> np.ndarray:
        """Where in ``rows`` the next token is not known yet: a request's newest position,
        whose token this step's sampling draws (after it: where nothing was sampled). On the
        host: a bank holds those rows without asking the device."""
        _, _, known = self._after(rows)
        if self.sampled is not None:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(~known)

    def next_tokens(self, rows: np.ndarray) -> torch.Tensor:
        """The token after each row, int64 on the device: a token the request already knows
        (a prompt token, or one generated before this step), or, at a request's newest
        position, the one sampled from it (-1 before sampling, or where nothing was sampled)."""
        req, after, known = self._after(rows)
        ids = self.token_ids[req, np.minimum(after, self.token_ids.shape[1] - 1)]
        out = on_device(np.where(known, ids, -1).astype(np.int64), self.device)
        if known.all() or self.sampled is None:
            return out
        drawn = self.sampled[on_device(req, self.device), 0].to(torch.int64)
        return torch.where(out >= 0, out, drawn)

    def with_sampled(self, sampled: torch.Tensor) -> StepContext:
        """The same step after its sampling drew ``sampled``."""
        return dataclasses.replace(self, sampled=sampled)
