"""probehook.SAE read from SAELens's own saved folders, against SAELens's ``encode``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sae_oracle import ARCHITECTURES, assert_features_match, make_saelens_sae, oracle
from safetensors.torch import save_file

from probehook import SAE
from probehook.saes import SAEError, SAEFeatures, layer_of_hook
from probehook.saes import files as sae_files
from probehook.saes.files import (
    SAMPLE_BYTES,
    SAMPLES_PER_TENSOR,
    fingerprint_of,
    legacy_fingerprint_of,
    matches_fingerprint,
)

D_IN, D_SAE = 32, 96


def _rows(n: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("norm", ["none", "layer_norm", "constant_norm_rescale"])
def test_encode_and_top_k_equal_saelens(tmp_path, arch, norm):
    extra = {"k": 12} if arch in ("topk", "abstopk") else {}
    folder = make_saelens_sae(
        arch,
        tmp_path / arch,
        D_IN,
        D_SAE,
        "blocks.2.hook_resid_post",
        seed=3,
        normalize_activations=norm,
        **extra,
    )
    sae = SAE.load(folder)
    assert (sae.architecture, sae.layer, sae.d_in, sae.d_sae) == (arch, 2, D_IN, D_SAE)
    lens = oracle(folder)
    rows = _rows()
    torch.testing.assert_close(sae.encode(rows), lens.encode(rows), rtol=1e-5, atol=1e-5)
    for k in (1, 8, 40):
        f = sae.top_k(rows, k)
        assert f.indices.shape == (64, k) and f.values.dtype == torch.float32
        assert_features_match(f.indices, f.values, f.l0, lens, rows, k)
    assert (sae.top_k(rows, 8).l0 > 0).any()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("norm", ["none", "layer_norm"])
def test_activations_at_a_few_features_equal_the_full_encode(tmp_path, arch, norm):
    """What the clamp op reads (probehook.saes.encode.activations_at): a few features'
    activations, from their encoder columns alone where the architecture allows, equal to
    the full encode's columns."""
    from probehook.saes.encode import activations_at

    extra = {"k": 12} if arch in ("topk", "abstopk") else {}
    folder = make_saelens_sae(arch, tmp_path / arch, D_IN, D_SAE, "blocks.2.hook_resid_post",
                              seed=6, normalize_activations=norm, **extra)  # fmt: skip
    sae = SAE.load(folder)
    rows = _rows(40)
    dense = sae.encode(rows)
    features = torch.tensor([0, 5, 17, D_SAE - 1])
    got = activations_at(sae.weights, rows, features)
    torch.testing.assert_close(got, dense[:, features], rtol=1e-5, atol=1e-5)
    assert bool((got > 0).any())  # some of them are on: the comparison is not all zeros


def test_topk_rescale_and_no_b_dec(tmp_path):
    folder = make_saelens_sae(
        "topk",
        tmp_path / "t",
        D_IN,
        D_SAE,
        "blocks.1.hook_resid_post",
        k=10,
        rescale_acts_by_decoder_norm=True,
        apply_b_dec_to_input=False,
    )
    sae, lens, rows = SAE.load(folder), oracle(folder), _rows()
    torch.testing.assert_close(sae.encode(rows), lens.encode(rows), rtol=1e-5, atol=1e-5)
    f = sae.top_k(rows, 16)
    assert_features_match(f.indices, f.values, f.l0, lens, rows, 16)
    assert int(f.l0.max()) <= 10 and (f.indices[:, 10:] == -1).all()


def test_padding_ties_and_accessors(tmp_path):
    folder = make_saelens_sae("standard", tmp_path / "s", D_IN, D_SAE, "model.layers.0")
    sae = SAE.load(folder)
    with torch.no_grad():  # two features with equal activations: the lower index first
        sae.weights.W_enc[:, 7] = sae.weights.W_enc[:, 50]
        sae.weights.b_enc[7] = sae.weights.b_enc[50]
    rows = _rows(16)
    f = sae.top_k(rows, D_SAE)
    for r in range(16):
        indices, values = f[r]
        assert len(indices) == int(f.l0[r]) and (values > 0).all()
        listed = indices.tolist()
        if 7 in listed:
            assert listed.index(7) == listed.index(50) - 1
    dense = f.dense(D_SAE)
    torch.testing.assert_close(dense, sae.encode(rows))
    torch.testing.assert_close(f.activation(7), dense[:, 7])
    assert f.top(3).indices.shape == (16, 3)


@pytest.mark.parametrize(
    ("hook", "layer"),
    [
        ("blocks.3.hook_resid_post", 3),
        ("blocks.3.hook_resid_pre", 2),
        ("blocks.3.hook_out", 3),
        ("model.layers.3", 3),
        ("model.layers.3.output", 3),
        ("model.language_model.layers.3", 3),
        ("layers.3", 3),
    ],
)
def test_hook_names(hook, layer):
    assert layer_of_hook(hook) == layer


@pytest.mark.parametrize(
    "hook",
    [
        "blocks.3.hook_mlp_out",
        "blocks.3.attn.hook_z",
        "blocks.3.ln2.hook_normalized",
        "blocks.3.hook_resid_mid",
    ],
)
def test_other_sites_are_refused(hook):
    with pytest.raises(SAEError, match="layer="):
        layer_of_hook(hook)
    with pytest.raises(SAEError, match="embeddings"):
        layer_of_hook("blocks.0.hook_resid_pre")


def test_explicit_layer_wins_and_bad_folders(tmp_path):
    folder = make_saelens_sae("standard", tmp_path / "s", D_IN, D_SAE, "blocks.1.hook_mlp_out")
    with pytest.raises(SAEError, match="hook_mlp_out"):
        SAE.load(folder)
    assert SAE.load(folder, layer=2).layer == 2
    with pytest.raises(SAEError, match="not a folder"):
        SAE.load(tmp_path / "nope")
    cfg = json.loads((folder / "cfg.json").read_text())
    for arch, why in [
        ("matching_pursuit", "iterative"),
        ("transcoder", "MLP"),
        ("temporal", "attends"),
    ]:
        (folder / "cfg.json").write_text(json.dumps({**cfg, "architecture": arch}))
        with pytest.raises(SAEError, match=why):
            SAE.load(folder)
    (folder / "cfg.json").write_text(json.dumps({**cfg, "architecture": "jumprelu"}))
    with pytest.raises(SAEError, match="threshold"):
        SAE.load(folder, layer=1)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEError, match="d_in=32"):
        SAE.load(folder, layer=1).check_model(64, 4)


def test_sparsify_folder_against_its_equation(tmp_path):
    """sparsify 1.x layout (W_dec [num_latents, d_in]) read with sparsify's own encode:
    TopK(ReLU((x - b_dec) @ encoder.weight.T + encoder.bias))."""
    gen = torch.Generator().manual_seed(5)
    folder = tmp_path / "layers.1"
    folder.mkdir()
    tensors = {
        "encoder.weight": torch.randn(D_SAE, D_IN, generator=gen) / D_IN**0.5,
        "encoder.bias": torch.randn(D_SAE, generator=gen) * 0.1,
        "W_dec": torch.randn(D_SAE, D_IN, generator=gen),
        "b_dec": torch.randn(D_IN, generator=gen) * 0.1,
    }
    save_file(tensors, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text(
        json.dumps(
            {
                "activation": "topk",
                "expansion_factor": 3,
                "normalize_decoder": True,
                "num_latents": D_SAE,
                "k": 9,
                "multi_topk": False,
                "skip_connection": False,
                "transcode": False,
                "d_in": D_IN,
            }
        )
    )
    sae = SAE.load(folder)
    assert (sae.layer, sae.architecture, sae.k) == (1, "topk", 9)
    rows = _rows()
    pre = torch.relu(
        (rows - tensors["b_dec"]) @ tensors["encoder.weight"].T + tensors["encoder.bias"]
    )
    top = pre.topk(9, sorted=True)
    f = sae.top_k(rows, 9)
    torch.testing.assert_close(f.values, top.values)
    assert torch.equal(f.indices, torch.where(top.values > 0, top.indices, -1))
    (folder / "cfg.json").write_text(json.dumps({"transcode": True}))
    with pytest.raises(SAEError, match="transcoder"):
        SAE.load(folder)


@pytest.mark.parametrize("arch", ["gated", "topk"])
def test_an_sae_read_without_weights_describes_itself(tmp_path, arch):
    """weights=False (what an engine does with a folder in the user's process) reads the
    config and the shapes: the same description, size and fingerprint as the whole SAE, but
    no encode."""
    from probehook import SteeringVector

    extra = {"k": 12, "rescale_acts_by_decoder_norm": True} if arch == "topk" else {}
    folder = make_saelens_sae(arch, tmp_path / arch, D_IN, D_SAE, "blocks.2.hook_resid_post",
                              **extra)  # fmt: skip
    whole, light = SAE.load(folder), SAE.load(folder, weights=False)
    described = ("architecture", "layer", "d_in", "d_sae", "k", "dtype", "hook_name",
                 "fingerprint", "settings", "nbytes", "path")  # fmt: skip
    assert [getattr(light, a) for a in described] == [getattr(whole, a) for a in described]
    assert whole.has_weights and not light.has_weights
    for use in (lambda: light.encode(_rows(2)), lambda: light.top_k(_rows(2), 4),
                lambda: SteeringVector.from_sae(light, {1: 1.0})):  # fmt: skip
        with pytest.raises(SAEError, match="weights=False"):
            use()
    sparsify = tmp_path / "layers.1"
    sparsify.mkdir()
    save_file({"encoder.weight": torch.zeros(D_SAE, D_IN), "encoder.bias": torch.zeros(D_SAE),
               "W_dec": torch.zeros(D_SAE, D_IN), "b_dec": torch.zeros(D_IN)},
              str(sparsify / "sae.safetensors"))  # fmt: skip
    (sparsify / "cfg.json").write_text(json.dumps({"k": 9, "d_in": D_IN}))
    light = SAE.load(sparsify, weights=False)
    assert (light.d_in, light.d_sae, light.k, light.has_weights) == (D_IN, D_SAE, 9, False)


LEGACY_CONFIGS = [
    # SAELens 5.x wrote topk SAEs as "standard" with a topk activation.
    {"architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 7},
     "hook_name": "blocks.2.hook_resid_post", "normalize_activations": "none"},
    {"activation_fn": "topk", "activation_fn_kwargs": {"k": 5},
     "hook_point": "blocks.2.hook_resid_post", "normalize_activations": False},
    {"architecture": "standard", "activation_fn_str": "relu",
     "hook_point": "blocks.2.hook_resid_post", "normalize_activations": True,
     "apply_b_dec_to_input": False},
]  # fmt: skip


@pytest.mark.parametrize("legacy", LEGACY_CONFIGS)
def test_pre_6_0_configs_read_as_saelens_reads_them(tmp_path, legacy):
    """A pre-6.0 cfg.json reads as SAELens's own handle_pre_6_0_config turns it into 6.x
    terms (architecture, k, hook, normalisation, b_dec), and encodes as the 6.x SAE with the
    same weights does."""
    from sae_lens.loading.pretrained_sae_loaders import handle_pre_6_0_config

    theirs = handle_pre_6_0_config(dict(legacy))
    arch = theirs["architecture"]
    extra = {"k": theirs["k"]} if arch == "topk" else {}
    b_dec = theirs["apply_b_dec_to_input"]
    modern = make_saelens_sae(arch, tmp_path / "modern", D_IN, D_SAE,
                              "blocks.2.hook_resid_post", seed=8, apply_b_dec_to_input=b_dec,
                              **extra)  # fmt: skip
    old = tmp_path / "old"
    old.mkdir()
    (old / "sae_weights.safetensors").write_bytes((modern / "sae_weights.safetensors").read_bytes())
    (old / "cfg.json").write_text(json.dumps({**legacy, "d_in": D_IN, "d_sae": D_SAE}))
    ours, reference = SAE.load(old), SAE.load(modern)
    assert (ours.architecture, ours.k, ours.layer) == (arch, theirs.get("k"), 2)
    assert ours.hook_name == theirs["metadata"]["hook_name"]
    assert ours.settings["apply_b_dec_to_input"] == theirs["apply_b_dec_to_input"]
    norm = theirs["normalize_activations"]  # folded at training: read as none, like encode
    assert ours.settings["normalize_activations"] == (
        "none" if norm == "expected_average_only_in" else norm
    )
    rows = _rows(16)
    torch.testing.assert_close(ours.encode(rows), reference.encode(rows))


def test_steering_vector_from_sae_decoder_directions(tmp_path):
    from probehook import SteeringVector

    folder = make_saelens_sae("jumprelu", tmp_path / "j", D_IN, D_SAE, "blocks.2.hook_resid_post")
    sae = SAE.load(folder)
    vector = SteeringVector.from_sae(sae, {3: 2.0, 7: -1.0}, name="three")
    lens = oracle(folder)
    want = 2.0 * lens.W_dec[3] - lens.W_dec[7]
    assert vector.layers == (2,)
    torch.testing.assert_close(vector.vectors[2], want.detach().float())
    assert vector.made_by["features"] == {"3": 2.0, "7": -1.0}
    with pytest.raises(SAEError, match="out of range"):
        SteeringVector.from_sae(sae, {D_SAE: 1.0})
    with pytest.raises(ValueError, match="non-empty"):
        SteeringVector.from_sae(sae, {})


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_bfloat16_encoder_stays_within_the_wider_margin(tmp_path, arch):
    """``sae_dtype="bfloat16"`` (the engine's cheaper GEMM): the readout equals SAELens's
    float32 encode within tau = 1e-2 x max |pre-activation|."""
    from probehook.saes.encode import read_top_k

    extra = {"k": 12} if arch in ("topk", "abstopk") else {}
    folder = make_saelens_sae(arch, tmp_path / arch, D_IN, D_SAE, "model.layers.1", **extra)
    weights = SAE.load(folder).weights.to("cpu", torch.bfloat16)
    assert weights.W_enc.dtype == torch.bfloat16 and weights.b_dec.dtype == torch.float32
    rows = _rows()
    packed = read_top_k(weights, rows, 8)
    f = SAEFeatures.unpack(packed, 8)
    assert_features_match(f.indices, f.values, f.l0, oracle(folder), rows, 8, tau=1e-2)


def test_the_bundled_sae_is_what_saelens_reads():
    """The SAE shipped in the package (scripts/train_tiny_sae.py): layer 3 of the tiny model,
    read as SAELens reads it, and as good on held-out statements as its report says."""
    import json

    from probehook import tiny_sae_path

    folder = tiny_sae_path()
    sae = SAE.load(folder)
    assert (sae.layer, sae.d_in, sae.d_sae, sae.architecture, sae.k) == (3, 128, 512, "topk", 8)
    report = json.loads((folder / "training_report.json").read_text())
    assert report["heldout_explained_variance"] >= 0.9 and report["heldout_mean_l0"] <= 8
    rows = torch.randn(32, 128, generator=torch.Generator().manual_seed(0)) * 3
    f = sae.top_k(rows, 8)
    assert_features_match(f.indices, f.values, f.l0, oracle(folder), rows, 8)
    assert sum(p.stat().st_size for p in folder.iterdir()) < 5 << 20


# -- the fingerprint --------------------------------------------------------------------------


def _plain_saelens(folder: Path, d_in: int, d_sae: int, seed: int = 0) -> Path:
    """A standard SAELens folder written directly (large ones quickly)."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "W_enc": torch.randn(d_in, d_sae, generator=gen),
            "W_dec": torch.randn(d_sae, d_in, generator=gen),
            "b_enc": torch.randn(d_sae, generator=gen),
            "b_dec": torch.randn(d_in, generator=gen),
        },
        str(folder / "sae_weights.safetensors"),
    )
    metadata = {"hook_name": "blocks.2.hook_resid_post", "sae_lens_version": "6.5.0"}
    cfg = {"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "metadata": metadata}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def _spans(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's data span in a safetensors file (read here, not with probehook's code)."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    start = 8 + length
    return {
        name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _rchar() -> int | None:
    """Bytes this process has read with read(2) and friends (Linux), page cache included."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return None
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar")))


def test_reading_without_weights_reads_a_bounded_sample_of_them(tmp_path, monkeypatch):
    """SAE.load(weights=False) (what an engine does in the user's process) hashed every byte
    of the weights for the fingerprint (1-4 GB SAEs); it reads at most 512 KiB of each
    tensor. Counted twice: the bytes read through probehook's ``open`` and the process's
    read(2) total (which sees safetensors' own reads too)."""
    folder = _plain_saelens(tmp_path / "big", 64, 1 << 16)  # W_enc, W_dec: 16 MiB each
    size = (folder / "sae_weights.safetensors").stat().st_size
    assert size > 32 << 20
    SAE.load(folder, weights=False)  # imports done, caches warm: only the reads are counted
    read = {"bytes": 0}
    real_open = open

    class Counted:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            read["bytes"] += len(data)
            return data

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(sae_files, "open", lambda *a, **k: Counted(real_open(*a, **k)),
                        raising=False)  # fmt: skip
    before = _rchar()
    light = SAE.load(folder, weights=False)
    after = _rchar()
    bound = 2 * SAMPLES_PER_TENSOR * SAMPLE_BYTES + (1 << 20)  # two big tensors, the rest
    assert 0 < read["bytes"] < bound, read
    if before is not None and after is not None:
        assert after - before < bound + (1 << 20), after - before
    assert light.fingerprint == SAE.load(folder).fingerprint and not light.has_weights
    # The measure sees a whole read: the old fingerprint reads every byte.
    read["bytes"] = 0
    legacy_fingerprint_of(folder, "sae_weights.safetensors")
    assert read["bytes"] >= size


def test_the_fingerprint_tells_sampled_weights_config_and_small_tensors_apart(tmp_path):
    """Same SAE, anywhere: same fingerprint (a copy in another folder, a newer mtime). A byte
    changed in a small tensor, in any sampled region of a large one, or in the config: another
    fingerprint. What it does not promise (the docstring says so): a byte changed between
    samples of a large tensor keeps it."""
    folder = _plain_saelens(tmp_path / "a", 64, 1 << 13)  # W_enc, W_dec: 2 MiB, sampled
    file = folder / "sae_weights.safetensors"
    base = SAE.load(folder, weights=False).fingerprint
    assert base.startswith("v2:") and len(base) == 3 + 64
    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "copy")
    os.utime(copy / "sae_weights.safetensors", ns=(1, 1))
    assert SAE.load(copy, weights=False).fingerprint == base
    assert SAE.load(_plain_saelens(tmp_path / "b", 64, 1 << 13, seed=1)).fingerprint != base
    spans = _spans(file)
    w_begin, w_end = spans["W_enc"]
    step = (w_end - w_begin - SAMPLE_BYTES) // (SAMPLES_PER_TENSOR - 1)
    sampled = {
        "b_dec": spans["b_dec"][0] + 3,
        "b_enc last": spans["b_enc"][1] - 1,
        "W_enc first": w_begin,
        "W_enc sample 7": w_begin + 7 * step + SAMPLE_BYTES // 2,
        "W_enc last": w_end - 1,
        "W_dec sample 3": spans["W_dec"][0] + 3 * step + 5,
        "header": 8 + 2,
    }
    for where, offset in sampled.items():
        _flip(file, offset)
        assert fingerprint_of(folder, file.name) != base, where
        _flip(file, offset)  # back
        assert fingerprint_of(folder, file.name) == base, where
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps({**cfg, "apply_b_dec_to_input": False}))
    assert fingerprint_of(folder, file.name) != base
    (folder / "cfg.json").write_text(json.dumps(cfg))
    legacy = legacy_fingerprint_of(folder, file.name)
    unsampled = spans["W_dec"][0] + SAMPLE_BYTES + 17  # between samples 0 and 1
    _flip(file, unsampled)
    assert fingerprint_of(folder, file.name) == base  # not read, so not covered
    assert legacy_fingerprint_of(folder, file.name) != legacy


def test_the_fingerprint_is_the_same_in_another_process(tmp_path):
    folder = _plain_saelens(tmp_path / "a", 32, 1 << 13)
    code = (
        "import sys; from pathlib import Path; from probehook.saes.files import fingerprint_of;"
        "print(fingerprint_of(Path(sys.argv[1]), 'sae_weights.safetensors'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, os.fspath(folder)], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == SAE.load(folder, weights=False).fingerprint


def test_a_fingerprint_recorded_before_v2_still_matches_its_sae(tmp_path):
    """Stores written before the sampled fingerprint recorded the sha256 of every byte of
    cfg.json and the weights; matches_fingerprint checks either kind against a folder."""
    folder = make_saelens_sae("topk", tmp_path / "a", D_IN, D_SAE, "blocks.2.hook_resid_post")
    other = make_saelens_sae("topk", tmp_path / "b", D_IN, D_SAE, "blocks.2.hook_resid_post",
                             seed=1)  # fmt: skip
    old = hashlib.sha256(
        (folder / "cfg.json").read_bytes() + (folder / "sae_weights.safetensors").read_bytes()
    ).hexdigest()  # what probehook recorded until now
    assert legacy_fingerprint_of(folder, "sae_weights.safetensors") == old
    new = SAE.load(folder, weights=False).fingerprint
    assert new != old
    assert matches_fingerprint(folder, old) and matches_fingerprint(folder, new)
    assert not matches_fingerprint(other, old) and not matches_fingerprint(other, new)
    sparsify = tmp_path / "layers.1"
    sparsify.mkdir()
    save_file({"encoder.weight": torch.ones(D_SAE, D_IN), "encoder.bias": torch.zeros(D_SAE),
               "W_dec": torch.ones(D_SAE, D_IN), "b_dec": torch.zeros(D_IN)},
              str(sparsify / "sae.safetensors"))  # fmt: skip
    (sparsify / "cfg.json").write_text(json.dumps({"k": 9, "d_in": D_IN}))
    light = SAE.load(sparsify, weights=False)
    assert light.fingerprint == SAE.load(sparsify).fingerprint
    assert matches_fingerprint(sparsify, light.fingerprint)
    assert matches_fingerprint(sparsify, legacy_fingerprint_of(sparsify, "sae.safetensors"))


def test_an_sae_named_like_a_stored_readout_instance_is_refused():
    """A store keeps readout instances as ``"<source>:<name>"`` beside the SAEs: an SAE named
    ``"lens:j@4"`` would take that instance's place and break the writer (review D14)."""
    from probehook import SAE, tiny_sae_path
    from probehook.errors import CaptureConfigError
    from probehook.saes.readout import load_saes

    sae = SAE.load(tiny_sae_path(), weights=False)
    assert list(load_saes({"res1": sae})) == ["res1"]
    with pytest.raises(CaptureConfigError, match=r"'lens:j@4' holds ':'.* e.g. 'lens_j@4'"):
        load_saes({"lens:j@4": sae})
