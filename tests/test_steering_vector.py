"""Steering vectors without vLLM: validation, the file, the digest, and making one from a probe
or from a small activation store written with the real ActivationStore writer."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from probehook.errors import CaptureConfigError, ProbeError
from probehook.probes import LinearProbe
from probehook.steering import SteeringVector, mean_residual_norm
from probehook.steering.file import METADATA_KEY
from probehook.store import ActivationStore
from probehook.store.writer import PendingRequest, RowBlock

HIDDEN = 8
LAYERS = [1, 3]
META = {
    "model": "m",
    "model_fingerprint": "fp-steer",
    "dtype": "float32",
    "hidden_size": HIDDEN,
    "layers": LAYERS,
}


def vec(seed: int = 0, hidden: int = HIDDEN) -> torch.Tensor:
    return torch.randn(hidden, generator=torch.Generator().manual_seed(seed))


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vectors", "kwargs", "message"),
    [
        ({}, {}, "vectors is empty"),
        ([vec()], {}, "vectors must be a dict from layer index"),
        ({-1: vec()}, {}, "layer -1 is negative"),
        ({"3": vec()}, {}, r"layer '3' \(str\) is not an integer"),
        ({True: vec()}, {}, r"layer True \(bool\) is not an integer"),
        ({2.0: vec()}, {}, r"layer 2.0 \(float\) is not an integer"),
        ({2: torch.zeros(2, HIDDEN)}, {}, r"layer 2's vector has shape \(2, 8\); it must be 1-D"),
        ({2: torch.tensor(1.0)}, {}, r"layer 2's vector has shape \(\); it must be 1-D"),
        ({2: torch.zeros(0)}, {}, "layer 2's vector is empty"),
        ({1: vec(), 4: vec(hidden=6)}, {}, "layer 4's vector has 6 values but layer 1's has 8"),
        ({5: torch.tensor([0.0, float("nan"), 1.0])}, {}, "layer 5's vector has 1 NaN or inf"),
        ({7: np.array([1.0, np.inf])}, {}, r"layer 7's vector has 1 NaN or infinite value\(s\)"),
        ({7: np.array([1e300])}, {}, "layer 7's vector has 1 NaN or infinite"),  # f32 overflow
        ({1: torch.ones(3, dtype=torch.bool)}, {}, "layer 1's vector must be real numbers"),
        ({1: ["a", "b"]}, {}, "layer 1's vector must be"),
        ({1: vec()}, {"name": ""}, "name is the empty string"),
        ({1: vec()}, {"name": 3}, "name must be a string or None, got 3"),
        ({1: vec()}, {"model_fingerprint": 1}, "model_fingerprint must be a string"),
        ({1: vec()}, {"made_by": {"x": object()}}, "made_by must be JSON-serialisable"),
        ({1: vec()}, {"made_by": {"x": float("nan")}}, "made_by must be JSON-serialisable"),
        ({1: vec()}, {"made_by": ["method"]}, "made_by must be a dict"),
        ({1: vec(), torch.tensor(1): vec()}, {}, r"layer 1 is given twice \(as tensor\(1\)\)"),
    ],
)
def test_construction_errors_name_the_bad_value(vectors, kwargs, message) -> None:
    with pytest.raises(CaptureConfigError, match=message):
        SteeringVector(vectors, **kwargs)


def test_fields_inputs_and_copies() -> None:
    a = vec(1).double().numpy()
    b = vec(2).to(torch.bfloat16)
    v = SteeringVector(
        {np.int32(5): a, 2: b, 9: list(range(HIDDEN))},
        "mood",
        model_fingerprint="fp",
        made_by={"method": "by hand"},
    )
    assert v.name == "mood" and v.layers == (2, 5, 9) and v.hidden_size == HIDDEN
    assert v.model_fingerprint == "fp" and v.made_by == {"method": "by hand"}
    assert all(type(layer) is int for layer in v.layers)
    for layer, t in v.vectors.items():
        assert t.dtype == torch.float32 and t.shape == (HIDDEN,) and t.device.type == "cpu"
        assert torch.equal(t, v.vector(layer))
    assert torch.equal(v.vector(5), torch.from_numpy(a).float())
    assert torch.equal(v.vector(2), b.float())
    assert torch.equal(v.vector(np.int64(9)), torch.arange(HIDDEN, dtype=torch.float32))
    assert v.norm(5) == pytest.approx(float(np.linalg.norm(a.astype(np.float32))), rel=1e-6)
    # Immutable: neither the input nor the returned tensors alias the stored ones.
    digest = v.digest
    a[0] = 1e6
    v.vector(5)[0] = 1e6
    v.vectors[2][0] = 1e6
    v.made_by["method"] = "changed"
    assert v.digest == digest and v.vector(5)[0] != 1e6 and v.made_by["method"] == "by hand"
    with pytest.raises(KeyError, match=r"has no layer 4; its layers are \[2, 5, 9\]"):
        v.vector(4)
    text = repr(v)
    assert text.startswith("SteeringVector(name='mood', layers=[2, 5, 9], hidden=8, norm={2: ")
    assert "method='by hand'" in text


def test_scaled_and_with_name() -> None:
    v = SteeringVector({3: vec(3), 1: vec(1)}, "a", model_fingerprint="fp")
    s = v.scaled(2.5).scaled(np.float32(2))
    for layer in v.layers:
        assert torch.allclose(s.vector(layer), v.vector(layer) * 5, rtol=1e-6)
    assert s.made_by == {"scale": 5.0} and s.name == "a" and s.model_fingerprint == "fp"
    assert v.made_by == {} and "scale=5" in repr(s)
    assert torch.equal(v.scaled(0).vector(1), torch.zeros(HIDDEN))
    renamed = v.with_name("b")
    assert renamed.name == "b" and v.name == "a" and renamed.digest == v.digest
    assert v.with_name(None).name is None
    for bad, message in ((float("inf"), "factor=inf"), ("2", "factor must be a number")):
        with pytest.raises(CaptureConfigError, match=message):
            v.scaled(bad)
    with pytest.raises(CaptureConfigError, match=r"layer 1's vector has \d+ NaN or inf"):
        v.scaled(1e39)  # overflows float32
    with pytest.raises(CaptureConfigError, match="name is the empty string"):
        v.with_name("")


def test_digest_is_stable_and_content_sensitive() -> None:
    base = {1: torch.arange(4, dtype=torch.float32), 3: torch.ones(4)}
    v = SteeringVector(base, "x")
    # Pinned: the engine keys its vector table by this; a change in the formula must be noticed.
    # The documented formula, written out.
    h = hashlib.sha256(b"probehook-steering-v1\n")
    for layer in (1, 3):
        h.update(f"{layer}:4\n".encode() + base[layer].numpy().astype("<f4").tobytes())
    assert v.digest == h.hexdigest()
    assert v.digest == "1ce5f94de56fcc0b3ed028571703df10d47c7194c6581d07a267e0e00fb8bc10"
    same = SteeringVector({3: np.ones(4), 1: [0, 1, 2, 3]}, "other", made_by={"k": 1})
    assert same.digest == v.digest  # content only: order, name, made_by do not matter
    bumped = base[1].clone()
    bumped[2] = float(np.nextafter(np.float32(2), np.float32(3)))  # one ulp
    assert SteeringVector({1: bumped, 3: base[3]}).digest != v.digest
    assert SteeringVector({1: base[1], 4: base[3]}).digest != v.digest  # another layer
    assert SteeringVector({1: base[1]}).digest != v.digest
    assert v.scaled(-1).digest != v.digest
    assert len(v.digest) == 64 and int(v.digest, 16) >= 0


def test_check_model(caplog: pytest.LogCaptureFixture) -> None:
    v = SteeringVector({2: vec(), 30: vec()}, "v", model_fingerprint="fp-a")
    with pytest.raises(CaptureConfigError, match=r"has layer 30, but the model has 28 decoder"):
        v.check_model(28, HIDDEN, "fp-a")
    with pytest.raises(
        CaptureConfigError, match="hidden size 8, but the model's hidden size is 16"
    ):
        v.check_model(32, 16, "fp-a")
    with pytest.warns(UserWarning, match="fingerprint fp-a, but this model's is fp-b"):
        v.check_model(32, HIDDEN, "fp-b")
    assert "fp-b" in caplog.text
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v.check_model(31, HIDDEN, "fp-a")
        v.check_model(31, HIDDEN, None)
        SteeringVector({2: vec()}).check_model(3, HIDDEN, "fp-b")


def test_no_vllm_import() -> None:
    code = (
        "import sys, probehook.steering, probehook.steering.file; "
        "sys.exit(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- the file -------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_exact(tmp_path: Path) -> None:
    tricky = vec(4)
    tricky[0] = -0.0
    tricky[1] = 1e-45  # a subnormal
    v = SteeringVector(
        {12: tricky, 3: vec(5) * 1e4},
        "honesty",
        model_fingerprint="fp",
        made_by={"method": "mean_difference", "layer": 12, "nested": {"a": [1, 2]}},
    )
    path = v.save(tmp_path / "sub" / "v.safetensors")
    assert path == tmp_path / "sub" / "v.safetensors"
    assert [p.name for p in path.parent.iterdir()] == ["v.safetensors"]  # no .tmp left
    back = SteeringVector.load(path)
    assert back.layers == (3, 12) and back.name == "honesty" and back.model_fingerprint == "fp"
    assert back.made_by == v.made_by and back.digest == v.digest
    for layer in v.layers:
        assert torch.equal(back.vector(layer).view(torch.int32), v.vector(layer).view(torch.int32))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["layer.12", "layer.3"]
        header = json.loads(f.metadata()[METADATA_KEY])
    assert header["format_version"] == 1 and header["layers"] == [3, 12]
    assert header["hidden_size"] == HIDDEN and header["probehook_version"]
    assert SteeringVector.load(str(path)).with_name(None).name is None  # str paths too


def _safetensors(path: Path, tensors: dict, header: object | None, raw: str | None = None) -> Path:
    metadata = {} if header is None else {METADATA_KEY: raw or json.dumps(header)}
    save_file(tensors, str(path), metadata=metadata)
    return path


def _good_header(**changes) -> dict:
    header = {
        "format_version": 1,
        "name": "n",
        "layers": [2],
        "hidden_size": HIDDEN,
        "model_fingerprint": None,
        "made_by": {},
        "probehook_version": "0",
    }
    return header | changes


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    good = SteeringVector({2: vec()}, "n").save(tmp_path / "good.safetensors")
    data = good.read_bytes()
    cases: list[tuple[Path, str]] = []

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 5])
    cases.append((truncated, "is not a readable steering vector file .*truncated"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00not a safetensors file at all" * 3)
    cases.append((junk, "is not a readable steering vector file"))
    probe = LinearProbe(torch.randn(1, HIDDEN), torch.zeros(1), layer=2, kind="binary")
    probe_file = probe.save(tmp_path / "probe.safetensors")
    cases.append((probe_file, r"is a probe file \(LinearProbe.save\).*from_probe"))
    plain = _safetensors(tmp_path / "plain.safetensors", {"w": torch.zeros(2)}, None)
    cases.append((plain, "without 'probehook_steering' metadata"))
    bad_json = _safetensors(
        tmp_path / "badjson.safetensors", {"layer.2": vec()}, {}, raw="{not json"
    )
    cases.append((bad_json, "'probehook_steering' metadata is not JSON"))
    not_object = _safetensors(tmp_path / "list.safetensors", {"layer.2": vec()}, [1, 2])
    cases.append((not_object, "metadata is not a JSON object"))
    future = _safetensors(
        tmp_path / "v2.safetensors", {"layer.2": vec()}, _good_header(format_version=2)
    )
    cases.append((future, "format version 2, but this probehook reads version 1"))
    bad_layers = _safetensors(
        tmp_path / "layers.safetensors", {"layer.2": vec()}, _good_header(layers="2")
    )
    cases.append((bad_layers, "header's layers must be a list of integers, got '2'"))
    missing = _safetensors(
        tmp_path / "missing.safetensors", {"layer.2": vec()}, _good_header(layers=[2, 4])
    )
    cases.append((missing, r"do not match its header's layers \[2, 4\]: missing \['layer.4'\]"))
    extra = _safetensors(
        tmp_path / "extra.safetensors", {"layer.2": vec(), "layer.5": vec()}, _good_header()
    )
    cases.append((extra, r"unexpected \['layer.5'\]"))
    wrong_size = _safetensors(
        tmp_path / "size.safetensors", {"layer.2": vec(hidden=6)}, _good_header()
    )
    cases.append((wrong_size, r"'layer.2' has shape \(6,\) but the header says hidden size 8"))
    half = _safetensors(tmp_path / "half.safetensors", {"layer.2": vec().half()}, _good_header())
    cases.append((half, "'layer.2' is torch.float16, not float32"))
    nan = _safetensors(
        tmp_path / "nan.safetensors", {"layer.2": torch.full((HIDDEN,), np.nan)}, _good_header()
    )
    cases.append((nan, "holds an invalid steering vector: layer 2's vector has 8 NaN"))
    empty_name = _safetensors(
        tmp_path / "name.safetensors", {"layer.2": vec()}, _good_header(name="")
    )
    cases.append((empty_name, "invalid steering vector: name is the empty string"))

    for path, message in cases:
        with pytest.raises(CaptureConfigError, match=message) as info:
            SteeringVector.load(path)
        assert str(path) in str(info.value), path
    with pytest.raises(FileNotFoundError, match="No steering vector file at .*nothing.safetensors"):
        SteeringVector.load(tmp_path / "nothing.safetensors")


# -- from a probe ---------------------------------------------------------------------------


def _probe(kind: str = "binary", n_outputs: int = 1) -> LinearProbe:
    g = torch.Generator().manual_seed(11)
    names = {"binary": ["calm", "angry"], "multiclass": ["a", "b", "c"]}.get(kind)
    return LinearProbe(
        torch.randn(n_outputs, HIDDEN, generator=g),
        torch.randn(n_outputs, generator=g),
        layer=6,
        kind=kind,
        label_names=names,
        name="anger",
        mean=5 * torch.randn(HIDDEN, generator=g),
        std=torch.rand(HIDDEN, generator=g) * 3 + 0.2,  # far from 1: a missed fold shows
        model_fingerprint="fp-probe",
    )


def test_from_probe_direction_reproduces_the_logit() -> None:
    probe = _probe()
    raw = SteeringVector.from_probe(probe, unit=False)
    noise = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(1))
    rows = (probe.mean + 0.5 * probe.std * noise).double()
    p = probe.score(rows.float()).double()
    logit = torch.log(p) - torch.log1p(-p)  # from probe.score: the probe as applied
    offset = logit - rows @ raw.vector(6).double()  # the bias constant, same for every row
    assert float(logit.std()) > 1.0  # the rows span a real range of logits
    assert float((offset - offset.mean()).abs().max()) < 1e-3
    # The constant is the folded bias: b - (w / std) @ mean.
    w, b = probe.weight[0].double(), probe.bias.double()
    assert float(offset.mean()) == pytest.approx(
        float(b - (w / probe.std.double()) @ probe.mean.double()), abs=1e-3
    )
    unit = SteeringVector.from_probe(probe)
    assert unit.norm(6) == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(unit.vector(6) * raw.norm(6), raw.vector(6), rtol=1e-5, atol=1e-6)
    assert unit.layers == (6,) and unit.name == "anger" and unit.model_fingerprint == "fp-probe"
    assert unit.made_by == {
        "method": "probe",
        "probe_name": "anger",
        "layer": 6,
        "phase": "decode",
        "token": "last",
        "positive_label": "angry",
        "unit": True,
        "probe_norm": pytest.approx(raw.norm(6)),
    }
    assert SteeringVector.from_probe(probe, name="mine").name == "mine"


def test_from_probe_refuses_what_has_no_single_direction() -> None:
    with pytest.raises(CaptureConfigError, match="is a multiclass probe; only a binary"):
        SteeringVector.from_probe(_probe("multiclass", 3))
    with pytest.raises(CaptureConfigError, match="is a regression probe; only a binary"):
        SteeringVector.from_probe(_probe("regression"))
    with pytest.raises(CaptureConfigError, match="probe must be a LinearProbe, got str"):
        SteeringVector.from_probe("probe.safetensors")
    zero = LinearProbe(torch.zeros(1, HIDDEN), torch.zeros(1), layer=0, kind="binary", name="z")
    with pytest.raises(CaptureConfigError, match="weight is all zeros"):
        SteeringVector.from_probe(zero)
    assert SteeringVector.from_probe(zero, unit=False).norm(0) == 0.0


# -- from a store ---------------------------------------------------------------------------


def _request(i: int, n_outs: tuple[int, ...], prompt_len: int = 4) -> PendingRequest:
    """Rows centred on a per-request offset, so class means differ from the pooled mean."""
    g = torch.Generator().manual_seed(500 + i)
    record = {
        "id": f"q{i}",
        "prompt": f"prompt {i}",
        "prompt_token_ids": list(range(prompt_len)),
        "sampling_params": {"n": len(n_outs)},
        "completions": [
            {"index": c, "token_ids": list(range(50, 50 + n)), "text": "y" * n}
            | {"finish_reason": "length"}
            for c, n in enumerate(n_outs)
        ],
    }
    centre = 3 * torch.randn(HIDDEN, generator=g)
    blocks = []
    for layer in LAYERS:
        rows = centre + torch.randn(prompt_len, HIDDEN, generator=g)
        blocks.append(RowBlock("prefill", None, layer, 0, rows))
        for c, n in enumerate(n_outs):
            rows = centre + (layer + 1) * torch.randn(n, HIDDEN, generator=g)
            blocks.append(RowBlock("decode", c, layer, prompt_len - 1, rows))
    return PendingRequest(record, blocks)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict]:
    """Seven requests: q1 has two completions; rows kept by (store id, phase, layer)."""
    path = tmp_path_factory.mktemp("steer") / "store"
    shapes = [(3,), (2, 4), (5,), (1,), (3,), (2,), (4,)]
    requests = [_request(i, n) for i, n in enumerate(shapes)]
    kept = []  # per request: {(phase, layer): [rows of each block]}
    for r in requests:
        grouped: dict = {}
        for block in r.blocks:
            grouped.setdefault((block.phase, block.layer), []).append(block.rows)
        kept.append(grouped)
    store = ActivationStore.for_writing(path, META, shard_bytes=700)  # several shards
    try:
        ids = [store.add(r) for r in requests]
        store.flush()
    finally:
        store.close()
    return path, ids, dict(zip(ids, kept, strict=True))


def _hand_mean(rows: dict, ids: list[str], phase: str, layer: int, token: str) -> torch.Tensor:
    picked = []
    for sid in ids:
        for segment in rows[sid][(phase, layer)]:  # one per completion (decode)
            picked.append(segment[-1:] if token == "last" else segment)
    return torch.cat(picked).double().mean(dim=0)


@pytest.mark.parametrize(
    ("phase", "token"),
    [("decode", "all"), ("decode", "last"), ("prefill", "all"), ("prefill", "last")],
)
def test_from_store_is_the_difference_of_class_means(store_path, phase, token) -> None:
    path, ids, rows = store_path
    pos, neg = [ids[0], ids[1], ids[4]], [ids[2], ids[3]]
    v = SteeringVector.from_store(path, 3, pos, neg, phase=phase, token=token, name="contrast")
    expected = _hand_mean(rows, pos, phase, 3, token) - _hand_mean(rows, neg, phase, 3, token)
    assert v.layers == (3,) and v.name == "contrast" and v.model_fingerprint == "fp-steer"
    assert torch.allclose(v.vector(3).double(), expected, rtol=1e-5, atol=1e-5)
    n_rows = {
        "pos": sum(len(s) if token == "all" else 1 for i in pos for s in rows[i][(phase, 3)]),
        "neg": sum(len(s) if token == "all" else 1 for i in neg for s in rows[i][(phase, 3)]),
    }
    assert v.made_by == {
        "method": "mean_difference",
        "layer": 3,
        "phase": phase,
        "token": token,
        "n_positive_requests": 3,
        "n_negative_requests": 2,
        "n_positive_rows": n_rows["pos"],
        "n_negative_rows": n_rows["neg"],
        "store": str(path),
    }


def test_from_store_with_labels_like_linear_probe_fit(store_path) -> None:
    path, ids, rows = store_path
    by_ids = SteeringVector.from_store(path, 1, [ids[5], ids[6]], [ids[0]])
    expected = _hand_mean(rows, ids[5:7], "decode", 1, "all") - _hand_mean(
        rows, ids[:1], "decode", 1, "all"
    )
    assert torch.allclose(by_ids.vector(1).double(), expected, rtol=1e-5, atol=1e-5)
    # A dict: every request needs an entry; None and other labels are left out.
    labels = {sid: "other" for sid in ids} | {ids[5]: "yes", ids[6]: "yes", ids[0]: "no"}
    labels[ids[1]] = None
    with ActivationStore.open(path) as store:
        by_dict = SteeringVector.from_store(
            store, 1, labels=labels, positive_label="yes", negative_label="no"
        )
    assert by_dict.digest == by_ids.digest
    assert by_dict.made_by["positive_label"] == "yes" and by_dict.made_by["n_negative_rows"] == 3
    # A callable over the stored request; defaults True / False (1 / 0 match too).
    wanted = {ids[5]: 1, ids[6]: 1, ids[0]: 0}
    by_call = SteeringVector.from_store(
        path,
        1,
        labels=lambda r: r.store_id in ids[5:7] or (False if r.store_id == ids[0] else None),
    )
    assert by_call.digest == by_ids.digest
    by_ints = SteeringVector.from_store(path, 1, labels=lambda r: wanted.get(r.store_id))
    assert by_ints.digest == by_ids.digest
    # The label source is probes' own: its errors are ProbeError, as in LinearProbe.fit.
    with pytest.raises(ProbeError, match="labels has no entry for 1 of the 7 requests"):
        SteeringVector.from_store(path, 1, labels={sid: True for sid in ids[:6]})
    with pytest.raises(ProbeError, match=r"label key\(s\) are not store ids.*'nope'"):
        SteeringVector.from_store(path, 1, labels={"nope": True} | dict.fromkeys(ids, False))


def test_from_store_errors(store_path, caplog: pytest.LogCaptureFixture) -> None:
    path, ids, _ = store_path
    cases = [
        (([ids[0]], []), {}, "negative is empty"),
        (([], [ids[0]]), {}, "positive is empty"),
        (([ids[0], "ghost-1", "ghost-2"], [ids[1]]), {}, r"2 of the given ids are not store ids"),
        (
            ([ids[0], ids[1]], [ids[1]]),
            {},
            rf"1 id\(s\) are both positive and negative: \['{ids[1]}'\]",
        ),
        ((ids[0], [ids[1]]), {}, "positive must be a list of store ids"),
        (([ids[0]], None), {}, "from_store needs the two classes"),
        (([ids[0]], [ids[1]]), {"labels": {}}, "either positive=/negative= store ids or labels="),
        ((), {"labels": 3}, "labels must be a dict from store id to label or a callable"),
        ((), {"labels": lambda r: 1, "positive_label": 1, "negative_label": 1}, "are equal"),
        (([ids[0]], [ids[1]]), {"phase": "middle"}, "phase='middle'; valid phases"),
        (([ids[0]], [ids[1]]), {"token": "mean"}, "token='mean'; from_store averages rows"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(CaptureConfigError, match=message):
            SteeringVector.from_store(path, 3, *args, **kwargs)
    with pytest.raises(CaptureConfigError, match=r"ghost-1.*ghost-2"):
        SteeringVector.from_store(path, 3, [ids[0], "ghost-1", "ghost-2"], [ids[1]])
    with pytest.raises(
        CaptureConfigError, match=r"layer 2 is not in .*store; its layers are \[1, 3\]"
    ):
        SteeringVector.from_store(path, 2, [ids[0]], [ids[1]])
    with pytest.raises(CaptureConfigError, match="layer -1 is negative"):
        SteeringVector.from_store(path, -1, [ids[0]], [ids[1]])
    with pytest.raises(
        CaptureConfigError,
        match=r"labelled 'pos' \(positive_label\); the labels seen are \['False', 'True'\]",
    ):
        SteeringVector.from_store(
            path, 3, labels=lambda r: r.store_id == ids[0], positive_label="pos"
        )
    with pytest.raises(CaptureConfigError, match="labelled False"):
        SteeringVector.from_store(path, 3, labels=lambda r: True)


def test_from_store_warns_about_ids_without_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s"
    no_prefill = _request(20, (2,))
    no_prefill.blocks = [b for b in no_prefill.blocks if b.phase == "decode"]
    store = ActivationStore.for_writing(path, META)
    try:
        a, b, c = (
            store.add(_request(21, (2,))),
            store.add(_request(22, (3,))),
            store.add(no_prefill),
        )
        store.flush()
    finally:
        store.close()
    with pytest.raises(CaptureConfigError, match="none of the negative requests has prefill rows"):
        SteeringVector.from_store(path, 1, [a], [c], phase="prefill")
    with caplog.at_level(logging.WARNING, logger="probehook.steering.vector"):
        v = SteeringVector.from_store(path, 1, [a], [b, c], phase="prefill")
    assert v.made_by["n_negative_requests"] == 1
    assert (
        f"1 of the given requests have no prefill rows of layer 1 and are not used: ['{c}']"
        in caplog.text
    )


# -- scale helper ---------------------------------------------------------------------------


def test_mean_residual_norm(store_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, ids, rows = store_path
    every = torch.cat([s for sid in ids for s in rows[sid][("decode", 3)]]).double()
    norms = torch.linalg.vector_norm(every, dim=1)
    assert mean_residual_norm(path, 3) == pytest.approx(float(norms.mean()), rel=1e-9)
    with ActivationStore.open(path) as store:
        prefill = torch.cat([s for sid in ids for s in rows[sid][("prefill", 1)]]).double()
        got = mean_residual_norm(store, 1, phase="prefill", limit=len(prefill))
        assert got == pytest.approx(float(torch.linalg.vector_norm(prefill, dim=1).mean()))
        # Bounded: limit rows in 16 evenly spaced windows (here 16 windows of 1 row).
        n = len(every)
        starts = np.linspace(0, n - 1, 16).astype(np.int64)
        assert mean_residual_norm(store, 3, limit=16) == pytest.approx(
            float(norms[torch.from_numpy(starts)].mean()), rel=1e-9
        )
        from probehook.steering import vector as vector_module

        monkeypatch.setattr(vector_module, "BLOCK_BYTES", 4 * HIDDEN * 3)  # 3-row blocks
        assert mean_residual_norm(store, 3) == pytest.approx(float(norms.mean()), rel=1e-9)
        for bad, message in ((0, "limit must be a positive"), (True, "limit must be")):
            with pytest.raises(CaptureConfigError, match=message):
                mean_residual_norm(store, 3, limit=bad)
        with pytest.raises(CaptureConfigError, match="layer 0 is not in"):
            mean_residual_norm(store, 0)
        with pytest.raises(CaptureConfigError, match="phase='both'"):
            mean_residual_norm(store, 3, phase="both")
