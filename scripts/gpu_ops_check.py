"""Check probehook's worker ops on a GPU: eager, ``torch.compile`` and CUDA-graph replay agree,
and what each op costs next to one ``[tokens, d_model] @ [d_model, d_model]`` matmul.

The ops: the tap (``probehook::tap``), the write op's steering term (``probehook::write``
``add``), the SAE bank's encode and top-k readout (:class:`probehook.worker.sae_bank.SAEBank`,
i.e. :func:`probehook.saes.encode.read_top_k`) and the write op's clamp term
(``probehook::write`` ``clamp``, its tables written by
:class:`probehook.worker.write_table.StepWrites` from a
:class:`probehook.worker.clamp_op.ClampWriter`), and the lens bank's read (the logit lens
through a stand-in head, eager only: the worker runs it after the forward, never compiled). The
hook ops run from forward hooks on a stand-in decoder layer, as
``probehook/adapter/worker/loader.py`` installs them (mirrored here: the loader belongs to the
vLLM adapter). Each op runs eager, compiled, and as a CUDA graph of the compiled module
replayed with new values in its static inputs and buffers before every replay; each result is
compared to eager on the same values.

Needs only torch and ``probehook.worker`` (no vLLM; checked at the end). From the repo root:

    python3 scripts/gpu_ops_check.py [--out ops.md]
    python3 scripts/gpu_ops_check.py --cpu-smoke   # no GPU: tiny shapes, eager vs compiled

Exit status: 0 every check passed, 1 one failed, 2 no CUDA (and no ``--cpu-smoke``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Run from a checkout without installing probehook (the GPU machine has no vLLM to install it
# with its extras).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probehook.adapter.worker.surgery import STEER_BUFFERS  # noqa: E402
from probehook.core.steering_wire import VectorRows  # noqa: E402
from probehook.saes.clamp import MAX_CLAMPED  # noqa: E402
from probehook.saes.encode import (  # noqa: E402
    ARCHITECTURES,
    TILE_ROWS,
    SAEWeights,
    activations_per_token,
    read_top_k,
)
from probehook.worker.attention_bank import AttentionBank  # noqa: E402
from probehook.worker.attention_rows import AttentionTerms, head_readings  # noqa: E402
from probehook.worker.clamp_op import CLAMP_TENSORS, ClampWriter  # noqa: E402
from probehook.worker.lens_bank import LensBank  # noqa: E402
from probehook.worker.paged_keys import key_slots, read_keys  # noqa: E402
from probehook.worker.patch_op import PATCH_TENSORS, keep  # noqa: E402
from probehook.worker.sae_bank import SAEBank  # noqa: E402
from probehook.worker.steer_op import STEER_TENSORS  # noqa: E402
from probehook.worker.steering_bank import SteeringBank, SteerTable, bank_tensors  # noqa: E402
from probehook.worker.tap_op import tap  # noqa: E402
from probehook.worker.write_op import write, write_spec  # noqa: E402
from probehook.worker.write_table import StepWrites  # noqa: E402

SMOKE_SHAPES = {"d_model": 64, "tokens": 16, "d_sae": 256, "k": 4}
STEPS = (1, 2, 3)
"""Seeds of the steps each op runs: the graph is captured on the first and replayed on the
others and then the first again, so every replay reads values written after capture."""
MAX_NUM_SEQS = 16
"""Requests a step holds: the steering and clamp tables have one row more (row 0: nobody)."""
TOLERANCES = {
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (2**-7, 1e-5),
    torch.float16: (2**-10, 1e-5),
}
"""(rtol, atol) by result dtype. float32: torch.testing's defaults. bfloat16 and float16: one
unit in the last place, since the ops compute in float32 and a float32 rounding difference may
still flip the last bit of the half-precision result."""


@dataclass
class Shapes:
    d_model: int
    tokens: int
    d_sae: int
    k: int
    dtype: torch.dtype
    device: torch.device

    @property
    def max_tokens(self) -> int:
        # The buffers are sized for a bigger step (vLLM's max_num_batched_tokens), so the ops'
        # slicing to the step's tokens is exercised.
        return 2 * self.tokens


# --- the stand-in model: a layer with the loader's hooks ------------------------------------


class Layer(nn.Module):
    """Stands in for a vLLM decoder layer: returns ``(hidden, residual)`` with the residual add
    deferred. ``hidden`` is computed (times ones, exact), not an input, because in vLLM the ops
    mutate a tensor made inside the compiled graph."""

    def __init__(self, shapes: Shapes) -> None:
        super().__init__()
        self.register_buffer(
            "gain", torch.ones(shapes.d_model, dtype=shapes.dtype, device=shapes.device)
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.gain, residual


class Block(nn.Module):
    """The layer, returning its ``hidden`` after the hooks (what the ops changed) and what
    the next layer reads (its fused add + norm takes the sum)."""

    def __init__(self, layer: Layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.layer(x, residual)
        return hidden, hidden + residual


# The loader's hooks (_tap_hook, and _write_hook with one term) for a layer returning
# (hidden, residual): the op is called on the layer's output, its buffers are the layer's.


def _tap_hook(module: nn.Module, args: Any, output: Any) -> None:
    hidden, residual = output
    tap(hidden, residual, module.probehook_tap_out)


def _steer_hook(module: nn.Module, args: Any, output: Any) -> None:
    hidden, residual = output
    tensors = [getattr(module, name) for name in STEER_BUFFERS]
    write(hidden, residual, tensors, write_spec([("steer", STEER_TENSORS, "")]))


def _clamp_hook(names: list[str], spec: str) -> Callable[[nn.Module, Any, Any], None]:
    # The writer's index and buffers are the layer's, as the loader's install_writes makes them.
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        hidden, residual = output
        tensors = [getattr(module, name) for name in names]
        write(hidden, residual, tensors, write_spec([("clamp", CLAMP_TENSORS, spec)]))

    return hook


class Readout(nn.Module):
    """The SAE bank on one layer's staged rows."""

    def __init__(self, bank: SAEBank) -> None:
        super().__init__()
        self.bank = bank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bank([x])


# --- the cases ----------------------------------------------------------------------------


@dataclass
class Case:
    """One op: a module over static inputs, and how to write a step's values into them."""

    name: str
    shape: str
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    write: Callable[[int], None]
    """Writes step ``seed``'s values into the static inputs and buffers, in place (as the
    worker does before each forward pass), deterministically."""
    results: Callable[[Any], dict[str, torch.Tensor]]
    """What to compare, given the module's output."""
    poison: Callable[[], None] = lambda: None
    """Fills outputs kept in buffers with NaN, so an op that writes nothing cannot pass."""
    compare: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], str], float] = field(
        default_factory=lambda: compare_close
    )
    dynamic_tokens: bool = True
    """Compile with a dynamic token count, as vLLM compiles its model."""
    compiled: bool = True
    """Whether vLLM runs it in its compiled graph (the hook ops) or eagerly in the recorder
    window (the lens bank: host logic between its kernels): eager-only cases are timed and
    verified eager, with the host-sync check, and never compiled or captured."""
    verify: Callable[[dict[str, torch.Tensor]], None] | None = None
    """Checks eager results against plain torch on the step's values (raises AssertionError),
    so that eager itself is right and the step exercised the op (some tokens steered, some
    not)."""


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape: Sequence[int], seed: int, shapes: Shapes, dtype: torch.dtype) -> torch.Tensor:
    g = _generator(seed, shapes.device)
    return torch.randn(*shape, generator=g, device=shapes.device).to(dtype)


def _rows(shapes: Shapes) -> torch.Tensor:
    """A static input: one step's ``[tokens, d_model]`` rows."""
    return torch.empty(shapes.tokens, shapes.d_model, dtype=shapes.dtype, device=shapes.device)


def _hidden_inputs(shapes: Shapes) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(shapes), _rows(shapes)


def _write_hidden(x: torch.Tensor, residual: torch.Tensor, seed: int, shapes: Shapes) -> None:
    x.copy_(_randn(x.shape, 1000 * seed + 1, shapes, x.dtype))
    residual.copy_(_randn(residual.shape, 1000 * seed + 2, shapes, residual.dtype))


def _requests(seed: int, tokens: int) -> list[int]:
    """A step's query offsets: up to MAX_NUM_SEQS requests of random lengths (chunked prefill
    and decode alike are runs of tokens)."""
    g = torch.Generator().manual_seed(seed)
    n = min(MAX_NUM_SEQS, tokens, max(3, tokens // 4))
    cuts = torch.randperm(tokens - 1, generator=g)[: n - 1] + 1
    return [0, *sorted(int(c) for c in cuts), tokens]


def _layer_results(output: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"hidden": output[0], "stream": output[1]}


def layer_only_case(shapes: Shapes) -> Case:
    """The stand-in layer with no op: what the hook cases' timings include besides the op."""
    x, residual = _hidden_inputs(shapes)
    return Case(
        "layer only (no op)",
        f"[{shapes.tokens}, {shapes.d_model}]",
        Block(Layer(shapes)),
        (x, residual),
        lambda seed: _write_hidden(x, residual, seed, shapes),
        _layer_results,
    )


def tap_case(shapes: Shapes) -> Case:
    x, residual = _hidden_inputs(shapes)
    layer = Layer(shapes)
    out = torch.zeros(shapes.max_tokens, shapes.d_model, dtype=shapes.dtype, device=shapes.device)
    layer.register_buffer("probehook_tap_out", out, persistent=False)
    layer.register_forward_hook(_tap_hook)

    def verify(results: dict[str, torch.Tensor]) -> None:
        want = torch.full_like(out, math.nan)
        want[: shapes.tokens] = x + residual
        compare_close({"tap_out": want}, results, "plain torch")

    return Case(
        "probehook::tap",
        f"[{shapes.tokens}, {shapes.d_model}] -> [{shapes.max_tokens}, {shapes.d_model}]",
        Block(layer),
        (x, residual),
        lambda seed: _write_hidden(x, residual, seed, shapes),
        # The whole buffer: the rows past the step's tokens must stay as they were (NaN).
        lambda output: {**_layer_results(output), "tap_out": layer.probehook_tap_out},
        poison=lambda: layer.probehook_tap_out.fill_(math.nan),
        verify=verify,
    )


STEER_OPS = ("add", "ablate", "cap", "orthogonal", "norm_scaled", "swap")


def steer_case(shapes: Shapes) -> Case:
    """Steering's ops (issue 52): 16 distinct vectors of every op in the bank, each steered
    request one to three of them in its own order (runs of additions summed), every third
    request unsteered; checked against each term's formula in float64, in order."""
    x, residual = _hidden_inputs(shapes)
    layer = Layer(shapes)
    slots, capacity = MAX_NUM_SEQS + 1, 16
    table = SteerTable.allocate(slots, shapes.device)
    units, writes = bank_tensors(capacity, slots, shapes.d_model, shapes.device)
    bank = SteeringBank([0], shapes.d_model, capacity, shapes.device, slots,
                        tensors={0: (units, writes)})  # fmt: skip
    index = torch.zeros(shapes.max_tokens, dtype=torch.int64, device=shapes.device)
    for name, tensor in zip(STEER_BUFFERS, (index, table.rows, table.scalars, units, writes),
                            strict=True):  # fmt: skip
        layer.register_buffer(name, tensor, persistent=False)
    layer.register_forward_hook(_steer_hook, prepend=True)
    g = torch.Generator().manual_seed(5)
    for v in range(capacity):
        op = STEER_OPS[v % len(STEER_OPS)]
        u = torch.nn.functional.normalize(torch.randn(shapes.d_model, generator=g), dim=0)
        w = torch.randn(shapes.d_model, generator=g) if op in ("add", "swap") else u
        params = {"min": -0.5, "max": 0.5} if op == "cap" else {}
        bank.add(f"v{v}", VectorRows({0: w.numpy()}, None if op == "add" else {0: u.numpy()},
                                     op, params))  # fmt: skip

    def write(seed: int) -> None:
        _write_hidden(x, residual, seed, shapes)
        starts = _requests(seed, shapes.tokens)
        g = torch.Generator().manual_seed(seed)
        host = torch.randint(0, slots, (shapes.max_tokens,), generator=g)  # past the step: junk
        for position, (lo, hi) in enumerate(zip(starts, starts[1:], strict=False)):
            # Every third request unsteered, which one by the step: both kinds in each step.
            host[lo:hi] = 0 if (position + seed) % 3 == 0 else position + 1
            picks = torch.randint(0, capacity, (1 + (position + seed) % 3,), generator=g)
            terms = [(f"v{int(v)}", float(torch.rand((), generator=g)) * 2 - 0.5) for v in picks]
            bank.write(table, position + 1, 0, terms)
        index.copy_(host)

    def verify(results: dict[str, torch.Tensor]) -> None:
        rows = index[: shapes.tokens]
        assert (rows > 0).any() and (rows == 0).any(), "a step needs steered and unsteered tokens"
        hidden = x.clone()
        for term in range(table.rows.shape[1]):  # each term's formula, in order, in float64
            h = hidden.double() + residual.double()  # the op adds each term in the model dtype
            at = table.rows[rows, term]
            a, b, c, d, lo, hi = table.scalars[rows, term].double().unbind(-1)
            u, w = units[at].double(), writes[at].double()
            along = (h * u).sum(-1)
            capped = torch.minimum(torch.maximum(along, lo), hi)
            coef = a + b * along + c * capped + d * h.norm(dim=-1)
            hidden = hidden + (coef[:, None] * w).to(x.dtype)
        # The op's float32 coefficients may round a term's half-precision delta the other way:
        # one unit in the last place of the row's largest value, which an ablation's
        # cancellation leaves on a small result (a relative tolerance alone fails there).
        rtol, _ = TOLERANCES[x.dtype]
        scale = (x.float().abs() + residual.float().abs()).amax(dim=1, keepdim=True)
        for name, want in (("hidden", hidden), ("stream", hidden + residual)):
            error = (results[name].float() - want.float()).abs()
            bound = 4 * rtol * scale + 1e-5
            assert bool((error <= bound).all()), (
                f"float64 formula, {name}: max error {float(error.max()):.3g} over "
                f"{int((error > bound).sum())} elements (bound: 4 units in the last place of "
                "the row's largest value)"
            )

    return Case(
        "probehook::write steer (16 ops)",
        f"[{shapes.tokens}, {shapes.d_model}], <= 3 of {capacity} vectors a request",
        Block(layer),
        (x, residual),
        write,
        _layer_results,
        verify=verify,
    )


def _patch_hook(module: nn.Module, args: Any, output: Any) -> None:
    hidden, residual = output
    tensors = [module.patch_index, module.patch_alphas, module.patch_adds, module.patch_source]
    write(hidden, residual, tensors, write_spec([("patch", PATCH_TENSORS, "")]))
    keep(hidden, residual, module.keep_index, module.patch_source)


def patch_case(shapes: Shapes) -> Case:
    """Activation patching (issue 52), every buffer per token: one token of a request lerped
    toward a kept row of the source bank (its own alpha), a request's tokens given a noise row
    each and one of them lerped too (corruption by noise, then a cell), a request's tokens kept
    into the bank, one request untouched, all in one step; checked against plain torch."""
    x, residual = _hidden_inputs(shapes)
    layer = Layer(shapes)
    bank_rows = 4 * shapes.tokens
    source = torch.zeros(bank_rows + 1, shapes.d_model, dtype=torch.float32, device=shapes.device)
    index, adds, keep_index = (
        torch.zeros(shapes.max_tokens, dtype=torch.int64, device=shapes.device) for _ in range(3)
    )
    alphas = torch.zeros(shapes.max_tokens, dtype=torch.float32, device=shapes.device)
    for name, tensor in (("patch_index", index), ("patch_alphas", alphas), ("patch_adds", adds),
                         ("patch_source", source), ("keep_index", keep_index)):  # fmt: skip
        layer.register_buffer(name, tensor, persistent=False)
    layer.register_forward_hook(_patch_hook, prepend=True)
    before = source.clone()

    def write(seed: int) -> None:
        _write_hidden(x, residual, seed, shapes)
        g = torch.Generator().manual_seed(seed)
        source.copy_(_randn(source.shape, 1000 * seed + 5, shapes, torch.float32))
        source[0] = 0
        before.copy_(source)
        starts = _requests(seed, shapes.tokens)
        host = {name: torch.zeros(shapes.max_tokens, dtype=torch.int64) for name in ("i", "a", "k")}
        host_alpha = torch.zeros(shapes.max_tokens)
        for position, (lo, hi) in enumerate(zip(starts, starts[1:], strict=False)):
            kind = (position + seed) % 4  # patched, noised and patched, kept, untouched
            if kind in (0, 1):
                t = lo + int(torch.randint(0, hi - lo, (), generator=g))
                host["i"][t] = int(torch.randint(1, bank_rows + 1, (), generator=g))
                host_alpha[t] = float(torch.rand((), generator=g))
            if kind == 1:
                host["a"][lo:hi] = torch.randint(1, bank_rows + 1, (hi - lo,), generator=g)
            elif kind == 2:
                host["k"][lo:hi] = torch.arange(1 + 2 * lo, 1 + 2 * hi, 2)  # distinct rows
        index.copy_(host["i"])
        adds.copy_(host["a"])
        keep_index.copy_(host["k"])
        alphas.copy_(host_alpha)

    def verify(results: dict[str, torch.Tensor]) -> None:
        tokens = shapes.tokens
        at, noised = index[:tokens], adds[:tokens]
        assert (at > 0).any() and (noised > 0).any() and (keep_index[:tokens] > 0).any(), (
            "a step patches, adds and keeps"
        )
        stream = x.float() + residual.float()
        noise = torch.where((noised > 0).unsqueeze(1), before[noised], 0.0)
        lerp = alphas[:tokens].unsqueeze(1) * (before[at] - (stream + noise))
        delta = (noise + torch.where((at > 0).unsqueeze(1), lerp, 0.0)).to(x.dtype)  # as the op
        hidden = torch.where(((at > 0) | (noised > 0)).unsqueeze(1), x + delta, x)
        kept = before.clone()
        where = keep_index[:tokens] > 0
        kept[keep_index[:tokens][where]] = (hidden.float() + residual.float())[where]
        compare_close({"hidden": hidden, "stream": hidden + residual, "bank": kept[1:]}, results,
                      "plain torch")  # fmt: skip

    return Case(
        "probehook::write patch + probehook::keep",
        f"[{shapes.tokens}, {shapes.d_model}], bank [{bank_rows + 1}, {shapes.d_model}]",
        Block(layer),
        (x, residual),
        write,
        # the bank read after the run (a module output of it may alias the bank itself, and
        # the graph check poisons outputs); row 0 is the scratch row
        lambda output: {"hidden": output[0], "stream": output[1], "bank": source[1:].clone()},
        verify=verify,
    )


def random_sae(arch: str, shapes: Shapes, seed: int) -> tuple[SAEWeights, torch.Tensor]:
    """Random SAE weights of ``arch`` (the encoder in the model dtype, the rest float32, as the
    loader's ``weights.to(device, dtype)``) and float32 decoder rows. Biases and thresholds are
    set so that a few percent of the features fire on unit-normal rows."""
    d, n = shapes.d_model, shapes.d_sae

    def randn(*shape: int, salt: int, scale: float = 1.0) -> torch.Tensor:
        return _randn(shape, 10_000 * seed + salt, shapes, torch.float32) * scale

    W_enc = randn(d, n, salt=1, scale=d**-0.5)
    W_dec = randn(n, d, salt=2, scale=d**-0.5)
    gated = arch == "gated"
    weights = SAEWeights(
        arch,
        W_enc,
        None if gated else randn(n, salt=3, scale=0.1) - (0.0 if arch == "jumprelu" else 1.5),
        randn(d, salt=4, scale=0.1),
        True,
        "none",
        threshold=(
            torch.rand(n, generator=_generator(seed, shapes.device), device=shapes.device) + 1.0
        )
        if arch == "jumprelu"
        else None,
        b_gate=randn(n, salt=5, scale=0.1) - 1.5 if gated else None,
        b_mag=randn(n, salt=6, scale=0.1) if gated else None,
        r_mag_exp=randn(n, salt=7, scale=0.1).exp() if gated else None,
        k=2 * shapes.k if arch in ("topk", "abstopk") else None,
    )
    return weights.to(shapes.device, shapes.dtype), W_dec


def sae_case(shapes: Shapes, arch: str) -> Case:
    weights, _ = random_sae(arch, shapes, seed=11)
    bank = SAEBank({"sae": (0, weights)}, shapes.k)
    x = _rows(shapes)
    k = shapes.k
    return Case(
        f"SAEBank read_top_k ({arch})",
        f"[{shapes.tokens}, {shapes.d_model}] x [{shapes.d_model}, {shapes.d_sae}], k {k}",
        Readout(bank),
        (x,),
        lambda seed: x.copy_(_randn(x.shape, 1000 * seed + 4, shapes, x.dtype)),
        lambda output: {"readout": output[0]},
        compare=lambda ref, got, label: compare_readout(ref, got, label, k),
        # The bank is not in vLLM's compiled model; its tile loop unrolls over a fixed count.
        dynamic_tokens=False,
    )


class LensRead(nn.Module):
    """The lens bank on one layer's staged rows and their next tokens (none drawn this step:
    the step context's host list of waiting rows is empty)."""

    def __init__(self, bank: LensBank) -> None:
        super().__init__()
        self.bank = bank

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import numpy as np

        return self.bank([x], next_tokens=targets, unknown=np.empty(0, dtype=np.int64))


def lens_case(shapes: Shapes) -> Case:
    """The logit lens (the model's head: here a ``[vocab, d_model]`` matmul, ``vocab`` the
    ``--d-sae`` width) on a step's rows, eagerly, as the worker reads it after the forward."""
    vocab, k = shapes.d_sae, shapes.k
    weight = _randn((vocab, shapes.d_model), 21, shapes, shapes.dtype) / shapes.d_model**0.5
    bank = LensBank({"logit@0": {"layer": 0, "kind": "logit"}}, k, lambda rows: rows @ weight.T)
    bank.to(shapes.device)
    x = _rows(shapes)
    targets = torch.empty(shapes.tokens, dtype=torch.int64, device=shapes.device)

    def write(seed: int) -> None:
        x.copy_(_randn(x.shape, 1000 * seed + 5, shapes, x.dtype))
        g = _generator(1000 * seed + 6, shapes.device)
        targets.copy_(torch.randint(0, vocab, targets.shape, generator=g, device=shapes.device))
        targets[::3] = -1  # rows whose next token is not known: NaN targets

    def verify(results: dict[str, torch.Tensor]) -> None:
        packed = results["readout"]
        logits = (x @ weight.T).float()
        lse = torch.logsumexp(logits, dim=1, keepdim=True)
        ids = packed[:, :k].contiguous().view(torch.int32).long()
        rtol, atol = TOLERANCES[torch.float32]
        want = logits.topk(k, dim=1).values - lse  # ids may swap among tied values
        torch.testing.assert_close(packed[:, k : 2 * k], want, rtol=rtol, atol=1e-4)
        torch.testing.assert_close(packed[:, k : 2 * k], logits.gather(1, ids) - lse,
                                   rtol=rtol, atol=1e-4)  # fmt: skip
        known = targets >= 0
        target = (logits.gather(1, targets.clamp(min=0).unsqueeze(1)) - lse).squeeze(1)
        torch.testing.assert_close(packed[known, 2 * k], target[known], rtol=rtol, atol=1e-4)
        assert bool(packed[~known, 2 * k].isnan().all()), "unknown targets are not NaN"

    return Case(
        "LensBank read (logit lens, eager)",
        f"[{shapes.tokens}, {shapes.d_model}] x [{shapes.d_model}, {vocab}], k {k}",
        LensRead(bank),
        (x, targets),
        write,
        lambda output: {"readout": output[0]},
        compiled=False,
        verify=verify,
    )


class PagedKeys:
    """Stands in for the adapter's attention reader: requests' keys read from a paged cache in
    FlashAttention's layout (``token_major``) through their block table rows, as the worker's
    reader does after the forward pass."""

    def __init__(self, cache: torch.Tensor, table: torch.Tensor, terms: AttentionTerms) -> None:
        self.cache, self.table, self._terms = cache, table, terms

    def keys(self, layer: int, batch_row: Any, positions: torch.Tensor) -> torch.Tensor:
        if isinstance(batch_row, int):  # one request: its row (a 0-dim tensor index would sync)
            row = self.table[batch_row]
        else:  # a list of requests' rows, copied without a sync as the worker does
            row = self.table[torch.as_tensor(batch_row).to(self.table.device, non_blocking=True)]
        blocks, offsets = key_slots(row, positions, self.cache.shape[2], self.cache.shape[2])
        return read_keys(self.cache, "token_major", blocks, offsets)

    def terms(self, layer: int) -> AttentionTerms:
        return self._terms


class AttentionRead(nn.Module):
    """The attention bank on one layer's staged query rows (a decode step: one row of each
    request, plus one request's chunk of prefill rows), in the recorder window."""

    def __init__(self, bank: AttentionBank, context: Any, rows: Any) -> None:
        super().__init__()
        self.bank, self.context, self.rows = bank, context, rows

    def forward(self, queries: torch.Tensor) -> torch.Tensor:
        return self.bank([queries], context=self.context, step_rows=self.rows)


def attention_case(shapes: Shapes) -> Case:
    """Attention per head (issue 51): keys read from a paged cache (blocks scattered at
    random, FlashAttention's layout), 8 query heads on 2 KV heads of 64, top-k, entropy and a
    span's mass; verified against :func:`head_readings` of each request's keys in order."""
    import numpy as np

    from probehook.outputs.attention import MAX_SPANS, AttentionReadout
    from probehook.worker.step_context import StepContext

    heads, kv_heads, dim, block = 8, 2, 64, 16
    requests = MAX_NUM_SEQS - 1
    lengths = [8 + 5 * i for i in range(requests)]  # decode rows at these positions
    chunk = shapes.tokens  # one more request: a prefill chunk of this many rows
    blocks_per = (max(lengths) + chunk) // block + 2
    order = torch.randperm((requests + 1) * blocks_per, generator=torch.Generator().manual_seed(0))
    table = order.view(requests + 1, blocks_per).to(shapes.device)
    cache = torch.empty(len(order), kv_heads, block, 2 * dim, dtype=shapes.dtype,
                        device=shapes.device)  # fmt: skip
    terms = AttentionTerms(scale=dim**-0.5)
    settings = {"layer": 0, "heads": heads, "spans": MAX_SPANS, "min_p": 0.0, "num_layers": 1}
    bank = AttentionBank(AttentionReadout(), {"0": settings}, shapes.k)
    positions = [n - 1 for n in lengths] + list(range(chunk))
    starts = np.array([*range(requests), requests, requests + chunk])
    context = StepContext(
        tuple(f"r{i}" for i in range(requests + 1)), starts,
        np.array([n - 1 for n in lengths] + [0]), np.zeros((requests + 1, 1), dtype=np.int64),
        np.array([n for n in lengths] + [chunk]), shapes.device, None,
        {"attention": PagedKeys(cache, table, terms)},
        lambda row, source: {"spans": [["start", 0, 4]]},
    )  # fmt: skip
    rows = np.arange(len(positions))
    queries = torch.empty(len(positions), heads * dim, dtype=shapes.dtype, device=shapes.device)

    def write(seed: int) -> None:
        cache.copy_(_randn(cache.shape, 1000 * seed + 7, shapes, cache.dtype))
        queries.copy_(_randn(queries.shape, 1000 * seed + 8, shapes, queries.dtype))

    def verify(results: dict[str, torch.Tensor]) -> None:
        got = AttentionReadout().row_type.unpack(
            results["readout"][0], shapes.k, {"k": shapes.k, "heads": heads, "spans": MAX_SPANS}
        )
        span = torch.tensor([[0, 4]], device=shapes.device)
        for r, newest in enumerate(positions):  # each row against its request's keys alone
            seen = torch.arange(newest + 1, device=shapes.device)
            keys = PagedKeys(cache, table, terms).keys(0, min(r, requests), seen)
            want = head_readings(queries[r : r + 1].float().view(1, heads, dim),
                                 torch.tensor([newest], device=shapes.device), keys.float(),
                                 seen, terms, shapes.k, spans=span)  # fmt: skip
            torch.testing.assert_close(got.probs[r], want.probs[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(got.entropy[r], want.entropy[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(got.span_mass[r, :, :1], want.spans[0], rtol=0, atol=1e-5)

    return Case(
        "AttentionBank read (paged keys, eager)",
        f"{requests} decode rows + a {chunk}-row chunk, {heads} heads on {kv_heads}, k {shapes.k}",
        AttentionRead(bank, context, rows),
        (queries,),
        write,
        lambda output: {"readout": output},
        compiled=False,
        verify=verify,
    )


def clamp_case(shapes: Shapes, arch: str) -> Case:
    x, residual = _hidden_inputs(shapes)
    weights, W_dec = random_sae(arch, shapes, seed=12)
    layer = Layer(shapes)
    buffers = ClampWriter(0, weights, W_dec, MAX_NUM_SEQS + 1)
    buffers.index = torch.zeros(shapes.max_tokens, dtype=torch.int64, device=shapes.device)
    named = {"index": buffers.index, **buffers.buffers}
    for name, tensor in named.items():
        layer.register_buffer(f"probehook_w0_{name}", tensor, persistent=False)
    layer.register_forward_hook(_clamp_hook([f"probehook_w0_{n}" for n in named], buffers.settings))
    writer = StepWrites({("clamp", "sae"): buffers})

    def write(seed: int) -> None:
        _write_hidden(x, residual, seed, shapes)
        starts = _requests(seed, shapes.tokens)
        # Half of each plan's features fire on the request's first token (so the op's
        # encoder reading matters), half are random (mostly off there).
        firsts = (x + residual)[starts[:-1]]
        active = read_top_k(weights, firsts, MAX_CLAMPED // 2)[:, : MAX_CLAMPED // 2].long()
        g = torch.Generator().manual_seed(seed)
        plans: dict[str, Any] = {}
        for position in range(len(starts) - 1):
            if (position + seed) % 3 == 0:
                continue  # not clamped (index 0): both kinds in each step
            on = active[position][active[position] >= 0].cpu()
            rand = torch.randint(0, shapes.d_sae, (MAX_CLAMPED,), generator=g)
            ids = list(dict.fromkeys([*on.tolist(), *rand.tolist()]))[:MAX_CLAMPED]
            values = torch.rand(len(ids), generator=g) * 8
            values[torch.rand(len(ids), generator=g) < 0.3] = 0.0  # removes the feature
            terms = [[f, float(v)] for f, v in zip(ids, values, strict=True)]
            plans[f"step{seed}-req{position}"] = {"clamp": {"sae": terms}}
        req_ids = [f"step{seed}-req{position}" for position in range(len(starts) - 1)]
        writer.prepare(req_ids, starts, plans.get)  # type: ignore[arg-type]

    def verify(results: dict[str, torch.Tensor]) -> None:
        hidden = results["hidden"]
        on = buffers.index[: shapes.tokens] > 0
        assert on.any() and (~on).any(), "a step needs clamped and unclamped tokens"
        # Unclamped tokens: untouched, to the bit (on a GPU the op adds them an exact 0).
        torch.testing.assert_close(hidden[~on], x[~on], rtol=0, atol=0)
        assert (hidden[on] != x[on]).any(), "no clamped token changed"
        want, delta = clamp_reference(weights, W_dec, x, residual, buffers)
        # The op and the formula sum the decoder rows in different orders, so the delta's
        # rounding to the model dtype may differ by one unit: bounded by |delta|, not by the
        # result (x + delta may cancel).
        rtol, atol = TOLERANCES[hidden.dtype]
        bound = rtol * (delta.abs() + want.double().abs()) + atol
        off = (hidden.double() - want.double()).abs() > bound
        assert not off.any(), (
            f"hidden differs from the formula at {int(off.sum())} elements, by up to "
            f"{float((hidden.double() - want.double()).abs().max()):.3g}"
        )

    return Case(
        f"probehook::write clamp ({arch})",
        f"[{shapes.tokens}, {shapes.d_model}], d_sae {shapes.d_sae}, <= {MAX_CLAMPED} clamped",
        Block(layer),
        (x, residual),
        write,
        _layer_results,
        verify=verify,
    )


def clamp_reference(
    weights: SAEWeights,
    W_dec: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    buffers: ClampWriter,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's hidden after clamping, from the op's formula written out (``hidden +=
    sum_f (value_f - a_f) * W_dec[f]`` over each token's row of the tables, none for row 0),
    and the float64 delta.

    ``a_f`` is read as the op's fixed-shape path reads it (``activations_per_token``, tiles
    of ``TILE_ROWS``; tests/test_clamp_op.py checks it against the full encode): a full
    encode rounds its GEMM differently, and a feature at its threshold (or at the topk cut)
    would then flip on or off. What this checks is the op's plumbing: rows, tables,
    coefficients, decoder rows, the add, the unclamped tokens."""
    tokens = x.shape[0]
    stream = x + residual
    slots = buffers.index[:tokens]
    features, values = buffers.buffers["features"][slots], buffers.buffers["values"][slots]
    ids = features.clamp(min=0)
    held = torch.cat(
        [
            activations_per_token(weights, stream[lo : lo + TILE_ROWS], ids[lo : lo + TILE_ROWS])
            for lo in range(0, tokens, TILE_ROWS)
        ]
    )
    coefficient = torch.where(features >= 0, values - held, 0.0)
    delta = (coefficient.unsqueeze(-1) * W_dec[ids].to(held.dtype)).sum(dim=1)
    return x + delta.to(x.dtype), delta.double()


# --- comparing ----------------------------------------------------------------------------


def _max_abs_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    diff = (got.double() - ref.double()).abs()
    diff[ref.isnan() & got.isnan()] = 0.0  # poisoned rows the op must leave alone
    return float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0


def compare_close(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], label: str) -> float:
    """Every result within one rounding of its dtype (:data:`TOLERANCES`); the max abs error."""
    worst = 0.0
    for name, want in ref.items():
        rtol, atol = TOLERANCES[want.dtype]
        torch.testing.assert_close(
            got[name],
            want,
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, n=name: f"{label}, {n}: {m}",
        )
        worst = max(worst, _max_abs_error(want, got[name]))
    return worst


def compare_readout(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], label: str, k: int
) -> float:
    """Top-k readouts (``[rows, 2k + 1]``: indices, values, l0): values within float32
    rounding, l0 exact, and the indices wherever the value is not tied (within tolerance) with
    a neighbour in its row: tied features may come in either order."""
    want, have = ref["readout"], got["readout"]
    rtol, atol = TOLERANCES[torch.float32]
    values, l0 = slice(k, 2 * k), 2 * k
    torch.testing.assert_close(
        have[:, values],
        want[:, values],
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{label}, values: {m}",
    )
    torch.testing.assert_close(
        have[:, l0], want[:, l0], rtol=0, atol=0, msg=lambda m: f"{label}, l0: {m}"
    )
    score = want[:, values].abs()  # abstopk ranks by |value|
    close = (score[:, 1:] - score[:, :-1]).abs() <= atol + rtol * score[:, 1:]
    tied = torch.zeros_like(score, dtype=torch.bool)
    tied[:, 1:] |= close
    tied[:, :-1] |= close
    differ = (have[:, :k] != want[:, :k]) & ~tied
    if differ.any():
        row, col = (int(i) for i in differ.nonzero()[0])
        raise AssertionError(
            f"{label}, indices: {int(differ.sum())} untied indices differ; first at row {row}, "
            f"rank {col}: {int(have[row, col])} vs eager {int(want[row, col])}"
        )
    return max(
        _max_abs_error(want[:, values], have[:, values]), _max_abs_error(want[:, l0], have[:, l0])
    )


def _lines(error: BaseException) -> str:
    """An error's first lines (torch.testing's: what differs, how many elements, by how
    much), as one line."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines[:3])[:400]


def _clone(results: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in results.items()}


def _poison_outputs(output: Any) -> None:
    for tensor in output if isinstance(output, tuple) else (output,):
        if tensor.is_floating_point():
            tensor.fill_(math.nan)


# --- timing -------------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], iters: int, cuda: bool, warmup: int = 3) -> float:
    """Median of ``iters`` calls: CUDA events around each call on a GPU (launch gaps count),
    wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of ``fn`` and its static output, after warm-up on a side stream (compiled
    code builds its kernels on the first calls, which must not be captured)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


@contextmanager
def no_host_sync(cuda: bool):  # noqa: ANN201
    """Errors on a device-to-host sync: it would stall every step, and a CUDA graph freezes
    whatever branch the host took at capture."""
    if not cuda:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- running ------------------------------------------------------------------------------


@dataclass
class Row:
    op: str
    shape: str
    eager_ms: float
    compiled_ms: float | None = None
    graph_ms: float | None = None
    error: float | None = None
    failures: list[str] = field(default_factory=list)
    eager_only: bool = False
    """A case vLLM never compiles (checked eager against plain torch, timed eager)."""


def run_case(case: Case, iters: int, cuda: bool) -> Row:
    row = Row(case.name, case.shape, math.nan)

    def check(label: str, got: dict[str, torch.Tensor], seed: int) -> None:
        try:
            error = case.compare(reference[seed], got, f"{case.name} {label}, step {seed}")
            row.error = max(row.error or 0.0, error)
        except AssertionError as e:
            # The message's first lines: what differs, how many elements, by how much.
            row.failures.append(_lines(e))

    def eager() -> Any:
        return case.module(*case.inputs)

    reference = {}
    for seed in STEPS:
        case.write(seed)
        case.poison()
        reference[seed] = _clone(case.results(eager()))
        if case.verify is not None:
            try:
                case.verify(reference[seed])
            except AssertionError as e:
                row.failures.append(f"{case.name} eager vs plain torch, step {seed}: {_lines(e)}")
    if cuda:
        case.write(STEPS[0])
        try:
            with no_host_sync(cuda):
                eager()
            torch.cuda.synchronize()
        except RuntimeError as e:
            row.failures.append(f"{case.name} eager: host sync: {str(e).splitlines()[0][:300]}")
    row.eager_ms = median_ms(eager, iters, cuda)
    if not case.compiled:
        row.eager_only = True
        return row

    compiled_module = torch.compile(
        case.module, fullgraph=True, dynamic=None if case.dynamic_tokens else False
    )
    if case.dynamic_tokens:
        for tensor in case.inputs:
            torch._dynamo.mark_dynamic(tensor, 0)

    def compiled() -> Any:
        return compiled_module(*case.inputs)

    for seed in STEPS:
        case.write(seed)
        case.poison()
        check("compiled", _clone(case.results(compiled())), seed)
    row.compiled_ms = median_ms(compiled, iters, cuda)

    if cuda:
        try:
            row.graph_ms = check_graph(case, compiled, check, iters)
        except Exception as e:  # a failed capture: the eager and compiled results still count
            traceback.print_exc()
            row.failures.append(f"{case.name} CUDA graph: {type(e).__name__}: {e}"[:400])
    return row


def check_graph(
    case: Case,
    compiled: Callable[[], Any],
    check: Callable[[str, dict[str, torch.Tensor], int], None],
    iters: int,
) -> float:
    """Captures ``compiled`` on the first step, replays it on each step after writing that
    step's values into the static inputs and buffers, checks each replay; the replay's ms."""
    case.write(STEPS[0])
    graph, static_output = capture(compiled)
    for seed in (*STEPS[1:], STEPS[0]):
        case.write(seed)
        case.poison()
        _poison_outputs(static_output)  # a replay that writes nothing cannot pass
        graph.replay()
        torch.cuda.synchronize()
        check("graph replay", _clone(case.results(static_output)), seed)
    return median_ms(graph.replay, iters, cuda=True)


def matmul_row(shapes: Shapes, iters: int, cuda: bool) -> Row:
    a = _randn((shapes.tokens, shapes.d_model), 1, shapes, shapes.dtype)
    w = _randn((shapes.d_model, shapes.d_model), 2, shapes, shapes.dtype)
    ms = median_ms(lambda: a @ w, iters, cuda)
    shape = f"[{shapes.tokens}, {shapes.d_model}] @ [{shapes.d_model}, {shapes.d_model}]"
    return Row("matmul (reference)", shape, ms)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: Sequence[Row], matmul_ms: float, cuda: bool, shapes: Shapes) -> str:
    lines = [
        f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; "
        f"dtype {str(shapes.dtype).removeprefix('torch.')}",
        "",
        "| op | shape | eager ms | compiled ms | graph-replay ms | ratio to matmul "
        "| max abs error | check |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        base = row.graph_ms if cuda else row.compiled_ms
        ratio = (base if base is not None else row.eager_ms) / matmul_ms
        error = "-" if row.error is None else f"{row.error:.3g}"
        checked = row.compiled_ms is not None or row.eager_only
        check = "FAIL" if row.failures else ("ok" if checked else "-")
        lines.append(
            f"| {row.op} | {row.shape} | {_ms(row.eager_ms)} | {_ms(row.compiled_ms)} "
            f"| {_ms(row.graph_ms)} | {ratio:.3f} | {error} | {check} |"
        )
    lines += [
        "",
        f"ratio: {'graph-replay' if cuda else 'compiled'} ms / matmul ms. Hook ops' times "
        "include the stand-in layer (the 'layer only' row). max abs error: compiled and "
        "graph replays vs eager on the same inputs, over every step. Eager-only rows (the lens "
        "bank, which the worker runs after the forward): eager ms / matmul ms, checked against "
        "plain torch and, on a GPU, for host syncs.",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-sae", type=int, default=65536, help="SAE width (SAE and clamp ops)")
    parser.add_argument("--k", type=int, default=32, help="top-k features read out per row")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument(
        "--arch",
        nargs="+",
        default=["jumprelu", "topk"],
        choices=ARCHITECTURES,
        help="SAE architectures for the SAE and clamp ops",
    )
    parser.add_argument("--iters", type=int, default=50, help="timed calls; the median counts")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument(
        "--only",
        action="append",
        help="run only the cases with this label ('patch', 'steer', 'SAE topk', ...); repeatable",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help=f"on the CPU with tiny shapes {SMOKE_SHAPES}: eager and "
        "torch.compile checks only (no CUDA graphs)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print(
            "gpu_ops_check.py needs CUDA (torch.cuda.is_available() is False); --cpu-smoke "
            "runs its eager and torch.compile checks on the CPU.",
            file=sys.stderr,
        )
        return 2
    sizes = (
        SMOKE_SHAPES
        if args.cpu_smoke
        else {
            "d_model": args.d_model,
            "tokens": args.tokens,
            "d_sae": args.d_sae,
            "k": args.k,
        }
    )
    shapes = Shapes(
        **sizes, dtype=getattr(torch, args.dtype), device=torch.device("cuda" if cuda else "cpu")
    )
    iters = 20 if args.cpu_smoke else args.iters
    if args.cpu_smoke:
        # Tiny shapes: more threads only add barrier waits, long ones on a busy machine.
        torch.set_num_threads(1)
    started = time.perf_counter()
    builders: list[tuple[str, Callable[[], Case]]] = [
        ("layer only", lambda: layer_only_case(shapes)),
        ("tap", lambda: tap_case(shapes)),
        ("steer", lambda: steer_case(shapes)),
        ("patch", lambda: patch_case(shapes)),
        *((f"SAE {arch}", lambda arch=arch: sae_case(shapes, arch)) for arch in args.arch),
        *((f"clamp {arch}", lambda arch=arch: clamp_case(shapes, arch)) for arch in args.arch),
        ("lens", lambda: lens_case(shapes)),
        ("attention", lambda: attention_case(shapes)),
    ]
    if args.only:
        unknown = sorted(set(args.only) - {label for label, _ in builders})
        if unknown:
            print(f"--only {unknown}: the cases are {[lb for lb, _ in builders]}", file=sys.stderr)
            return 2
        builders = [(label, build) for label, build in builders if label in args.only]
    # vLLM runs its model under inference mode; the ops must work there.
    with torch.inference_mode():
        matmul = matmul_row(shapes, iters, cuda)
        rows = [matmul]
        for label, build in builders:
            print(f"{label}: checking ...", file=sys.stderr, flush=True)
            try:
                rows.append(run_case(build(), iters, cuda))
            except Exception as e:  # one broken op must not hide the others' results
                traceback.print_exc()
                failure = f"{label}: {type(e).__name__}: {e}"[:400]
                rows.append(Row(label, "-", math.nan, failures=[failure]))
            # A fresh dynamo cache per op: the hook cases share Block.forward's code object,
            # and past the recompile limit dynamo would quietly run it eager. The reset also
            # lets go of the case's compiled graph, so its SAE weights are freed here.
            torch._dynamo.reset()
            if cuda:
                torch.cuda.empty_cache()
    failures = [failure for row in rows for failure in row.failures]
    if "vllm" in sys.modules:
        failures.append("vllm was imported: this check must run where vLLM is not installed")
    text = table(rows, matmul.eager_ms, cuda, shapes)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    for failure in failures:
        print(f"FAIL: {failure}")
    seconds = time.perf_counter() - started
    print(
        f"{'FAILED' if failures else 'all checks passed'} ({len(failures)} failures, "
        f"{seconds:.0f} s); vllm imported: {'vllm' in sys.modules}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
