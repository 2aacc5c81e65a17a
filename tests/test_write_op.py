"""The write op (probehook/worker/write_op.py): one op per site applies its terms of
registered kinds in order, each on its own buffers, eager and under ``torch.compile``; a kind
registers with no edit in the op (the toy intervention's ``"scale"``, tests/toy_intervention.py:
the stream times ``c``); and the op at a layer's input (``resid_pre``: a forward pre-hook on the
layer's ``hidden_states`` and ``residual`` arguments, as the model surgery installs it)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import toy_intervention  # noqa: F401 - registers the "scale" kind
from torch import nn

from probehook.adapter.worker.surgery import _add_write_term
from probehook.errors import UnsupportedModelError
from probehook.worker.steering_bank import MAX_TERMS
from probehook.worker.write_op import read_spec, write, write_spec


class Layer(nn.Module):
    """A layer returning ``(hidden, residual)`` whose write op applies ``order``."""

    def __init__(self, order: Sequence[str], tokens: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.order = tuple(order)
        self.register_buffer("index", torch.zeros(tokens, dtype=torch.int64), persistent=False)
        # steering: slot 1 adds bank row 1 (ones), slot 2 nothing
        rows = torch.zeros(3, MAX_TERMS, dtype=torch.int64)
        rows[1, 0] = 1
        scalars = torch.zeros(3, MAX_TERMS, 6)
        scalars[1, 0, 0] = 1.0
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("scalars", scalars, persistent=False)
        self.register_buffer("units", torch.zeros(2, width), persistent=False)
        self.register_buffer("vectors", torch.zeros(2, width), persistent=False)
        self.register_buffer("scales", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.proj(x), x
        tensors = {
            "steer": [self.index, self.rows, self.scalars, self.units, self.vectors],
            "scale": [self.index, self.scales],
        }
        write(hidden, residual, [t for k in self.order for t in tensors[k]],
              write_spec([(k, len(tensors[k]), "") for k in self.order]))  # fmt: skip
        return hidden + residual


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_terms_apply_in_order_on_the_tokens_that_ask(compiled: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    out = {}
    for order in (("scale", "steer"), ("steer", "scale")):
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
    first, second = out[("scale", "steer")], out[("steer", "scale")]
    torch.testing.assert_close(first[0], stream[0])  # index 0: untouched
    torch.testing.assert_close(first[1:3], 2 * stream[1:3] + 1)
    torch.testing.assert_close(second[1:3], 2 * (stream[1:3] + 1))
    torch.testing.assert_close(first[4], 0.5 * stream[4])  # vectors[2] is zero


def test_the_spec_round_trips_and_an_unknown_kind_is_named() -> None:
    spec = write_spec([("add", 2, ""), ("clamp", 12, "topk|1|none|32")])
    assert read_spec(spec) == [("add", 2, ""), ("clamp", 12, "topk|1|none|32")]
    with pytest.raises(ValueError, match="no ';' or ':'"):
        write_spec([("add", 2, "a;b")])
    with pytest.raises(ValueError, match=r"no write kind 'nosuch' is registered .*'steer'"):
        write(torch.zeros(2, 4), None, [], write_spec([("nosuch", 0, "")]))


class VllmLayer(nn.Module):
    """A vLLM-style decoder layer: ``(positions, hidden_states, residual)`` in, the residual
    add deferred (``residual`` None on layer 0, whose input is the embeddings)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden_states if residual is None else hidden_states + residual
        return self.proj(stream), stream


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keywords", [False, True], ids=["positional", "keywords"])
def test_a_term_at_the_layer_input_scales_the_stream_it_reads(compiled, keywords) -> None:
    torch.manual_seed(0)
    layer = VllmLayer(8)
    layer.register_buffer("w_index", torch.zeros(16, dtype=torch.int64), persistent=False)
    layer.register_buffer("w_factors", torch.tensor([1.0, 3.0]), persistent=False)
    _add_write_term(layer, "scale", ("w_index", "w_factors"), site="resid_pre")
    layer.w_index[1:3] = 1
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    positions = torch.arange(5)
    for residual in (None, torch.randn(5, 8)):  # layer 0, a later layer
        hidden = torch.randn(5, 8)
        stream = hidden if residual is None else hidden + residual
        want = stream.clone()
        want[1:3] *= 3
        with torch.no_grad():
            if keywords:
                out, seen = run(
                    positions=positions, hidden_states=hidden.clone(), residual=residual
                )
            else:
                out, seen = run(positions, hidden.clone(), residual)
        torch.testing.assert_close(seen, want)
        torch.testing.assert_close(out, layer.proj(want))


def test_a_layer_without_hidden_states_is_refused_by_name() -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(UnsupportedModelError, match=r"Odd.forward\('x',\) takes no hidden_states"):
        _add_write_term(Odd(), "scale", (), site="resid_pre")
