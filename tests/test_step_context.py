"""The step context (``probehook.worker.step_context``): one step's batch as the banks read it,
built once by the adapter. Its row arithmetic against a hand-built batch, and the banks that
read next tokens taking the rows that wait for sampling from it, on the host: no device sync
(a ``nonzero`` of the tokens, then a copy to the host, each step on a GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from probehook.worker.step_context import StepContext


def context(sampled: torch.Tensor | None = None) -> StepContext:
    """Request a: a 3-token prompt in this step (tokens 1, 2, 3); request b: one decode row
    at position 5 of its 6 known tokens (4..9)."""
    token_ids = np.zeros((2, 16), dtype=np.int64)
    token_ids[0, :3] = [1, 2, 3]
    token_ids[1, :6] = np.arange(4, 10)
    return StepContext(("a", "b"), np.array([0, 3, 4]), np.array([0, 5]), token_ids,
                       np.array([3, 6]), torch.device("cpu"), sampled)  # fmt: skip


def test_rows_map_to_requests_positions_and_next_tokens() -> None:
    before = context()
    rows = np.arange(4)
    assert before.request_of(rows).tolist() == [0, 0, 0, 1]
    assert before.position_of(rows).tolist() == [0, 1, 2, 5]
    # a prompt row's next prompt token; each request's newest row waits for sampling
    assert before.next_tokens(rows).tolist() == [2, 3, -1, -1]
    assert before.unknown(rows).tolist() == [2, 3]
    assert before.unknown(np.array([0, 3])).tolist() == [1]  # positions within the rows given
    after = before.with_sampled(torch.tensor([[7], [9]]))
    assert after.next_tokens(rows).tolist() == [2, 3, 7, 9]
    assert after.unknown(rows).tolist() == []


class _Refuse:
    """Patches ``torch.Tensor.nonzero`` (how a bank asked the device which rows wait) to
    fail while it is on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def __enter__(self) -> None:
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a bank asked the device which rows wait for sampling")

        self.monkeypatch.setattr(torch.Tensor, "nonzero", refuse)
        self.monkeypatch.setattr(torch, "nonzero", refuse)

    def __exit__(self, *exc: Any) -> None:
        self.monkeypatch.undo()


def test_the_generic_bank_holds_the_waiting_rows_from_the_context(monkeypatch) -> None:
    """The toy next-token readout's bank: given the context's ``unknown``, it reads, holds and
    completes exactly as when it asked the device (the fallback without a context)."""
    from toy_readout import NextToken

    from probehook.worker.top_k_bank import TopKBank

    step = context()
    rows = np.arange(4)
    staged = [torch.randn(4, 8)]
    asked = [np.array([0, 2, 3])]
    drawn = step.with_sampled(torch.tensor([[7], [9]]))

    def run(unknown: np.ndarray | None) -> torch.Tensor:
        bank = TopKBank(NextToken(), {"t": {"layer": 0}}, 1)
        out = bank(staged, asked, step.next_tokens(rows), unknown)
        bank.complete(out, lambda at: drawn.next_tokens(rows[at]))
        return out

    with _Refuse(monkeypatch):
        hosted = run(step.unknown(rows))
    asked_device = run(None)
    assert torch.equal(hosted.view(torch.int32), asked_device.view(torch.int32))  # bit-equal
    from probehook.outputs.top_k import TopKRows

    got = TopKRows.unpack(hosted[0], 1)
    assert got.indices[[0, 2, 3], 0].tolist() == [2, 7, 9]  # the drawn tokens filled in


def test_the_lens_bank_holds_the_waiting_rows_from_the_context(monkeypatch) -> None:
    """The lens bank likewise: targets filled by ``complete`` from the context's rows, equal
    to the device-asked path's, with no ``nonzero`` (and no copy of block rows to the host)."""
    from probehook.worker.lens_bank import LensBank

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    instances = {
        f"logit@{layer}": {"layer": layer, "lens": "logit", "kind": "logit", "path": None,
                           "num_layers": 4}
        for layer in (1, 2)
    }  # fmt: skip
    step = context()
    rows = np.arange(4)
    staged = [torch.randn(4, 8), torch.randn(4, 8)]
    asked = [np.array([0, 2, 3]), np.array([1, 3])]
    drawn = step.with_sampled(torch.tensor([[7], [9]]))

    def run(unknown: np.ndarray | None) -> torch.Tensor:
        bank = LensBank(instances, 3, head)
        with torch.no_grad():
            out = bank(staged, asked, step.next_tokens(rows), unknown)
            bank.complete(out, lambda at: drawn.next_tokens(rows[at]))
        return out

    with torch.no_grad():
        run(None)  # the bank's first read sizes its tiles (and calls topk, not nonzero)
    with _Refuse(monkeypatch):
        hosted = run(step.unknown(rows))
    asked_device = run(None)
    for slot, picked in enumerate(asked):
        torch.testing.assert_close(hosted[slot, picked], asked_device[slot, picked])
    assert not torch.isnan(hosted[0, [0, 2, 3], 6]).any()  # every target filled
