"""The clamp op on its own (no engine): its fixed-shape path (what a CUDA graph replays: every
token, each token's own clamped features, in tiles) equals its CPU path and the full encode;
its SAE key comes from what the compile-cache key holds."""

from __future__ import annotations

import pytest
import torch
from sae_oracle import ARCHITECTURES, make_saelens_sae

from probehook import SAE
from probehook.saes.clamp import MAX_CLAMPED
from probehook.saes.encode import TILE_ROWS, activations_per_token
from probehook.worker import clamp_op
from probehook.worker.write_op import write_spec

D_IN, D_SAE = 32, 96


def _sae(arch: str, tmp_path, norm: str = "none") -> SAE:
    extra = {"k": 12} if arch in ("topk", "abstopk") else {}
    folder = make_saelens_sae(arch, tmp_path / arch, D_IN, D_SAE, "blocks.2.hook_resid_post",
                              seed=6, normalize_activations=norm, **extra)  # fmt: skip
    return SAE.load(folder)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("norm", ["none", "layer_norm"])
def test_activations_per_token_equal_the_full_encode(tmp_path, arch: str, norm: str) -> None:
    sae = _sae(arch, tmp_path, norm)
    rows = torch.randn(40, D_IN, generator=torch.Generator().manual_seed(1)) * 2
    ids = torch.randint(0, D_SAE, (40, MAX_CLAMPED), generator=torch.Generator().manual_seed(2))
    dense = sae.encode(rows)
    got = activations_per_token(sae.weights, rows, ids)
    torch.testing.assert_close(got, dense.gather(1, ids), rtol=1e-5, atol=1e-5)
    assert bool((got > 0).any()) or arch == "abstopk"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_fixed_shape_path_equals_the_cpu_path(tmp_path, arch: str) -> None:
    """Across a tile boundary, with unclamped tokens between clamped ones: the same stream
    after the op whichever path computed it (the fixed-shape one is what runs on a GPU)."""
    sae = _sae(arch, tmp_path)
    decoder = torch.randn(D_SAE, D_IN, generator=torch.Generator().manual_seed(3))
    tokens = TILE_ROWS + 44
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, D_IN, generator=g)
    residual = torch.randn(tokens, D_IN, generator=g)
    index = torch.zeros(tokens, dtype=torch.int64)
    index[5:20] = 1
    index[TILE_ROWS - 3 : TILE_ROWS + 30] = 2
    features = torch.full((3, MAX_CLAMPED), -1, dtype=torch.int64)
    values = torch.zeros((3, MAX_CLAMPED))
    features[1, :2], values[1, :2] = torch.tensor([4, 50]), torch.tensor([0.0, 7.5])
    features[2, :3], values[2, :3] = torch.tensor([50, 9, D_SAE - 1]), torch.tensor([1.0, 0, 3])
    out = {}
    for distinct in (True, False):
        h = hidden.clone()
        rows = index.nonzero().squeeze(1) if distinct else torch.arange(tokens)
        for lo in range(0, len(rows), TILE_ROWS):
            clamp_op._clamp_rows(sae.weights, decoder, h, residual, rows[lo : lo + TILE_ROWS],
                                 index, features, values, distinct_columns=distinct)  # fmt: skip
        out[distinct] = h
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[False][index == 0], hidden[index == 0])  # unclamped: untouched
    assert not torch.equal(out[False], hidden)


def test_the_op_takes_its_sae_as_arguments(tmp_path) -> None:
    """The op reads the SAE from its arguments (the layer's buffers), not from a registry a
    traced or captured graph would freeze another engine's copy into (issue 43: a
    per-process key, then a key shared by two engines, picked the SAE at trace time): two
    SAEs through one op give each its own result, equal to the fixed-shape path's."""
    tokens = 8
    hidden = torch.randn(tokens, D_IN, generator=torch.Generator().manual_seed(5))
    index = torch.ones(tokens, dtype=torch.int64)
    features = torch.full((2, MAX_CLAMPED), -1, dtype=torch.int64)
    values = torch.zeros((2, MAX_CLAMPED))
    features[1, :2], values[1, :2] = torch.tensor([3, 40]), torch.tensor([5.0, 0.0])
    results = []
    for arch in ("standard", "jumprelu"):
        sae = _sae(arch, tmp_path)
        decoder = torch.randn(D_SAE, D_IN, generator=torch.Generator().manual_seed(6))
        tensors, spec = clamp_op.sae_tensors(sae.weights), clamp_op.sae_spec(sae.weights)
        assert clamp_op.weights_of(tensors, spec).architecture == arch
        h = hidden.clone()
        terms = write_spec([("clamp", clamp_op.CLAMP_TENSORS, spec)])
        torch.ops.probehook.write(h, None, [index, features, values, *tensors, decoder], terms)
        want = hidden.clone()
        clamp_op._clamp_rows(sae.weights, decoder, want, None, torch.arange(tokens), index,
                             features, values, distinct_columns=False)  # fmt: skip
        torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
        results.append(h)
    assert not torch.equal(results[0], results[1])


def test_the_clamp_writer_writes_a_request_s_whole_row(tmp_path) -> None:
    """A row a longer clamp used before holds only the new request's features after
    (the write table reuses rows step to step)."""
    sae = _sae("standard", tmp_path)
    writer = clamp_op.ClampWriter(3, sae.weights, torch.zeros(D_SAE, D_IN), slots=3)
    writer.write_row(1, writer.plan([[1, 2.0], [4, 0.5], [6, 1.0]]))
    writer.write_row(1, writer.plan([[5, 3.0]]))
    assert writer.buffers["features"][1].tolist() == [5] + [-1] * (MAX_CLAMPED - 1)
    assert writer.buffers["values"][1, 0] == 3.0
    assert writer.buffers["features"][2].tolist() == [-1] * MAX_CLAMPED  # untouched
    assert list(writer.buffers)[:2] == ["features", "values"]  # the kind's order after index
    assert writer.buffers["W_dec"].shape == (D_SAE, D_IN) and writer.settings == clamp_op.sae_spec(
        sae.weights
    )
