"""The tap op stays in compiled graphs and survives CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from probehook.worker.tap_op import tap


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


def test_tap_names_a_shape_it_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"\[tokens, hidden\] rows, got hidden \(1, 3, 8\)"):
        tap(torch.zeros(1, 3, 8), None, torch.zeros(16, 8))


class HFStyleLayer(nn.Module):
    """Like an HF decoder layer on vLLM's Transformers backend: [1, tokens, hidden] in, the
    finished stream out (alone, or first in a tuple)."""

    def __init__(self, hidden: int, as_tuple: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.as_tuple = as_tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        stream = x + self.proj(x)
        return (stream, None) if self.as_tuple else stream


@pytest.mark.parametrize("as_tuple", [False, True])
def test_batched_stream_tap_traces_into_compiled_graph(as_tuple: bool) -> None:
    from probehook.adapter.worker.surgery import TAP_KIND_ATTR, _tap_hook

    torch.manual_seed(0)
    layer = HFStyleLayer(8, as_tuple)
    layer.register_buffer("probehook_tap_out", torch.zeros(16, 8), persistent=False)
    setattr(layer, TAP_KIND_ATTR, "batched_stream")
    layer.register_forward_hook(_tap_hook)
    # fullgraph: a graph break (or an error) in the hook's flatten fails here
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for n in (5, 3, 7):
        x = torch.randn(1, n, 8)
        compiled(x)
        want = (x + layer.proj(x)).detach()[0]
        torch.testing.assert_close(layer.probehook_tap_out[:n], want)


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
