"""SAE features in the store (store/features.py): sparse datasets, read back exactly, kept by
fsck and compaction, indices in the smallest unsigned type. No engine (the engine's round
trip is in tests/test_sae_engine.py)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_store_unit import META, fake_request

from probehook.errors import CaptureConfigError, StoreError
from probehook.saes import SAEFeatures
from probehook.store import ActivationStore
from probehook.store.features import FeatureBlock
from probehook.store.format import SHARD_DIR
from probehook.store.maintenance import compact, fsck


def features(seed: int, n: int, k: int, d_sae: int) -> SAEFeatures:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(d_sae, generator=g)[:k] for _ in range(n)])
    values = torch.rand(n, k, generator=g) + 0.5
    l0 = torch.randint(0, k + 5, (n,), generator=g)
    indices[:, k - 2 :] = -1  # padding: fewer than k on
    values[:, k - 2 :] = 0
    return SAEFeatures(indices, values, l0)


def with_features(i: int, d_sae: int = 512, k: int = 6):
    request = fake_request(i, prompt_len=4, n_out=3)
    request.blocks = [b for b in request.blocks if b.layer == 3]  # and some rows
    request.features = [
        FeatureBlock("prefill", None, "res", 0, features(i, 4, k, d_sae)),
        FeatureBlock("decode", 0, "res", 3, features(100 + i, 3, k, d_sae)),
    ]
    return request


def write_run(root: Path, requests, d_sae: int = 512, **options) -> list[str]:
    store = ActivationStore.for_writing(root, META, **options)
    store.begin_run({"saes": {"res": {"d_sae": d_sae, "k": 6, "layer": 3, "fingerprint": "f"}}})
    ids = [store.add(r) for r in requests]
    store.flush()
    store.close()
    return ids


def same(a: SAEFeatures, b: SAEFeatures) -> bool:
    return (
        torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
        and torch.equal(a.l0, b.l0)
    )  # fmt: skip


def test_round_trip_fsck_and_compaction(tmp_path: Path) -> None:
    root = tmp_path / "s"
    requests = [with_features(i) for i in range(6)]
    expected = {i: (r.features[0].features, r.features[1].features) for i, r in enumerate(requests)}
    ids = write_run(root, requests[:3], shard_bytes=1) + write_run(
        root, requests[3:], shard_bytes=1
    )
    store = ActivationStore.open(root)
    assert store.info()["shards"] == 6
    for i, store_id in enumerate(ids):
        stored = store[store_id]
        assert same(stored.prefill_sae_features["res"], expected[i][0])
        assert same(stored.sae_features["res"], expected[i][1])
        assert list(stored.hidden_states) == [3]
    run = next(iter(store.runs.values()))
    assert run["saes"]["res"]["d_sae"] == 512
    assert fsck(root).ok
    report = compact(root, progress=False)
    assert report.shards_after == 1
    store = ActivationStore.open(root)
    for i, store_id in enumerate(ids):
        assert same(store[store_id].prefill_sae_features["res"], expected[i][0])
        assert same(store[store_id].sae_features["res"], expected[i][1]), i
    assert fsck(root).ok


def test_index_types_values_and_size(tmp_path: Path) -> None:
    write_run(tmp_path / "small", [with_features(0)])
    write_run(tmp_path / "big", [with_features(0, d_sae=70_000)], d_sae=70_000)
    (half,) = write_run(tmp_path / "half", [with_features(0)], sae_values="float16")
    for name, index_type, value_type in [
        ("small", np.uint16, np.float32),
        ("big", np.uint32, np.float32),
        ("half", np.uint16, np.float16),
    ]:
        shard = next((tmp_path / name / SHARD_DIR).iterdir())
        with h5py.File(shard) as f:
            assert f["decode/sae_res/indices"].dtype == index_type
            assert f["decode/sae_res/values"].dtype == value_type
            assert f["decode/sae_res/l0"].dtype == np.uint32
    stored = ActivationStore.open(tmp_path / "half")[half]
    original = with_features(0).features[1].features
    torch.testing.assert_close(
        stored.sae_features["res"].values, original.values, atol=1e-3, rtol=1e-3
    )
    assert torch.equal(stored.sae_features["res"].indices, original.indices)


def test_features_of_an_undeclared_sae_are_refused(tmp_path: Path) -> None:
    store = ActivationStore.for_writing(tmp_path / "s", META)
    store.begin_run({})
    with pytest.raises(StoreError, match="did not declare"):
        store.add(with_features(0))
    store.close()
    with pytest.raises(CaptureConfigError, match="sae_values"):
        ActivationStore.for_writing(tmp_path / "t", META, sae_values="int8")


def test_a_store_of_features_is_20x_smaller_than_rows(tmp_path: Path) -> None:
    """At k = 32 and 16,384 features, a token's stored features (uint16 indices, float32
    values, l0) take 196 bytes; a float32 row of the benchmark model (hidden 1,024) 4,096:
    measured on the shard's datasets, not computed."""
    n, k = 200, 32
    request = fake_request(0, prompt_len=4, n_out=3)
    request.blocks = []
    request.features = [FeatureBlock("prefill", None, "res", 0, features(0, n, k, 16384))]
    store = ActivationStore.for_writing(tmp_path / "s", META)
    store.begin_run({"saes": {"res": {"d_sae": 16384, "k": k, "layer": 3, "fingerprint": "f"}}})
    store.add(request)
    store.close()
    shard = next((tmp_path / "s" / SHARD_DIR).iterdir())
    with h5py.File(shard) as f:
        stored = sum(f[f"prefill/sae_res/{part}"].nbytes for part in ("indices", "values", "l0"))
    per_token = stored / n
    assert per_token == 2 * k + 4 * k + 4
    assert 1024 * 4 / per_token >= 20


def test_a_queued_block_counts_the_bytes_it_holds() -> None:
    """The writer's queue bound counts a block's memory: int64 indices are 8 bytes each (a
    count of 4 let twice the bound wait in the queue)."""
    block = FeatureBlock("decode", 0, "res", 3, features(1, 5, 6, 512))
    f = block.features
    assert f.indices.dtype == torch.int64 and f.values.dtype == torch.float32
    assert block.nbytes == 5 * 6 * 8 + 5 * 6 * 4 + 5 * f.l0.element_size()
