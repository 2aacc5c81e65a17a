"""SAE features in the store (store/features.py): sparse datasets, read back exactly, kept by
fsck and compaction, indices in the smallest unsigned type. No engine (the engine's round
trip is in tests/test_sae_engine.py)."""

from __future__ import annotations

import logging
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
from probehook.store.format import MANIFEST_FILE, SHARD_DIR, shard_path
from probehook.store.maintenance import compact, fsck
from probehook.store.manifest import rewrite_manifest, scan_manifest

PARTS = ("indices", "values", "l0")


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
        layout = f"k6-{np.dtype(index_type).name}-{np.dtype(value_type).name}"
        with h5py.File(shard) as f:
            assert list(f["decode/sae_res"]) == [layout]  # a group per layout
            assert f[f"decode/sae_res/{layout}/indices"].dtype == index_type
            assert f[f"decode/sae_res/{layout}/values"].dtype == value_type
            assert f[f"decode/sae_res/{layout}/l0"].dtype == np.uint32
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
        group = f["prefill/sae_res/k32-uint16-float32"]
        stored = sum(group[part].nbytes for part in ("indices", "values", "l0"))
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


# -- runs of other SAE layouts under one name (issue 43, item 6) ---------------------------------
#
# Two runs store features under the SAE name "s" with another d_sae (index type), k (width) or
# value type. Compaction used to concatenate their datasets by (phase, name): indices >= 65,536
# came back cut to uint16, and k 8 then 4 failed with numpy's "could not broadcast".

LAYOUT_CASES = {
    "d_sae 512 then 70,000": [(512, 6, "float32"), (70_000, 6, "float32")],
    "d_sae 70,000 then 512": [(70_000, 6, "float32"), (512, 6, "float32")],
    "k 8 then 4": [(512, 8, "float32"), (512, 4, "float32")],
    "values float32 then float16": [(512, 6, "float32"), (512, 6, "float16")],
    # A readout whose per-token scalar is a real number (a lens's target log-prob) under a
    # name an SAE's counts used: appending it to the counts' uint32 l0 would truncate it.
    "l0 counts then real scalars": [(512, 6, "float32"), (512, 6, "float32", "real")],
}


def top_features(seed: int, n: int, k: int, d_sae: int, real: bool = False) -> SAEFeatures:
    """``features``, with each token's first index at the top of the SAE's range (>= 65,536
    for a 70,000-feature SAE); ``real``: the scalar a float32 with a fraction (``l0 + 0.25``,
    as a lens's target log-prob is a real number)."""
    f = features(seed, n, k, d_sae)
    indices = f.indices.clone()
    indices[:, 0] = d_sae - 1 - torch.arange(n)
    return SAEFeatures(indices, f.values, f.l0.float() + 0.25 if real else f.l0)


def sae_request(seed: int, d_sae: int, k: int, name: str = "s", scalar: str = "count"):
    request = fake_request(seed, prompt_len=4, n_out=3)
    request.blocks = [b for b in request.blocks if b.layer == 3]
    real = scalar == "real"
    request.features = [
        FeatureBlock("prefill", None, name, 0, top_features(seed, 4, k, d_sae, real)),
        FeatureBlock("decode", 0, name, 3, top_features(1000 + seed, 3, k, d_sae, real)),
    ]
    return request


def sae_info(d_sae: int, k: int, name: str = "s") -> dict:
    return {"saes": {name: {"d_sae": d_sae, "k": k, "layer": 3, "fingerprint": f"f{d_sae}"}}}


def sae_run(
    root: Path,
    seeds,
    d_sae: int,
    k: int,
    values: str = "float32",
    scalar: str = "count",
    **options,
) -> dict:
    """One run of requests with features of SAE "s" (one shard a request); returns
    ``{store_id: (prefill features, decode features)}`` as they were added."""
    store = ActivationStore.for_writing(root, META, shard_bytes=1, sae_values=values, **options)
    store.begin_run(sae_info(d_sae, k))
    added = {}
    for seed in seeds:
        request = sae_request(seed, d_sae, k, scalar=scalar)
        store_id = store.add(request)
        added[store_id] = tuple(stored_as(block.features, values) for block in request.features)
    store.flush()
    store.close()
    return added


def stored_as(f: SAEFeatures, values: str) -> SAEFeatures:
    """The features as the store gives them back: float16 values rounded."""
    if values == "float32":
        return f
    return SAEFeatures(f.indices, f.values.to(torch.float16).to(torch.float32), f.l0)


def stored_feature_sets(root: Path) -> dict[tuple, tuple[np.ndarray, ...]]:
    """Every stored feature set: ``(store id, phase, completion, sae) -> (indices, values, l0)``
    as they lie in the shard (dtypes included), found through the request's segments."""
    store = ActivationStore.open(root)
    out = {}
    for request in store.requests:
        record = request.record
        with h5py.File(shard_path(root, record["shard"]), "r") as f:
            for seg in record.get("sae_segments", ()):
                group = f"{seg['phase']}/sae_{seg['sae']}"
                if seg.get("layout"):
                    group += f"/{seg['layout']}"
                rows = slice(seg["start"], seg["start"] + seg["count"])
                key = (request.store_id, seg["phase"], seg["completion"], seg["sae"])
                out[key] = tuple(f[f"{group}/{part}"][rows] for part in ("indices", "values", "l0"))
    store.close()
    return out


def assert_bit_equal(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    changed = []
    for key, old in before.items():
        new = after[key]
        if not all(
            a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
            for a, b in zip(old, new, strict=True)
        ):
            changed.append(key)
    assert not changed, f"{len(changed)} of {len(before)} feature sets changed: {changed[:4]}"


def assert_reads_back(root: Path, added: dict) -> None:
    store = ActivationStore.open(root)
    for store_id, (prefill, decode) in added.items():
        stored = store[store_id]
        assert same(stored.prefill_sae_features["s"], prefill), store_id
        assert same(stored.sae_features["s"], decode), store_id
    store.close()


def as_legacy_store(root: Path) -> None:
    """Turn a store into the layout probehook wrote before SAE datasets were kept apart by
    layout: ``{phase}/sae_{name}/{part}``, segments without ``"layout"``. Each shard holds one
    run here, so each SAE group has one layout, as the old writer left it."""
    for shard in (root / SHARD_DIR).iterdir():
        with h5py.File(shard, "r+") as f:
            for phase in list(f):
                for group in [g for g in f[phase] if g.startswith("sae_")]:
                    for layout in [n for n in f[phase][group] if n not in PARTS]:
                        for part in PARTS:
                            f.move(f"{phase}/{group}/{layout}/{part}", f"{phase}/{group}/{part}")
                        del f[f"{phase}/{group}/{layout}"]
    records = scan_manifest(root).records
    for record in records:
        for seg in record.get("sae_segments", ()):
            seg.pop("layout", None)
    rewrite_manifest(root, records, keep_old_as="before-legacy")


@pytest.mark.parametrize("legacy", [False, True], ids=["store", "legacy store"])
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_compaction_never_changes_a_stored_feature_set(
    tmp_path: Path, case: str, legacy: bool
) -> None:
    root = tmp_path / "s"
    added: dict = {}
    for run, settings in enumerate(LAYOUT_CASES[case]):
        added |= sae_run(root, range(6 * run, 6 * run + 6), *settings)
    if legacy:
        as_legacy_store(root)
    before = stored_feature_sets(root)
    assert len(before) == 24
    if "70,000" in case:
        wide = [raw[0] for raw in before.values() if raw[0].dtype == np.uint32]
        assert any(((i >= 65_536) & (i != np.iinfo(np.uint32).max)).any() for i in wide)
    assert_reads_back(root, added)
    assert fsck(root).ok

    report = compact(root, progress=False)

    assert report.shards_before == 12 and report.shards_after == 1
    assert_bit_equal(before, stored_feature_sets(root))
    assert_reads_back(root, added)
    assert fsck(root).ok
    # Compacting again (now one shard with several layouts, merged with a new run) keeps them.
    added |= sae_run(root, range(20, 22), *LAYOUT_CASES[case][0])
    before = stored_feature_sets(root)
    compact(root, progress=False)
    assert_bit_equal(before, stored_feature_sets(root))
    assert_reads_back(root, added)
    assert fsck(root).ok


@pytest.mark.parametrize("case", ["d_sae 512 then 70,000", "d_sae 70,000 then 512", "k 8 then 4"])
def test_one_shard_holds_runs_of_other_sae_layouts(tmp_path: Path, case: str) -> None:
    """One writer, two runs of one SAE name with other layouts, one shard: the writer keeps
    their datasets apart as compaction does."""
    root = tmp_path / "s"
    store = ActivationStore.for_writing(root, META)
    added = {}
    for run, (d_sae, k, _) in enumerate(LAYOUT_CASES[case]):
        store.begin_run(sae_info(d_sae, k))
        for seed in range(3 * run, 3 * run + 3):
            request = sae_request(seed, d_sae, k)
            added[store.add(request)] = tuple(block.features for block in request.features)
    store.flush()
    store.close()
    assert ActivationStore.open(root).info()["shards"] == 1
    assert_reads_back(root, added)
    sets = stored_feature_sets(root)
    kinds = {(raw[0].dtype, raw[0].shape[1], raw[1].dtype) for raw in sets.values()}
    assert len(kinds) == 2
    assert fsck(root).ok


def test_compaction_refuses_sae_datasets_out_of_step(tmp_path: Path) -> None:
    """A shard whose SAE datasets disagree (damaged) is refused with a StoreError naming the
    SAE; the store is left as it was."""
    root = tmp_path / "s"
    sae_run(root, range(3), 512, 6)
    before = stored_feature_sets(root)
    store = ActivationStore.open(root)
    record = next(iter(store.requests)).record
    seg = record["sae_segments"][0]
    group = f"{seg['phase']}/sae_{seg['sae']}" + (f"/{seg['layout']}" if seg.get("layout") else "")
    with h5py.File(shard_path(root, record["shard"]), "r+") as f:
        l0 = f[f"{group}/l0"]
        l0.resize(l0.shape[0] + 1, axis=0)
    manifest = (root / MANIFEST_FILE).read_bytes()
    with pytest.raises(StoreError, match="SAE 's'.*out of step"):
        compact(root, progress=False)
    assert (root / MANIFEST_FILE).read_bytes() == manifest
    assert not [p for p in (root / SHARD_DIR).iterdir() if p.name.startswith("compact-")]
    assert_bit_equal(before, stored_feature_sets(root))


def test_an_sae_another_run_stored_under_its_name_is_compared_and_kept_apart(
    tmp_path: Path, caplog
) -> None:
    """``check_appendable`` (and ``begin_run``) compare a run's SAEs with the store's earlier
    runs: another SAE, d_sae or k under a stored name is allowed (its features get datasets of
    their own) and logged; a description the store cannot lay out is refused, naming it."""
    root = tmp_path / "s"
    added = sae_run(root, range(2), 512, 8)
    other = {"s": {"d_sae": 70_000, "k": 4, "layer": 3, "fingerprint": "g"}}
    with caplog.at_level(logging.INFO, logger="probehook.store"):
        ActivationStore.check_appendable(root, META, top_k=other)
    assert "SAE 's'" in caplog.text and "d_sae 512 -> 70000" in caplog.text
    assert "k 8 -> 4" in caplog.text and "fingerprint" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="probehook.store"):
        added |= sae_run(root, range(2, 4), 70_000, 4)
    assert "SAE 's'" in caplog.text
    assert_reads_back(root, added)
    for bad, why in [
        ({"s": {"k": 4, "layer": 3}}, "d_sae"),
        ({"s": {"d_sae": 512, "k": 0}}, "k"),
        ({"s": {"d_sae": 1 << 32, "k": 4}}, "d_sae"),
        ({"s": "not a description"}, "description"),
    ]:
        with pytest.raises(StoreError, match=f"SAE 's'.*{why}"):
            ActivationStore.check_appendable(root, META, top_k=bad)
        store = ActivationStore.for_writing(root, META)
        with pytest.raises(StoreError, match=f"SAE 's'.*{why}"):
            store.begin_run({"saes": bad})
        store.close()
    assert_reads_back(root, added)


@pytest.mark.parametrize("legacy", [False, True], ids=["store", "legacy store"])
def test_compaction_keeps_sae_groups_no_record_names_apart(tmp_path: Path, legacy: bool) -> None:
    """A shard whose request record is gone (as fsck --repair drops one) still holds SAE
    datasets: they are copied like any dataset, into their layout's group, without mixing."""
    root = tmp_path / "s"
    added = sae_run(root, range(3), 512, 8) | sae_run(root, range(3, 6), 70_000, 4)
    if legacy:
        as_legacy_store(root)
    gone = next(iter(added))
    records = [r for r in scan_manifest(root).records if r.get("id") != gone]
    rewrite_manifest(root, records, keep_old_as="test")
    del added[gone]
    before = stored_feature_sets(root)
    compact(root, progress=False)
    assert_bit_equal(before, stored_feature_sets(root))
    assert_reads_back(root, added)
    assert fsck(root).ok
    (shard,) = (root / SHARD_DIR).iterdir()
    with h5py.File(shard, "r") as f:
        assert sorted(f["decode/sae_s"]) == ["k4-uint32-float32", "k8-uint16-float32"]
