"""The tap op stays in compiled graphs and survives CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from probehook.core.tap_op import tap


class TinyBlock(nn.Module):
    """Returns (hidden, residual) like a vLLM decoder layer and taps their sum."""

    def __init__(self, hidden: int, max_tokens: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("out", torch.zeros(max_tokens, hidden), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.proj(x), x
        tap(hidden, residual, self.out)
        return torch.relu(hidden + residual)


def test_tap_under_torch_compile() -> None:
    torch.manual_seed(0)
    block = TinyBlock(8, 16)
    compiled = torch.compile(block, fullgraph=True)
    for n in (5, 3):
        x = torch.randn(n, 8)
        compiled(x)
        torch.testing.assert_close(block.out[:n], block.proj(x).detach() + x)


@pytest.mark.gpu
def test_tap_under_cuda_graph_replay() -> None:
    torch.manual_seed(0)
    block = TinyBlock(64, 32).cuda()
    compiled = torch.compile(block, fullgraph=True)
    static_x = torch.randn(32, 64, device="cuda")
    for _ in range(2):  # warm up compilation outside the graph
        compiled(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(static_x)
    for _ in range(3):
        new = torch.randn(32, 64, device="cuda")
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(block.out, block.proj(new).detach() + new)
