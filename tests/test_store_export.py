"""Store exports (probehook.store.export) read back by SAELens's own loader and safetensors.

No engine: stores are written with ActivationStore.for_writing, as in test_store_unit.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import sae_lens  # noqa: F401 - see below
import torch

from probehook.errors import MissingExtraError
from probehook.store import ActivationStore
from probehook.store import export as export_module
from probehook.store.export import (
    export_saelens,
    export_safetensors,
    read_safetensors_export,
)
from probehook.store.writer import PendingRequest, RowBlock

# sae_lens is imported when the suite is collected, before any engine runs: its import parses
# source with ast (pydantic's docstring extraction, through wandb), and CPython 3.11.7's AST
# constructor raises "SystemError: AST constructor recursion depth mismatch" when a garbage
# collection during the parse runs the finaliser of an earlier test's AsyncLLM task (seen
# once in a full run; every sae_lens test then failed on the half-imported wandb). That task
# was left pending by test_async_llm's event loop, which now ends as asyncio.run ends one.

HIDDEN = 8
LAYERS = (1, 3)
META = {
    "model": "m",
    "model_fingerprint": "fp-abc",
    "dtype": "float32",
    "hidden_size": HIDDEN,
    "layers": list(LAYERS),
}
# (prompt length, output lengths of each completion): different lengths, one with n=2
SHAPES = [(5, [3]), (2, [4]), (7, [1]), (3, [2, 3]), (6, [5])]


def fake_request(
    i: int, prompt_len: int, outs: list[int], dtype=torch.float32, layers=LAYERS, extremes=True
):
    """Rows whose values encode (request, layer, phase, completion, position) so that any
    misalignment shows; token ids are unique per request and position."""
    prompt = [1000 * i + k for k in range(prompt_len)]
    completions = [
        {
            "index": c,
            "token_ids": [1000 * i + 100 * (c + 1) + t for t in range(n)],
            "text": "x" * n,
            "finish_reason": "length",
        }
        for c, n in enumerate(outs)
    ]
    record = {
        "id": f"r{i}",
        "prompt": f"p{i}",
        "prompt_token_ids": prompt,
        "sampling_params": {"max_tokens": max(outs)},
        "completions": completions,
    }
    g = torch.Generator().manual_seed(i)
    blocks = []
    for layer in layers:
        prefill = torch.randn(prompt_len, HIDDEN, generator=g)
        if extremes:  # outside float16's range: bf16 -> f32 only
            prefill[0, :2] *= torch.tensor([1e30, 1e-30])
        blocks.append(RowBlock("prefill", None, layer, 0, prefill.to(dtype)))
        for c, n in enumerate(outs):
            decode = torch.randn(n, HIDDEN, generator=g)
            decode[0] = prefill[-1]  # decode row 0 is the last prompt position
            blocks.append(RowBlock("decode", c, layer, prompt_len - 1, decode.to(dtype)))
    return PendingRequest(record, blocks)


def make_store(
    path: Path, dtype=torch.float32, shapes=SHAPES, layers=LAYERS, extremes=True
) -> ActivationStore:
    meta = {**META, "dtype": str(dtype).removeprefix("torch."), "layers": list(layers)}
    store = ActivationStore.for_writing(path, meta, shard_bytes=700)  # several shards
    for i, (prompt_len, outs) in enumerate(shapes):
        store.add(fake_request(i, prompt_len, outs, dtype, layers, extremes))
    store.flush()
    store.close()
    return ActivationStore.open(path)


def reference(store: ActivationStore, layer: int, phase: str):
    """Sequences ``[(rows float32 [n, hidden], input token ids [n])]`` built from the public
    per-request API, independently of the exporter."""
    out = []
    for req in store.requests:
        prompt = req.prompt_token_ids
        completions = req.record["completions"]
        if phase in ("prefill", "all"):
            rows = req.prefill_hidden_states[layer].float()
            ids = list(prompt)
            if phase == "all":
                first = req.hidden_states[layer].float()[1:]  # row 0 = last prompt position
                rows = torch.cat([rows, first])
                ids += req.output_token_ids[: len(first)]
            out.append((rows, torch.tensor(ids)))
        for c in range(len(completions)):
            if phase == "prefill" or (phase == "all" and c == 0):
                continue
            rows = req.completion_hidden_states(c)[layer].float()
            seq = list(prompt) + completions[c]["token_ids"]
            if phase == "all":
                rows = rows[1:]
                ids = seq[len(prompt) : len(prompt) + len(rows)]
            else:
                ids = seq[len(prompt) - 1 : len(prompt) - 1 + len(rows)]
            out.append((rows, torch.tensor(ids)))
    return out


def saelens_store(path: Path, hook_name: str, context_size: int, batch: int):
    """SAELens's own ActivationsStore reading a cached-activations folder (no model)."""
    from sae_lens.training.activations_store import ActivationsStore

    return ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=hook_name,
        hook_head_index=None,
        context_size=context_size,
        d_in=HIDDEN,
        n_batches_in_buffer=2,
        total_training_tokens=10_000,
        store_batch_size_prompts=batch,
        train_batch_size_tokens=4,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(path),
        activations_mixing_fraction=0.0,
    )


def drain(act_store) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row SAELens's loader serves in one epoch, in order."""
    rows, ids = [], []
    while True:
        try:
            a, t = act_store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            break
        rows.append(a)
        ids.append(t)
    return torch.cat(rows), torch.cat(ids)


@pytest.fixture(scope="module")
def f32_store(tmp_path_factory) -> ActivationStore:
    return make_store(tmp_path_factory.mktemp("f32") / "s")


@pytest.fixture(scope="module")
def bf16_store(tmp_path_factory) -> ActivationStore:
    return make_store(tmp_path_factory.mktemp("bf16") / "s", dtype=torch.bfloat16)


@pytest.mark.parametrize("phase", ["prefill", "decode", "all"])
def test_saelens_loader_reads_concat_export(f32_store, tmp_path: Path, phase: str) -> None:
    ctx = 4
    out = export_saelens(f32_store, tmp_path / "sae", layer=3, context_size=ctx, phase=phase)
    seqs = reference(f32_store, 3, phase)
    rows = torch.cat([r for r, _ in seqs])
    ids = torch.cat([t for _, t in seqs])
    n = len(rows) // ctx * ctx  # the concatenated stream, cut into whole contexts
    assert n < len(rows) or phase == "prefill"  # some tail is cut in these shapes

    act_store = saelens_store(out, "blocks.3.hook_resid_post", ctx, batch=1)
    got_rows, got_ids = drain(act_store)
    assert got_rows.dtype == torch.float32 and got_rows.shape == (n, HIDDEN)
    assert torch.equal(got_rows, rows[:n])
    assert got_ids.tolist() == ids[:n].tolist()

    summary = json.loads((out / "probehook_export.json").read_text())
    assert summary["tokens"] == n and summary["rows_left_out"] == len(rows) - n
    assert summary["left_out"]["concat_tail_rows"] == len(rows) - n
    assert summary["source"]["model_fingerprint"] == "fp-abc"


def test_saelens_feature_types_match_its_cache_runner(f32_store, tmp_path: Path) -> None:
    """The columns CacheActivationsRunner declares (sae_lens/cache_activations_runner.py)."""
    import datasets

    out = export_saelens(f32_store, tmp_path / "sae", layer=1, context_size=3, progress=False)
    ds = datasets.load_from_disk(str(out))
    hook = "blocks.1.hook_resid_post"
    assert ds.column_names == [hook, "token_ids"]
    assert ds.features[hook] == datasets.Array2D(shape=(3, HIDDEN), dtype="float32")
    assert ds.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=3)
    assert sorted(p.name for p in out.iterdir()) == [
        "data-00000-of-00001.arrow",
        "dataset_info.json",
        "probehook_export.json",
        "state.json",
    ]
    prefill = torch.cat([r.prefill_hidden_states[1] for r in f32_store.requests])
    assert len(ds) == len(prefill) // 3
    assert torch.equal(torch.tensor(ds[1][hook]), prefill[3:6])


def test_saelens_request_packing_truncates_and_drops_short(f32_store, tmp_path: Path) -> None:
    ctx = 5
    out = export_saelens(
        f32_store, tmp_path / "sae", layer=1, context_size=ctx, packing="request", phase="all"
    )
    seqs = reference(f32_store, 1, "all")
    kept = [(r[:ctx], t[:ctx]) for r, t in seqs if len(r) >= ctx]
    assert 0 < len(kept) < len(seqs)
    got_rows, got_ids = drain(saelens_store(out, "blocks.1.hook_resid_post", ctx, batch=1))
    assert torch.equal(got_rows, torch.cat([r for r, _ in kept]))
    assert got_ids.tolist() == torch.cat([t for _, t in kept]).tolist()
    left = json.loads((out / "probehook_export.json").read_text())["left_out"]
    assert left["short_sequences"] == len(seqs) - len(kept)
    assert left["short_sequence_rows"] == sum(len(r) for r, _ in seqs if len(r) < ctx)
    assert left["rows_past_context_size"] == sum(len(r) - ctx for r, _ in seqs if len(r) > ctx)


def test_saelens_bf16_store_is_converted_exactly(bf16_store, tmp_path: Path) -> None:
    out = export_saelens(
        bf16_store, tmp_path / "sae", layer=3, context_size=2, hook_name="my.hook", progress=False
    )
    got_rows, got_ids = drain(saelens_store(out, "my.hook", 2, batch=2))
    prefill = [r.prefill_hidden_states[3] for r in bf16_store.requests]
    assert prefill[0].dtype == torch.bfloat16
    expected = torch.cat(prefill)
    n = len(expected) // 4 * 4  # SAELens serves whole batches of 2 contexts of 2
    assert torch.equal(got_rows, expected[:n].float())
    assert got_rows.to(torch.bfloat16).float().equal(got_rows)  # exactly representable


def test_saelens_training_iterator_serves_exported_rows(f32_store, tmp_path: Path) -> None:
    """The path SAETrainer takes (ActivationsStore.__next__ through the mixing buffer)."""
    out = export_saelens(f32_store, tmp_path / "sae", layer=3, context_size=2, phase="decode")
    act_store = saelens_store(out, "blocks.3.hook_resid_post", 2, batch=2)
    batch = next(act_store)
    assert batch.shape == (4, HIDDEN)
    rows = torch.cat([r for r, _ in reference(f32_store, 3, "decode")])
    for row in batch:
        assert (rows == row).all(dim=1).any()


def test_saelens_shards_and_multiple_arrow_files(f32_store, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(export_module, "WRITE_BATCH_BYTES", 1)  # one context per batch
    monkeypatch.setattr(export_module, "READ_BLOCK_BYTES", 3 * HIDDEN * 4)  # 3-row reads
    out = export_saelens(f32_store, tmp_path / "sae", layer=1, context_size=2, shard_bytes=100)
    files = sorted(p.name for p in out.glob("*.arrow"))
    assert len(files) > 1 and files[0] == f"data-00000-of-{len(files):05d}.arrow"
    expected = torch.cat([r.prefill_hidden_states[1] for r in f32_store.requests])
    got_rows, _ = drain(saelens_store(out, "blocks.1.hook_resid_post", 2, batch=1))
    assert torch.equal(got_rows, expected[: len(expected) // 2 * 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("phase", ["prefill", "decode", "all"])
@pytest.mark.parametrize("read_rows", [None, 3])
def test_safetensors_shards_hold_the_rows(
    tmp_path: Path, dtype, phase: str, read_rows, monkeypatch
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if read_rows:  # reads of a few rows: the row window moves often
        monkeypatch.setattr(export_module, "READ_BLOCK_BYTES", read_rows * HIDDEN * 4)

    store = make_store(tmp_path / "s", dtype=dtype)
    paths = export_safetensors(store, tmp_path / "st", layers=[3, 1], phase=phase, shard_tokens=9)
    assert len(paths) > 1 and all(p.is_file() for p in paths)
    ref3, ref1 = reference(store, 3, phase), reference(store, 1, phase)
    got_rows, got_ids, offsets_seen = [], [], 0
    for p in paths:
        tensors = load_file(p)
        assert set(tensors) == {"hidden_states", "token_ids"}
        hs, ids = tensors["hidden_states"], tensors["token_ids"]
        assert hs.dtype == dtype and ids.dtype == torch.int64
        assert hs.shape == (len(ids), 2, HIDDEN)
        with safe_open(p, "pt") as f:
            meta = f.metadata()
        offsets = json.loads(meta["request_offsets"])
        assert offsets[0] == 0 and offsets[-1] == len(ids)
        assert json.loads(meta["layers"]) == [3, 1] and meta["phase"] == phase
        offsets_seen += len(offsets) - 1
        got_rows.append(hs)
        got_ids.append(ids)
    hs, ids = torch.cat(got_rows), torch.cat(got_ids)
    # layers stacked in the order given; store dtype kept (bf16 stays bf16, as vLLM saves)
    assert torch.equal(hs[:, 0].float(), torch.cat([r for r, _ in ref3]))
    assert torch.equal(hs[:, 1].float(), torch.cat([r for r, _ in ref1]))
    assert ids.tolist() == torch.cat([t for _, t in ref3]).tolist()
    assert offsets_seen == len(ref3)

    manifest = json.loads((tmp_path / "st" / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == [p.name for p in paths]
    assert manifest["tokens"] == len(ids) == sum(s["tokens"] for s in manifest["shards"])
    assert manifest["layers"] == [3, 1] and manifest["source"]["model_fingerprint"] == "fp-abc"
    sequences = list(read_safetensors_export(tmp_path / "st"))
    assert len(sequences) == len(ref3)
    for seq, (rows, tokens) in zip(sequences, ref3, strict=True):
        assert torch.equal(seq["hidden_states"][:, 0].float(), rows)
        assert seq["token_ids"].tolist() == tokens.tolist()


def test_safetensors_all_phase_matches_vllm_include_output_tokens(tmp_path: Path) -> None:
    """vLLM's include_output_tokens saves all_token_ids[:-1]: prompt + outputs but the last."""
    store = make_store(tmp_path / "s", shapes=[(4, [3])])
    export_safetensors(store, tmp_path / "st", layers=[1], phase="all", progress=False)
    (seq,) = read_safetensors_export(tmp_path / "st")
    req = next(iter(store.requests))
    assert seq["token_ids"].tolist() == (req.prompt_token_ids + req.output_token_ids)[:-1]
    assert seq["completion"] == 0 and seq["store_id"] == req.store_id


def test_requests_missing_a_layer_are_left_out_and_named(tmp_path: Path, caplog) -> None:
    path = tmp_path / "s"
    make_store(path, shapes=[(3, [2]), (4, [2])])
    store = ActivationStore.for_writing(path, META)  # a second run capturing layer 1 only
    store.add(fake_request(7, 5, [2], layers=(1,)))
    store.flush()
    store.close()
    store = ActivationStore.open(path)
    with caplog.at_level(logging.WARNING, logger="probehook.store.export"):
        export_safetensors(store, tmp_path / "st", layers=[1, 3], progress=False)
    manifest = json.loads((tmp_path / "st" / "manifest.json").read_text())
    (skipped,) = manifest["left_out"]["requests_missing_layers"]
    assert skipped.endswith("r7") and manifest["tokens"] == 7
    assert "left out" in caplog.text
    out = export_saelens(store, tmp_path / "sae", layer=3, context_size=1, progress=False)
    summary = json.loads((out / "probehook_export.json").read_text())
    assert summary["left_out"]["requests_missing_layers"] == [skipped]
    # layer 1 alone exports all three requests
    export_safetensors(store, tmp_path / "st1", layers=[1], progress=False)
    assert json.loads((tmp_path / "st1" / "manifest.json").read_text())["tokens"] == 12


def test_errors_before_anything_is_written(f32_store, tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "out"
    with pytest.raises(ValueError, match=r"not in the store.*captured layers \[1, 3\]"):
        export_saelens(f32_store, target, layer=2, context_size=4)
    with pytest.raises(ValueError, match=r"not in the store.*\[1, 3\]"):
        export_safetensors(f32_store, target, layers=[1, 5])
    with pytest.raises(ValueError, match="context_size=0"):
        export_saelens(f32_store, target, layer=1, context_size=0)
    with pytest.raises(ValueError, match="valid phases"):
        export_saelens(f32_store, target, layer=1, context_size=2, phase="middle")
    with pytest.raises(ValueError, match="packing"):
        export_saelens(f32_store, target, layer=1, context_size=2, packing="pad")
    with pytest.raises(ValueError, match="No context of 99 tokens"):
        export_saelens(f32_store, target, layer=1, context_size=99)
    assert not target.exists() and list(tmp_path.iterdir()) == []

    decode_only = tmp_path / "d"
    store = ActivationStore.for_writing(decode_only, META)
    r = fake_request(0, 3, [2])
    r.blocks = [b for b in r.blocks if b.phase == "decode"]
    store.add(r)
    store.close()
    with pytest.raises(ValueError, match=r"no prefill rows.*0 prefill and 2 decode rows"):
        export_saelens(decode_only, target, layer=1, context_size=1)
    assert not target.exists()

    target.mkdir()
    (target / "old").write_text("x")
    with pytest.raises(FileExistsError, match="Pick a new path"):
        export_saelens(f32_store, target, layer=1, context_size=2)
    with pytest.raises(FileExistsError, match="Pick a new path"):
        export_safetensors(f32_store, target, layers=[1])
    assert [p.name for p in target.iterdir()] == ["old"]

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is fine
    assert export_saelens(f32_store, empty, layer=1, context_size=2, progress=False) == empty

    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(MissingExtraError, match=r"pip install 'probehook\[hf\]'"):
        export_saelens(f32_store, tmp_path / "new", layer=1, context_size=2)


def test_a_failed_export_leaves_nothing_behind(f32_store, tmp_path: Path, monkeypatch) -> None:
    calls = {"n": 0}
    real = export_module._Reader.fill

    def failing(self, seq, out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk on fire")
        return real(self, seq, out)

    monkeypatch.setattr(export_module._Reader, "fill", failing)
    for export in (
        lambda: export_saelens(f32_store, tmp_path / "out", layer=1, context_size=2),
        lambda: export_safetensors(f32_store, tmp_path / "out", layers=[1], shard_tokens=4),
    ):
        calls["n"] = 0
        with pytest.raises(OSError, match="disk on fire"):
            export()
        assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary folder


def test_saelens_trainer_fits_on_the_export(tmp_path: Path) -> None:
    """SAELens 6.x trains from the folder with no conversion: its ActivationsStore feeds its
    SAETrainer (the docs/exports.md snippet, without a language model)."""
    from sae_lens import (
        ActivationsStore,
        SAETrainer,
        StandardTrainingSAE,
        StandardTrainingSAEConfig,
    )
    from sae_lens.config import SAETrainerConfig

    store = make_store(tmp_path / "s", shapes=[(40, [10])] * 8, extremes=False)
    out = export_saelens(store, tmp_path / "sae", layer=3, context_size=16, progress=False)
    act_store = ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name="blocks.3.hook_resid_post",
        hook_head_index=None,
        context_size=16,
        d_in=store.hidden_size,
        n_batches_in_buffer=4,
        total_training_tokens=512,
        store_batch_size_prompts=4,
        train_batch_size_tokens=64,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(out),
    )
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=store.hidden_size, d_sae=16))
    cfg = SAETrainerConfig(
        total_training_samples=512,
        train_batch_size_samples=64,
        lr_end=3e-5,
        n_batches_for_norm_estimate=2,
    )
    trainer = SAETrainer(cfg=cfg, sae=sae, data_provider=act_store)
    trained = trainer.fit()
    assert trainer.n_training_steps == 8 and torch.isfinite(trained.W_dec).all()


def test_safetensors_dtype_option_converts_bf16_exactly(bf16_store, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    (path,) = export_safetensors(
        bf16_store, tmp_path / "st", layers=[1], dtype=torch.float32, progress=False
    )
    hs = load_file(path)["hidden_states"]
    expected = torch.cat([r.prefill_hidden_states[1] for r in bf16_store.requests])
    assert hs.dtype == torch.float32 and torch.equal(hs[:, 0], expected.float())
    manifest = json.loads((tmp_path / "st" / "manifest.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["source"]["store_dtype"] == "bfloat16"


def test_segments_stored_out_of_completion_order(tmp_path: Path, monkeypatch) -> None:
    """A request whose completion 1 rows were stored before completion 0's: sequences follow
    the completions' order, so reads go back in the layer's rows (the row window re-reads)."""
    monkeypatch.setattr(export_module, "READ_BLOCK_BYTES", 2 * HIDDEN * 4)
    request = fake_request(0, 3, [4, 5], extremes=False)
    request.blocks.sort(key=lambda b: (b.layer, b.phase, -(b.completion or 0)))
    store = ActivationStore.for_writing(tmp_path / "s", META)
    store.add(request)
    store.close()
    store = ActivationStore.open(tmp_path / "s")
    export_safetensors(store, tmp_path / "st", layers=[3], phase="decode", progress=False)
    got = list(read_safetensors_export(tmp_path / "st"))
    assert [s["completion"] for s in got] == [0, 1]
    for seq, (rows, tokens) in zip(got, reference(store, 3, "decode"), strict=True):
        assert torch.equal(seq["hidden_states"][:, 0], rows)
        assert seq["token_ids"].tolist() == tokens.tolist()


def test_a_store_written_by_several_lanes(tmp_path: Path) -> None:
    """Several writers (lanes) into one store: rows still line up with their tokens."""
    path = tmp_path / "s"
    writers = {lane: ActivationStore.for_writing(path, META, lane=lane) for lane in ("b", "a")}
    for i, (prompt_len, outs) in enumerate(SHAPES):
        writers["ab"[i % 2]].add(fake_request(i, prompt_len, outs))
    for writer in writers.values():
        writer.close()
    root = ActivationStore.for_writing(path, META)  # and the root lane
    root.add(fake_request(9, 4, [2]))
    root.close()
    store = ActivationStore.open(path)
    assert len(store) == len(SHAPES) + 1
    out = export_saelens(store, tmp_path / "sae", layer=1, context_size=1, phase="all")
    rows, ids = drain(saelens_store(out, "blocks.1.hook_resid_post", 1, batch=1))
    seqs = reference(store, 1, "all")
    assert torch.equal(rows, torch.cat([r for r, _ in seqs]))
    assert ids.tolist() == torch.cat([t for _, t in seqs]).tolist()


def test_store_export_method_picks_the_format(f32_store, tmp_path: Path) -> None:
    from probehook.store import export_safetensors

    via_method = f32_store.export(tmp_path / "a", "safetensors", layers=[f32_store.layers[0]])
    direct = export_safetensors(f32_store, tmp_path / "b", layers=[f32_store.layers[0]])
    assert [p.name for p in via_method] == [p.name for p in direct]
    from safetensors.torch import load_file

    for a, b in zip(via_method, direct, strict=True):
        left, right = load_file(a), load_file(b)
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left)
    with pytest.raises(ValueError, match=r"format='hdf5'.*\['saelens', 'safetensors'\]"):
        f32_store.export(tmp_path / "c", "hdf5")


def test_export_options_are_named_when_missing_or_wrong(f32_store, tmp_path: Path) -> None:
    """Without its options an export used to raise Python's own TypeError from inside
    export_saelens(); now each missing option is named with its meaning and an example, and an
    option the format does not take is named with those it does (issue 38, store)."""
    with pytest.raises(TypeError, match=r"needs layer= \(the layer.*context_size= \(tokens"):
        f32_store.export(tmp_path / "a", format="saelens")
    with pytest.raises(TypeError, match=r"layers are \[1, 3\].*layer=1, context_size=128"):
        f32_store.export(tmp_path / "a", format="saelens", layer=1)
    with pytest.raises(TypeError, match=r"needs layers= \(the layers to stack"):
        f32_store.export(tmp_path / "a", format="safetensors")
    with pytest.raises(TypeError, match=r"takes no option\(s\) \['context_size'\]"):
        f32_store.export(tmp_path / "a", format="safetensors", layers=[1], context_size=8)
    assert not (tmp_path / "a").exists()


def test_cli_store_export_writes_what_the_method_writes(f32_store, tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file

    from probehook.cli import main

    root = str(f32_store.root)
    main(
        [
            "store",
            "export",
            root,
            str(tmp_path / "cli"),
            "--format",
            "safetensors",
            "--layers",
            "1,3",
        ]
    )
    direct = f32_store.export(tmp_path / "py", "safetensors", layers=[1, 3])
    shards = sorted((tmp_path / "cli").glob("*.safetensors"))
    assert [p.name for p in shards] == [p.name for p in direct]
    for a, b in zip(shards, direct, strict=True):
        left, right = load_file(a), load_file(b)
        assert all(torch.equal(left[k], right[k]) for k in right)
    main(
        [
            "store",
            "export",
            root,
            str(tmp_path / "sae"),
            "--format",
            "saelens",
            "--layer",
            "3",
            "--context-size",
            "4",
            "--phase",
            "all",
        ]
    )
    assert (tmp_path / "sae" / "dataset_info.json").exists()
    for argv, message in [
        (["--format", "saelens", "--layer", "3"], r"needs --context-size \(tokens per context"),
        (
            ["--format", "safetensors", "--layers", "1", "--packing", "concat"],
            r"takes no \['--packing'\]",
        ),
        (["--format", "safetensors", "--layers", "1", "--dtype", "float99"], "not a torch dtype"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["store", "export", root, str(tmp_path / "x"), *argv])
