"""The write op (probehook/worker/write_op.py): one op per site applies its terms of
registered kinds in order, each on its own buffers, eager and under ``torch.compile``; a kind
registers with no edit in the op (a test-only ``"scale"`` here: the stream times ``c``, the
toy intervention of issue 50)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from probehook.worker.steer_op import ADD_TENSORS
from probehook.worker.write_op import WRITE_KINDS, read_spec, write, write_kind, write_spec


@pytest.fixture(scope="module", autouse=True)
def scale_kind() -> None:
    """``hidden[t] += (c - 1) * stream[t]`` with ``c = table[index[t]]`` (row 0: 1): the stream
    scaled by each token's ``c``."""

    @write_kind("scale")
    def scale(hidden: torch.Tensor, residual: torch.Tensor | None,
              tensors: Sequence[torch.Tensor], _: str) -> None:  # fmt: skip
        index, table = tensors
        stream = hidden if residual is None else hidden + residual
        c = table.index_select(0, index[: hidden.shape[0]]).unsqueeze(1)
        hidden.add_((c - 1) * stream)

    yield
    del WRITE_KINDS["scale"]


class Layer(nn.Module):
    """A layer returning ``(hidden, residual)`` whose write op applies ``order``."""

    def __init__(self, order: Sequence[str], tokens: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.order = tuple(order)
        self.register_buffer("index", torch.zeros(tokens, dtype=torch.int64), persistent=False)
        self.register_buffer("vectors", torch.zeros(3, width), persistent=False)
        self.register_buffer("scales", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.proj(x), x
        tensors = {"add": [self.index, self.vectors], "scale": [self.index, self.scales]}
        write(hidden, residual, [t for k in self.order for t in tensors[k]],
              write_spec([(k, ADD_TENSORS, "") for k in self.order]))  # fmt: skip
        return hidden + residual


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_terms_apply_in_order_on_the_tokens_that_ask(compiled: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    out = {}
    for order in (("scale", "add"), ("add", "scale")):
        torch.manual_seed(1)  # one projection for both orders
        layer = Layer(order, 16, 8)
        layer.index[1:3] = 1
        layer.index[4] = 2
        layer.vectors[1] = 1.0
        layer.scales[1], layer.scales[2] = 2.0, 0.5
        run = torch.compile(layer, fullgraph=True) if compiled else layer
        with torch.no_grad():
            out[order] = run(x)
            stream = layer.proj(x) + x
    first, second = out[("scale", "add")], out[("add", "scale")]
    torch.testing.assert_close(first[0], stream[0])  # index 0: untouched
    torch.testing.assert_close(first[1:3], 2 * stream[1:3] + 1)
    torch.testing.assert_close(second[1:3], 2 * (stream[1:3] + 1))
    torch.testing.assert_close(first[4], 0.5 * stream[4])  # vectors[2] is zero


def test_the_spec_round_trips_and_an_unknown_kind_is_named() -> None:
    spec = write_spec([("add", 2, ""), ("clamp", 12, "topk|1|none|32")])
    assert read_spec(spec) == [("add", 2, ""), ("clamp", 12, "topk|1|none|32")]
    with pytest.raises(ValueError, match="no ';' or ':'"):
        write_spec([("add", 2, "a;b")])
    with pytest.raises(ValueError, match=r"no write kind 'ablate' is registered .*'add'"):
        write(torch.zeros(2, 4), None, [], write_spec([("ablate", 0, "")]))
