"""The column schema (probehook/outputs/columns.py): a readout's rows declare named columns,
and packing, the stream decoder, the served JSON and base64 forms and the store's datasets
and layouts follow, here for the per-head toy rows of tests/toy_readout.py (``[n, heads, k]``
entries, ``[n, heads]`` scalars and a second scalar column). No engine: the engine's round
trip is tests/test_readout_table.py's."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_store_unit import META, fake_request
from toy_readout import ChunkPeaks, PeakRows

from probehook.outputs.columns import Column, pack_columns, packed_width, unpack_columns
from probehook.outputs.top_k import TopKDecoder, TopKRows, compact_top_k, json_top_k
from probehook.store import ActivationStore
from probehook.store.features import LAYOUT, FeatureBlock, layout_of, layout_parts, to_storage
from probehook.store.maintenance import compact, fsck

HEADS, K = 4, 3
SETTINGS = {"layer": 3, "heads": HEADS, "width": 8}


def peak_rows(seed: int, n: int) -> PeakRows:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(n * HEADS)])
    peaks = torch.rand(n * HEADS, K, generator=g).sort(dim=1, descending=True).values
    return PeakRows(
        offsets.reshape(n, HEADS, K),
        peaks.reshape(n, HEADS, K),
        torch.rand(n, HEADS, generator=g),
        extra={"mean": torch.randn(n, generator=g)},
    )


def same(a: TopKRows, b: TopKRows) -> bool:
    return a.columns.keys() == b.columns.keys() and all(
        torch.equal(a.columns[name], b.columns[name]) for name in a.columns
    )


@pytest.fixture
def registered() -> Iterator[None]:
    from probehook.outputs import OUTPUT_PROCESSORS

    list(OUTPUT_PROCESSORS)
    OUTPUT_PROCESSORS.register(ChunkPeaks)
    yield
    OUTPUT_PROCESSORS.unregister(ChunkPeaks.name)


def test_a_column_refuses_what_no_form_can_carry() -> None:
    with pytest.raises(ValueError, match="column name 'Mean' is not valid"):
        Column("Mean")
    with pytest.raises(ValueError, match="has dtype torch.float64; choose one of"):
        Column("mean", (), torch.float64)
    with pytest.raises(ValueError, match="axis 0 is not valid: pass 'k', the name of"):
        Column("mean", (0,))
    with pytest.raises(ValueError, match="has axis 'heads', which no size names"):
        Column("probs", ("heads", "k")).shape({"k": 3})


def test_packed_rows_follow_the_schema_and_integers_travel_as_bits() -> None:
    schema = (Column("ids", ("k",), torch.int64), Column("x", ("heads",)), Column("n", (2,)))
    sizes = {"k": 3, "heads": 2}
    assert packed_width(schema, sizes) == 3 + 2 + 2
    ids = torch.tensor([[2**31 - 2, -1, 5]])  # past float32's exact range: bits, not values
    packed = pack_columns(schema, [ids, torch.tensor([[0.5, 1.5]]), torch.tensor([[1.0, 2.0]])])
    back = unpack_columns(schema, packed, sizes)
    assert back["ids"].tolist() == ids.tolist() and back["x"].tolist() == [[0.5, 1.5]]


def test_per_head_rows_unpack_narrow_and_join() -> None:
    rows = peak_rows(0, 5)
    readout = ChunkPeaks()
    packed = readout.pack(rows.offsets, rows.peaks, rows.chunk_norms, mean=rows.mean)
    assert packed.shape == (5, readout.packed_width(SETTINGS, K)) == (5, 2 * HEADS * K + HEADS + 1)
    sizes = readout.axis_sizes(SETTINGS, K)
    assert same(PeakRows.unpack(packed, K, sizes), rows)
    one = PeakRows.unpack(packed, 1, sizes)  # a request's k: every head's first entry
    assert one.offsets.shape == (5, HEADS, 1) and torch.equal(one.mean, rows.mean)
    assert torch.equal(one.watched.offsets, rows.offsets)  # monitors read the engine's k
    assert same(PeakRows.cat([rows.rows(0, 2), rows.rows(2)]), rows)
    # a monitor's value: the largest among the heads holding the entry
    hit = int(rows.offsets[0, 1, 0])
    held = [float(rows.peaks[0, h][rows.offsets[0, h] == hit].sum()) for h in range(HEADS)]
    assert float(rows.value_of(hit, -math.inf)[0]) == max(v for v in held if v)
    with pytest.raises(ValueError, match=r"packs columns .* given the three and \[\]"):
        readout.pack(rows.offsets, rows.peaks, rows.chunk_norms)


def test_a_stream_decodes_per_head_rows_once() -> None:
    rows = peak_rows(1, 6)
    readout = ChunkPeaks()
    packed = readout.pack(rows.offsets, rows.peaks, rows.chunk_norms, mean=rows.mean)[None]
    decoder = TopKDecoder(PeakRows, [readout.axis_sizes(SETTINGS, K)])
    first = decoder.decode(packed[:, :2], 0)[0]
    later = decoder.decode(packed[:, :6], 0)[0]
    assert same(first, rows.rows(0, 2)) and same(later, rows)
    assert decoder.converted == 6  # each row's integers converted once


def test_served_forms_carry_every_column_nested_and_name_non_finite_tokens() -> None:
    rows = peak_rows(2, 3)
    rows.mean[1] = float("nan")  # the second scalar: named like any real column
    for form in (json_top_k(rows), compact_top_k({"p": rows})["p"]):
        assert sorted(form) == ["chunk_norms", "mean", "non_finite", "offsets", "peaks"]
        assert form["non_finite"] == [1]
        back = PeakRows.from_columns(form)
        assert torch.equal(back.offsets, rows.offsets) and back.offsets.shape == (3, HEADS, K)
        torch.testing.assert_close(back.mean, rows.mean, equal_nan=True)
    assert json_top_k(rows)["offsets"][0] == rows.offsets[0].tolist()  # [heads][k] per token
    empty = PeakRows.empty(K, {"heads": HEADS})
    assert empty.offsets.shape == (0, HEADS, K) and empty.mean.shape == (0,)
    for form in (json_top_k(empty), compact_top_k({"p": empty})["p"]):
        assert len(PeakRows.from_columns(form)) == 0


def test_the_store_lays_out_per_head_rows_and_compaction_keeps_them(
    registered: None, tmp_path: Path
) -> None:
    arrays = to_storage(peak_rows(3, 2).top(2), 8, K, "float32")
    layout = layout_of(arrays)
    assert layout == "4xk3-uint16-float32-float32+mean-float32-1" and LAYOUT.fullmatch(layout)
    assert layout_parts(layout) == ["indices", "values", "l0", "col_mean"]
    assert arrays["indices"].shape == (2, HEADS, K)  # a request's k of 2, padded to the run's
    root = tmp_path / "s"
    written: dict[str, Any] = {}
    for run in range(2):
        store = ActivationStore.for_writing(root, META, shard_bytes=1)
        describe = ChunkPeaks().describe_instance("p3", SETTINGS, K)
        store.begin_run({"saes": {"peaks:p3": {**describe, "fingerprint": "f"}}})
        for i in range(3):
            request = fake_request(10 * run + i, prompt_len=4, n_out=3)
            kept = peak_rows(10 * run + i, 3)
            request.features = [FeatureBlock("decode", 0, "peaks:p3", 3, kept, "peaks")]
            written[store.add(request)] = kept
        store.flush()
        store.close()

    def check() -> None:
        store = ActivationStore.open(root)
        for store_id, kept in written.items():
            assert same(store[store_id].readout("peaks")["p3"], kept), store_id

    check()
    assert fsck(root).ok
    report = compact(root, progress=False)
    assert report.shards_after < report.shards_before
    check()
    assert fsck(root).ok
    assert np.iinfo(np.uint16).max == 65_535  # offsets of an 8-wide chunk: uint16
