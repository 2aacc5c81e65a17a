"""Linear probes without vLLM: the probe itself, its file, fitting on synthetic stores, sweeps.

The stores are written with the real ActivationStore writer. A linear signal is planted along
one direction at one layer, on top of a per-dimension offset and scale, so that a probe that
forgets its normalisation scores at chance.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from probehook.errors import ProbeError, ProbehookError
from probehook.probes import LinearProbe, SweepResult, sweep
from probehook.probes import rows as rows_module
from probehook.probes.rows import LabelSource, collect_examples
from probehook.store import ActivationStore
from probehook.store.writer import PendingRequest, RowBlock

HIDDEN = 16
LAYERS = [0, 1, 2]
SIGNAL_LAYER = 1
N_REQUESTS = 100
META = {
    "model": "synthetic",
    "model_fingerprint": "fp-synthetic",
    "dtype": "float32",
    "hidden_size": HIDDEN,
    "layers": LAYERS,
}
_g = torch.Generator().manual_seed(99)
DIRECTIONS = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=_g))[0].T[:3]  # orthonormal
SCALE = 0.5 + 3.0 * torch.rand(HIDDEN, generator=_g)
# Partly along the signal: a probe that skipped its normalisation would call every row one class.
OFFSET = 4.0 * torch.randn(HIDDEN, generator=_g) + 8.0 * DIRECTIONS[0] * SCALE


def synthetic_request(
    i: int,
    shift: torch.Tensor | None = None,
    *,
    prompt_len: int = 5,
    n_outs: tuple[int, ...] = (3,),
    hidden: int = HIDDEN,
    layers: list[int] = LAYERS,
    prefill: bool = True,
    noise: float = 1.0,
    dtype: torch.dtype = torch.float32,
    constant_dim: bool = False,
) -> PendingRequest:
    """A request whose rows are noise * SCALE + OFFSET, plus ``shift`` at SIGNAL_LAYER."""
    g = torch.Generator().manual_seed(1000 + i)
    record = {
        "id": f"r{i}",
        "prompt": f"prompt {i}",
        "prompt_token_ids": list(range(prompt_len)),
        "sampling_params": {"n": len(n_outs)},
        "completions": [
            {"index": c, "token_ids": list(range(100, 100 + n)), "text": "x" * n}
            | {"finish_reason": "length"}
            for c, n in enumerate(n_outs)
        ],
    }

    def rows(count: int, layer: int) -> torch.Tensor:
        out = noise * torch.randn(count, hidden, generator=g)
        if hidden == HIDDEN:
            out = out * SCALE + OFFSET
        if shift is not None and layer == SIGNAL_LAYER:
            out = out + shift
        if constant_dim:  # e.g. a dimension the model never uses
            out[:, -1] = 7.0
        return out.to(dtype)

    blocks = []
    for layer in layers:
        if prefill:
            blocks.append(RowBlock("prefill", None, layer, 0, rows(prompt_len, layer)))
        for c, n in enumerate(n_outs):
            blocks.append(RowBlock("decode", c, layer, prompt_len - 1, rows(n, layer)))
    return PendingRequest(record, blocks)


def write_store(path: Path, requests: list[PendingRequest], meta: dict = META) -> list[str]:
    store = ActivationStore.for_writing(path, meta)
    try:
        ids = [store.add(r) for r in requests]
        store.flush()
    finally:
        store.close()
    return ids


def planted_shift(label: int, strength: float = 2.5) -> torch.Tensor:
    return (2 * label - 1) * strength * DIRECTIONS[0] * SCALE


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """A binary label per request, readable at SIGNAL_LAYER only."""
    path = tmp_path_factory.mktemp("planted") / "store"
    labels = [i % 2 for i in range(N_REQUESTS)]
    ids = write_store(path, [synthetic_request(i, planted_shift(y)) for i, y in enumerate(labels)])
    return path, dict(zip(ids, labels, strict=True))


def random_probe(kind: str, n_outputs: int = 1, norm: bool = True, **kw) -> LinearProbe:
    g = torch.Generator().manual_seed(3)
    names = {"binary": ["neg", "pos"], "multiclass": [f"c{k}" for k in range(n_outputs)]}
    return LinearProbe(
        torch.randn(n_outputs, HIDDEN, generator=g),
        torch.randn(n_outputs, generator=g),
        layer=2,
        kind=kind,
        label_names=names.get(kind),
        mean=torch.randn(HIDDEN, generator=g) if norm else None,
        std=torch.rand(HIDDEN, generator=g) + 0.5 if norm else None,
        **kw,
    )


# -- the probe ------------------------------------------------------------------------------


def test_score_shapes_and_dtypes_per_kind() -> None:
    rows = torch.randn(7, HIDDEN)
    binary = random_probe("binary").score(rows)
    assert binary.shape == (7,) and binary.dtype == torch.float32
    assert bool(((binary > 0) & (binary < 1)).all())
    multi = random_probe("multiclass", 3).score(rows)
    assert multi.shape == (7, 3) and multi.dtype == torch.float32
    assert torch.allclose(multi.sum(dim=1), torch.ones(7))
    reg = random_probe("regression")
    value = reg.score(rows)
    w, b = reg.linear()
    assert value.shape == (7,) and torch.allclose(value, (rows @ w.T + b)[:, 0])
    # binary is the sigmoid of the logit of label_names[1]
    probe = random_probe("binary")
    w, b = probe.linear()
    assert torch.allclose(binary, torch.sigmoid(rows @ w.T + b)[:, 0])
    # one [hidden] row: the result for one row
    assert probe.score(rows[0]).shape == () and multi.shape[1:] == (3,)
    assert random_probe("multiclass", 3).score(rows[0]).shape == (3,)
    assert torch.allclose(probe.score(rows[0]), binary[0])


def test_score_torch_numpy_and_low_precision_inputs() -> None:
    probe = random_probe("multiclass", 4)
    rows = torch.randn(5, HIDDEN)
    as_torch = probe.score(rows)
    as_numpy = probe.score(rows.numpy())
    assert isinstance(as_numpy, np.ndarray) and as_numpy.dtype == np.float32
    assert isinstance(as_torch, torch.Tensor)
    np.testing.assert_allclose(as_numpy, as_torch.numpy(), rtol=1e-6)
    bf16 = rows.to(torch.bfloat16)
    got = probe.score(bf16)
    assert got.dtype == torch.float32
    assert torch.allclose(got, probe.score(bf16.float()))
    half = rows.numpy().astype(np.float16)
    np.testing.assert_allclose(probe.score(half), probe.score(half.astype(np.float32)))
    single = random_probe("binary").score(rows[0].numpy())
    assert np.ndim(single) == 0 and single.dtype == np.float32
    with pytest.raises(ProbeError, match="floating point"):
        probe.score(np.ones((2, HIDDEN), dtype=np.int64))


def test_linear_folds_the_normalisation() -> None:
    probe = random_probe("multiclass", 3)
    rows = torch.randn(9, HIDDEN, dtype=torch.float64) * 3 + 1
    mean, std = probe.mean.double(), probe.std.double()
    expected = ((rows - mean) / std) @ probe.weight.double().T + probe.bias.double()
    w, b = probe.linear()
    assert w.dtype == b.dtype == torch.float32 and w.shape == (3, HIDDEN) and b.shape == (3,)
    assert torch.allclose(rows.float() @ w.T + b, expected.float(), rtol=1e-4, atol=1e-4)
    bare = random_probe("binary", norm=False)
    w, b = bare.linear()
    assert torch.equal(w, bare.weight) and torch.equal(b, bare.bias)


def test_hidden_size_mismatch_names_both_sizes() -> None:
    probe = random_probe("binary")
    with pytest.raises(ProbeError, match=f"hidden size 12 but this probe expects {HIDDEN}"):
        probe.score(torch.randn(3, 12))
    with pytest.raises(ProbeError, match=r"raw outputs must be \[rows, 1\]"):
        probe.activate(torch.randn(3, 2))


def test_constructor_validates_with_clear_messages() -> None:
    w, b = torch.randn(1, HIDDEN), torch.zeros(1)
    with pytest.raises(ProbeError, match=r"kind='logistic'; valid kinds are \('binary'"):
        LinearProbe(w, b, layer=0, kind="logistic")
    with pytest.raises(ProbeError, match=r"bias has shape \(2,\) but weight \(1, 16\)"):
        LinearProbe(w, torch.zeros(2), layer=0, kind="binary")
    with pytest.raises(ProbeError, match="one output"):
        LinearProbe(torch.randn(2, HIDDEN), torch.zeros(2), layer=0, kind="binary")
    with pytest.raises(ProbeError, match="needs 3 label_names, got 2"):
        LinearProbe(torch.randn(3, HIDDEN), torch.zeros(3), layer=0, kind="multiclass",
                    label_names=["a", "b"])  # fmt: skip
    with pytest.raises(ProbeError, match=r"mean has shape \(4,\) but weight \(1, 16\)"):
        LinearProbe(w, b, layer=0, kind="binary", mean=torch.zeros(4))
    with pytest.raises(ProbeError, match="std must be positive"):
        LinearProbe(w, b, layer=0, kind="binary", std=torch.zeros(HIDDEN))
    with pytest.raises(ProbeError, match="NaN"):
        LinearProbe(w * float("nan"), b, layer=0, kind="binary")
    with pytest.raises(ProbeError, match=r"phase='middle'; valid phases"):
        LinearProbe(w, b, layer=0, kind="binary", phase="middle")
    with pytest.raises(ProbeError, match=r"token='first'; valid values"):
        LinearProbe(w, b, layer=0, kind="binary", token="first")
    assert issubclass(ProbeError, ProbehookError) and issubclass(ProbeError, ValueError)


def test_check_model(caplog: pytest.LogCaptureFixture) -> None:
    probe = random_probe("binary", model_fingerprint="fp-a")
    with pytest.raises(ProbeError, match=f"hidden size {HIDDEN}, but the model's hidden size is 8"):
        probe.check_model(8, "fp-a")
    with pytest.warns(UserWarning, match="fp-a.*fp-b"), caplog.at_level(logging.WARNING):
        probe.check_model(HIDDEN, "fp-b")
    assert "fp-b" in caplog.text
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe.check_model(HIDDEN, "fp-a")
        probe.check_model(HIDDEN, None)
        random_probe("binary").check_model(HIDDEN, "fp-b")


def test_repr_is_readable(planted: tuple[Path, dict[str, int]]) -> None:
    path, labels = planted
    probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, name="truth", progress=False)
    text = repr(probe)
    for part in ("name='truth'", "layer=1", "kind='binary'", "hidden=16", "labels=['0', '1']"):
        assert part in text, text
    assert "accuracy=" in text and "roc_auc=" in text


# -- the file -------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_exact(tmp_path: Path) -> None:
    probe = LinearProbe(
        torch.randn(3, HIDDEN),
        torch.randn(3),
        layer=5,
        kind="multiclass",
        label_names=["a", "b", "c"],
        phase="prefill",
        token="mean",
        name="topic",
        mean=torch.randn(HIDDEN),
        std=torch.rand(HIDDEN) + 0.1,
        model_fingerprint="fp-x",
        metrics={"accuracy": np.float64(0.75), "n_test": np.int64(12), "roc_auc": float("nan")},
    )
    loaded = LinearProbe.load(probe.save(tmp_path / "p.safetensors"))
    for attr in ("weight", "bias", "mean", "std"):
        assert torch.equal(getattr(loaded, attr), getattr(probe, attr)), attr
    for attr in ("layer", "kind", "label_names", "phase", "token", "name", "model_fingerprint"):
        assert getattr(loaded, attr) == getattr(probe, attr), attr
    assert loaded.metrics == {"accuracy": 0.75, "n_test": 12, "roc_auc": None}
    rows = torch.randn(4, HIDDEN)
    assert torch.equal(loaded.score(rows), probe.score(rows))
    bare = random_probe("regression", norm=False)
    again = LinearProbe.load(bare.save(tmp_path / "r.safetensors"))
    assert again.mean is None and again.std is None and again.label_names is None
    assert not list(tmp_path.glob("*.tmp"))


def test_file_is_safetensors_with_json_metadata(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = random_probe("binary").save(tmp_path / "p.safetensors")
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["bias", "mean", "std", "weight"]
        header = json.loads(f.metadata()["probehook_probe"])
    assert header["format_version"] == 1 and header["kind"] == "binary"
    assert header["label_names"] == ["neg", "pos"] and header["hidden_size"] == HIDDEN


def test_load_refuses_damaged_or_foreign_files(tmp_path: Path) -> None:
    good = random_probe("binary").save(tmp_path / "good.safetensors")
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-7])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a probe" * 10)
    bad_json = tmp_path / "bad_json.safetensors"
    save_file({"weight": torch.zeros(1, 4), "bias": torch.zeros(1)}, str(bad_json),
              metadata={"probehook_probe": "{not json"})  # fmt: skip
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(1, 4)}, str(foreign))
    newer = tmp_path / "newer.safetensors"
    save_file({"weight": torch.zeros(1, 4), "bias": torch.zeros(1)}, str(newer),
              metadata={"probehook_probe": json.dumps({"format_version": 99})})  # fmt: skip
    invalid = tmp_path / "invalid.safetensors"
    save_file({"weight": torch.zeros(1, 4), "bias": torch.zeros(1)}, str(invalid),
              metadata={"probehook_probe": json.dumps({"format_version": 1, "layer": 0,
                                                       "kind": "nope"})})  # fmt: skip
    cases = {
        truncated: "truncated",
        garbage: "not a readable probe file",
        bad_json: "not JSON",
        foreign: "without 'probehook_probe' metadata",
        newer: "format version 99",
        invalid: "invalid probe.*kind='nope'",
    }
    for path, reason in cases.items():
        with pytest.raises(ProbeError, match=reason) as info:
            LinearProbe.load(path)
        assert str(path) in str(info.value), info.value
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        LinearProbe.load(tmp_path / "missing.safetensors")


# -- reading rows from a store --------------------------------------------------------------


def test_collect_examples_last_mean_all_with_n_completions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Completions of different lengths (one of a single row), blocks of 3 rows: segments
    # straddle blocks, and a request's next completion starts where its previous one started.
    requests = [synthetic_request(i, n_outs=(3, 1, 4)) for i in range(4)]
    ids = write_store(tmp_path / "s", requests)
    store = ActivationStore.open(tmp_path / "s")
    monkeypatch.setattr(rows_module, "BLOCK_BYTES", 3 * 4 * HIDDEN)
    labels = LabelSource({sid: k % 2 for k, sid in enumerate(ids)} | {ids[2]: None})
    kept = [sid for sid in ids if sid != ids[2]]
    per_completion = [
        (sid, store[sid].completion_hidden_states(c)[SIGNAL_LAYER])
        for sid in kept
        for c in range(3)
    ]
    last = collect_examples(store, SIGNAL_LAYER, "decode", "last", labels, progress=False)
    assert list(last.request_ids) == [sid for sid, _ in per_completion]
    assert torch.equal(torch.from_numpy(last.x), torch.stack([r[-1] for _, r in per_completion]))
    assert last.y == [ids.index(sid) % 2 for sid, _ in per_completion]
    mean = collect_examples(store, SIGNAL_LAYER, "decode", "mean", labels, progress=True)
    expected = torch.stack([r.double().mean(0) for _, r in per_completion]).float()
    assert torch.allclose(torch.from_numpy(mean.x), expected, atol=1e-6)
    assert list(mean.request_ids) == list(last.request_ids)
    assert "rows" in capsys.readouterr().err  # progress bar over many blocks
    every = collect_examples(store, SIGNAL_LAYER, "prefill", "all", labels, progress=False)
    rows = torch.cat([store[sid].prefill_hidden_states[SIGNAL_LAYER] for sid in kept])
    assert torch.equal(torch.from_numpy(every.x), rows)
    assert list(every.request_ids) == [sid for sid in kept for _ in range(5)]
    assert capsys.readouterr().err == ""


def test_bfloat16_store_rows_become_float32(tmp_path: Path) -> None:
    requests = [synthetic_request(i, planted_shift(i % 2), dtype=torch.bfloat16) for i in range(40)]
    ids = write_store(tmp_path / "s", requests, meta={**META, "dtype": "bfloat16"})
    store = ActivationStore.open(tmp_path / "s")
    labels = {sid: k % 2 for k, sid in enumerate(ids)}
    got = collect_examples(store, 1, "prefill", "last", LabelSource(labels), progress=False)
    assert got.x.dtype == np.float32
    expected = torch.stack([store[sid].prefill_hidden_states[1][-1].float() for sid in ids])
    assert torch.equal(torch.from_numpy(got.x), expected)
    probe = LinearProbe.fit(store, 1, labels, progress=False)
    assert probe.metrics["accuracy"] > 0.9


# -- fitting --------------------------------------------------------------------------------


def test_fit_finds_the_planted_signal(planted: tuple[Path, dict[str, int]]) -> None:
    path, labels = planted
    probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, progress=False)
    m = probe.metrics
    assert m["accuracy"] > 0.9 and m["roc_auc"] > 0.95, m
    assert probe.kind == "binary" and probe.label_names == ["0", "1"]
    assert (probe.layer, probe.phase, probe.token) == (SIGNAL_LAYER, "prefill", "last")
    assert probe.model_fingerprint == "fp-synthetic"
    assert m["n_test_requests"] == 20 and m["n_train_requests"] == 80
    assert m["n_test"] == 20 and m["n_train"] == 80  # token="last": one row per request
    assert m["seed"] == 0 and m["test_size"] == 0.2
    # The metrics measure the probe as saved: recompute them from probe.score on raw rows.
    store = ActivationStore.open(path)
    rows = torch.stack(
        [store[sid].prefill_hidden_states[SIGNAL_LAYER][-1] for sid in probe.split.test]
    )
    truth = np.array([labels[sid] for sid in probe.split.test])
    assert np.mean((probe.score(rows.numpy()) > 0.5) == truth) == m["accuracy"]
    # Normalised with the training requests' rows only.
    train_rows = torch.stack(
        [store[sid].prefill_hidden_states[SIGNAL_LAYER][-1] for sid in probe.split.train]
    ).double()
    assert torch.allclose(probe.mean.double(), train_rows.mean(0), atol=1e-5)
    assert torch.allclose(probe.std.double(), train_rows.std(0, unbiased=False), atol=1e-5)
    # Noise layers and shuffled labels score about chance.
    noise = LinearProbe.fit(path, 0, labels, progress=False)
    assert noise.metrics["accuracy"] < 0.8, noise.metrics
    shuffled = dict(
        zip(labels, np.random.default_rng(0).permutation(list(labels.values())), strict=True)
    )
    chance = LinearProbe.fit(path, SIGNAL_LAYER, shuffled, progress=False)
    assert chance.metrics["accuracy"] < 0.8, chance.metrics


def test_fit_reads_decode_rows_and_mean_token(planted: tuple[Path, dict[str, int]]) -> None:
    path, labels = planted
    for token, rows_per_request in (("last", 1), ("mean", 1), ("all", 3)):
        probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, token=token, phase="decode",
                                progress=False)  # fmt: skip
        m = probe.metrics
        assert m["n_train"] + m["n_test"] == rows_per_request * N_REQUESTS, (token, m)
        assert m["accuracy"] > 0.9, (token, m)
        assert probe.token == token and probe.phase == "decode"


def test_split_is_by_request(planted: tuple[Path, dict[str, int]]) -> None:
    path, labels = planted
    probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, token="all", progress=False)
    train, test = set(probe.split.train), set(probe.split.test)
    assert not train & test and train | test == set(labels)
    assert len(test) == probe.metrics["n_test_requests"] == 20
    assert probe.metrics["n_test"] == 5 * len(test)  # every prefill row of the test requests
    # Stratified: both classes held out equally.
    assert sorted(labels[sid] for sid in test) == [0] * 10 + [1] * 10
    again = LinearProbe.fit(path, 0, labels, token="all", progress=False)
    assert again.split == probe.split  # the same seed holds out the same requests
    other = LinearProbe.fit(path, 0, labels, token="all", seed=1, progress=False)
    assert set(other.split.test) != test


def test_row_split_would_score_memorisation(tmp_path: Path) -> None:
    """Each request's rows sit near its own random point and labels are random: only a split
    that puts rows of one request on both sides can score well."""
    hidden, n = 128, 100
    centers = torch.randn(n, hidden, generator=torch.Generator().manual_seed(5))
    requests = [
        synthetic_request(i, centers[i], hidden=hidden, noise=0.05, prefill=False, n_outs=(4,))
        for i in range(n)
    ]
    ids = write_store(tmp_path / "s", requests, meta={**META, "hidden_size": hidden})
    labels = dict(zip(ids, np.random.default_rng(1).integers(0, 2, n).tolist(), strict=True))
    probe = LinearProbe.fit(tmp_path / "s", SIGNAL_LAYER, labels, token="all", phase="decode",
                            progress=False)  # fmt: skip
    assert probe.metrics["accuracy"] < 0.8, probe.metrics


def test_labels_callable_and_none_leaves_requests_out(planted: tuple[Path, dict[str, int]]) -> None:
    path, labels = planted
    calls: list[str] = []

    def label(request) -> str | None:
        calls.append(request.store_id)
        number = int(request.prompt.split()[1])
        return None if number >= 60 else ("even", "odd")[number % 2]

    probe = LinearProbe.fit(path, SIGNAL_LAYER, label, progress=False)
    assert len(calls) == N_REQUESTS
    assert probe.label_names == ["even", "odd"]
    assert probe.metrics["n_train_requests"] + probe.metrics["n_test_requests"] == 60
    assert probe.metrics["accuracy"] > 0.9


def test_fit_errors(planted: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    path, labels = planted
    store = ActivationStore.open(path)

    def fails(match: str, *args, **kwargs) -> str:
        with pytest.raises(ProbeError, match=match) as info:
            LinearProbe.fit(*args, **{"progress": False, **kwargs})
        return str(info.value)

    fails(r"layer 7 is not in .*its layers are \[0, 1, 2\]", store, 7, labels)
    ids = list(labels)
    partial = {sid: labels[sid] for sid in ids[7:]}
    message = fails("no entry for 7 of the 100 requests", store, 1, partial)
    assert repr(ids[0]) in message and ", ..." in message and "None" in message
    message = fails("2 label key.s. are not store ids", store, 1, {**labels, "r1": 0, "x": 1})
    assert "'r1'" in message
    fails("every labelled request has the label 1", store, 1, dict.fromkeys(ids, 1))
    few = {sid: (labels[sid] if k < 2 else None) for k, sid in enumerate(ids)}
    fails("too few requests to split: 2 labelled", store, 1, few, test_size=0.6)
    fails("too few requests", store, 1, labels, test_size=100)
    fails(r"a fraction must be in \(0, 1\)", store, 1, labels, test_size=1.5)
    fails(r"token='first'; valid values are \('last', 'mean', 'all'\)", store, 1, labels,
          token="first")  # fmt: skip
    fails(r"phase='middle'; valid phases are \('prefill', 'decode'\)", store, 1, labels,
          phase="middle")  # fmt: skip
    fails("every request .* has the label None", store, 1, dict.fromkeys(ids))
    fails("continuous numbers .*Ridge", store, 1, {sid: k / 7 for k, sid in enumerate(ids)})
    fails("labels must be a dict .* or a callable", store, 1, [0, 1])
    fails(r"labels\(store\[.*\]\) raised KeyError", store, 1, lambda r: {}[r.store_id])

    from sklearn.cluster import KMeans
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    pipe = make_pipeline(StandardScaler(), LogisticRegression())
    fails("Pipeline; pass its final linear estimator alone", store, 1, labels, estimator=pipe)
    fails("must be an instance", store, 1, labels, estimator=LogisticRegression)
    fails("neither a scikit-learn classifier nor regressor", store, 1, labels, estimator=KMeans())
    decode_only = tmp_path / "decode_only"
    only_ids = write_store(decode_only, [synthetic_request(i, prefill=False) for i in range(4)])
    fails(
        "no prefill rows of layer 1 .*include_prefill", decode_only, 1, dict.fromkeys(only_ids, 0)
    )


def test_multiclass_fit(tmp_path: Path) -> None:
    names = ["apple", "banana", "cherry"]
    classes = [i % 3 for i in range(120)]
    requests = [synthetic_request(i, 3.0 * DIRECTIONS[c] * SCALE) for i, c in enumerate(classes)]
    ids = write_store(tmp_path / "s", requests)
    labels = {sid: names[c] for sid, c in zip(ids, classes, strict=True)}
    probe = LinearProbe.fit(tmp_path / "s", SIGNAL_LAYER, labels, progress=False)
    assert probe.kind == "multiclass" and probe.n_outputs == 3 and probe.label_names == names
    assert probe.metrics["accuracy"] > 0.9 and "roc_auc" not in probe.metrics
    assert probe.score(torch.randn(2, HIDDEN)).shape == (2, 3)


def test_regression_fit(tmp_path: Path) -> None:
    from sklearn.linear_model import Ridge

    targets = np.random.default_rng(2).uniform(-1, 1, 80)
    requests = [
        synthetic_request(i, 4.0 * float(t) * DIRECTIONS[0] * SCALE) for i, t in enumerate(targets)
    ]
    ids = write_store(tmp_path / "s", requests)
    labels = dict(zip(ids, targets.tolist(), strict=True))
    probe = LinearProbe.fit(tmp_path / "s", SIGNAL_LAYER, labels, token="mean", phase="decode",
                            estimator=Ridge(), progress=False)  # fmt: skip
    assert probe.kind == "regression" and probe.label_names is None
    assert probe.metrics["r2"] > 0.8 and probe.metrics["mse"] < 0.1, probe.metrics
    assert "accuracy" not in probe.metrics
    assert probe.score(torch.randn(3, HIDDEN)).shape == (3,)


@pytest.mark.parametrize(
    "estimator_name", ["RidgeClassifier", "LinearSVC", "LinearDiscriminantAnalysis"]
)
def test_custom_linear_estimators(
    planted: tuple[Path, dict[str, int]], estimator_name: str
) -> None:
    import sklearn.discriminant_analysis
    import sklearn.linear_model
    import sklearn.svm

    modules = (sklearn.linear_model, sklearn.svm, sklearn.discriminant_analysis)
    estimator = next(getattr(m, estimator_name) for m in modules if hasattr(m, estimator_name))()
    path, labels = planted
    probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, estimator=estimator, progress=False)
    assert probe.kind == "binary" and probe.metrics["accuracy"] > 0.9, probe.metrics
    assert not hasattr(estimator, "coef_")  # the caller's estimator is left unfitted


def test_constant_feature_is_standardised_safely(tmp_path: Path) -> None:
    requests = [synthetic_request(i, planted_shift(i % 2), constant_dim=True) for i in range(40)]
    ids = write_store(tmp_path / "s", requests)
    labels = {sid: k % 2 for k, sid in enumerate(ids)}
    probe = LinearProbe.fit(tmp_path / "s", SIGNAL_LAYER, labels, progress=False)
    assert probe.std[-1] > 0 and probe.metrics["accuracy"] > 0.9
    assert bool(torch.isfinite(probe.linear()[0]).all())


def test_fit_without_standardisation(planted: tuple[Path, dict[str, int]]) -> None:
    path, labels = planted
    probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, standardize=False, progress=False)
    assert probe.mean is None and probe.std is None
    assert probe.metrics["accuracy"] > 0.9


def test_fitted_probe_round_trips_with_metrics_and_split(
    planted: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    path, labels = planted
    probe = LinearProbe.fit(path, SIGNAL_LAYER, labels, progress=False)
    loaded = LinearProbe.load(probe.save(tmp_path / "p.safetensors"))
    assert loaded.metrics == probe.metrics and loaded.split == probe.split
    rows = ActivationStore.open(path).layer(SIGNAL_LAYER, "prefill")[:10]
    assert torch.equal(loaded.score(rows), probe.score(rows))


# -- sweep ----------------------------------------------------------------------------------


def test_sweep_finds_the_planted_layer(
    planted: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    path, labels = planted
    result = sweep(path, labels=labels, progress=False)
    assert isinstance(result, SweepResult)
    assert [r.layer for r in result.rows] == LAYERS and sorted(result.probes) == LAYERS
    assert result.best.layer == SIGNAL_LAYER and result.best is result.probes[SIGNAL_LAYER]
    row = result.rows[SIGNAL_LAYER]
    assert row.accuracy == result.best.metrics["accuracy"] and row.roc_auc is not None
    text = str(result)
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "accuracy", "roc_auc", "n_train", "n_test"]
    assert [line.split()[0] for line in lines[1:]] == [str(layer) for layer in LAYERS]
    assert lines[1 + SIGNAL_LAYER].endswith("best")
    assert len({len(line) for line in lines[:-1] if not line.endswith("best")}) <= 2
    png = result.plot(tmp_path / "sweep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    only = sweep(path, [2, 0], labels=labels, progress=False)
    assert [r.layer for r in only.rows] == [0, 2]
    with pytest.raises(ProbeError, match=r"layer\(s\) \[5\] are not in"):
        sweep(path, [1, 5], labels=labels, progress=False)


def test_sweep_calls_label_function_once_per_request(
    planted: tuple[Path, dict[str, int]],
) -> None:
    path, labels = planted
    calls: list[str] = []

    def label(request) -> int:
        calls.append(request.store_id)
        return labels[request.store_id]

    result = sweep(path, [0, 1], labels=label, progress=False)
    assert len(calls) == N_REQUESTS and result.best.layer == SIGNAL_LAYER


def test_regression_sweep_picks_best_r2(tmp_path: Path) -> None:
    from sklearn.linear_model import Ridge

    targets = np.random.default_rng(3).uniform(-1, 1, 60)
    requests = [
        synthetic_request(i, 5.0 * float(t) * DIRECTIONS[1] * SCALE) for i, t in enumerate(targets)
    ]
    ids = write_store(tmp_path / "s", requests)
    labels = dict(zip(ids, targets.tolist(), strict=True))
    result = sweep(tmp_path / "s", labels=labels, estimator=Ridge(), progress=False)
    assert result.best.layer == SIGNAL_LAYER and "r2" in str(result).splitlines()[0]
    assert result.rows[SIGNAL_LAYER].accuracy is None
    assert result.plot(tmp_path / "r2.png").is_file()


# -- packaging ------------------------------------------------------------------------------


def test_probes_import_neither_vllm_nor_sklearn() -> None:
    code = (
        "import sys, probehook.probes, probehook\n"
        "probehook.LinearProbe\n"
        "assert 'vllm' not in sys.modules, 'vllm'\n"
        "assert 'sklearn' not in sys.modules, 'sklearn'\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
