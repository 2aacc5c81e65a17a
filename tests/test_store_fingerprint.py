"""Model fingerprint v2 and the append check built on it (no engine: configs + fake weights)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers.configuration_utils
from transformers import LlamaConfig

from probehook.errors import StoreFormatError
from probehook.store import ActivationStore
from probehook.store.fingerprint import (
    SAMPLE_BYTES,
    legacy_fingerprint,
    model_fingerprint,
)
from probehook.store.format import META_FILE
from probehook.store.writer import PendingRequest, RowBlock

HIDDEN = 8


def llama(**overrides: object) -> LlamaConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaConfig(**{**fields, **overrides})


def random_bytes(size: int, rng: torch.Generator) -> bytes:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=rng).numpy().tobytes()


def weights_dir(root: Path, seed: int = 0, suffix: str = ".safetensors") -> Path:
    """Two shards larger than three samples (so they are sampled) and one small file."""
    root.mkdir(parents=True, exist_ok=True)
    rng = torch.Generator().manual_seed(seed)
    for name, size in (
        ("model-00001-of-00003", 5 * SAMPLE_BYTES + 123),
        ("model-00002-of-00003", 4 * SAMPLE_BYTES),
        ("model-00003-of-00003", 1000),
    ):
        (root / (name + suffix)).write_bytes(random_bytes(size, rng))
    (root / "config.json").write_text("{}")  # not a weight file: not hashed
    return root


def test_newer_transformers_same_fingerprint(tmp_path: Path, monkeypatch) -> None:
    """Same config and weights, read by another transformers release: same fingerprint."""
    path = weights_dir(tmp_path / "m")
    before = model_fingerprint(llama(), str(path))
    old_legacy = legacy_fingerprint(llama())
    # to_dict() stamps the running release into transformers_version.
    monkeypatch.setattr(transformers.configuration_utils, "__version__", "99.0.0")
    newer = llama()
    assert newer.to_dict()["transformers_version"] == "99.0.0"
    assert legacy_fingerprint(newer) != old_legacy  # what v1 got wrong
    assert model_fingerprint(newer, str(path)) == before
    assert "3 weight file(s)" in before["covers"] and before["version"] == 2
    assert len(before["fingerprint"]) == 16 and int(before["fingerprint"], 16) >= 0


def test_transformers4_layout_same_fingerprint() -> None:
    """transformers 4 keeps rope_theta/rope_scaling and may omit head_dim; 5 has
    rope_parameters. The same model fingerprints alike under both layouts."""
    v5 = llama()
    v4 = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_theta=10000,  # an int in some config.json files
        rope_scaling=None,
        transformers_version="4.44.0",
    )
    assert model_fingerprint(v4, None) == model_fingerprint(v5, None)
    scaled = SimpleNamespace(**{**vars(v4), "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert model_fingerprint(scaled, None) != model_fingerprint(v5, None)


def test_architecture_change_changes_fingerprint(tmp_path: Path) -> None:
    path = weights_dir(tmp_path / "m")
    base = model_fingerprint(llama(), str(path))["fingerprint"]
    assert model_fingerprint(llama(hidden_size=128), str(path))["fingerprint"] != base
    assert model_fingerprint(llama(num_hidden_layers=3), str(path))["fingerprint"] != base


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_weight_byte_in_sampled_region_changes_fingerprint(tmp_path: Path, where: str) -> None:
    path = weights_dir(tmp_path / "m")
    base = model_fingerprint(llama(), str(path))["fingerprint"]
    shard = path / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    size = len(data)
    offset = {"first": 100, "middle": (size - SAMPLE_BYTES) // 2 + 7, "last": size - 5}[where]
    data[offset] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert model_fingerprint(llama(), str(path))["fingerprint"] != base


def test_other_weights_same_config_differ(tmp_path: Path) -> None:
    a = model_fingerprint(llama(), str(weights_dir(tmp_path / "a", seed=0)))
    b = model_fingerprint(llama(), str(weights_dir(tmp_path / "b", seed=1)))
    assert a["fingerprint"] != b["fingerprint"]


def test_no_local_weights_covers_config_only(tmp_path: Path) -> None:
    path = weights_dir(tmp_path / "m")
    dummy = model_fingerprint(llama(), str(path), load_format="dummy")
    hub = model_fingerprint(llama(), "meta-llama/Llama-3.2-1B")
    empty = tmp_path / "config-only"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    for result in (dummy, hub, model_fingerprint(llama(), str(empty))):
        assert result["covers"].startswith("architecture config only"), result
    assert "dummy" in dummy["covers"] and "hub id" in hub["covers"]
    # Config-only fingerprints agree with each other, not with one that covers weights.
    assert dummy["fingerprint"] == hub["fingerprint"]
    assert dummy["fingerprint"] != model_fingerprint(llama(), str(path))["fingerprint"]


def test_dummy_weights_not_read(tmp_path: Path) -> None:
    path = weights_dir(tmp_path / "m")
    base = model_fingerprint(llama(), str(path), load_format="dummy")
    (path / "model-00003-of-00003.safetensors").write_bytes(b"changed")
    assert model_fingerprint(llama(), str(path), load_format="dummy") == base


def test_bin_files_count_only_without_safetensors(tmp_path: Path) -> None:
    """vLLM loads *.safetensors when there are any; a .bin beside them is not the model."""
    rng = torch.Generator().manual_seed(5)
    path = weights_dir(tmp_path / "st")
    base = model_fingerprint(llama(), str(path))
    (path / "training_args.bin").write_bytes(random_bytes(100, rng))
    assert model_fingerprint(llama(), str(path)) == base
    pt = weights_dir(tmp_path / "pt", suffix=".bin")  # a .bin-only checkpoint: covered
    before = model_fingerprint(llama(), str(pt))
    assert "3 weight file(s)" in before["covers"]
    (pt / "model-00003-of-00003.bin").write_bytes(random_bytes(1000, rng))
    assert model_fingerprint(llama(), str(pt))["fingerprint"] != before["fingerprint"]


# -- the append check ---------------------------------------------------------------------


def request(i: int) -> PendingRequest:
    record = {
        "id": f"r{i}",
        "prompt": "p",
        "prompt_token_ids": [0, 1],
        "sampling_params": {},
        "completions": [{"index": 0, "token_ids": [5], "text": "x", "finish_reason": "length"}],
    }
    return PendingRequest(record, [RowBlock("decode", 0, 1, 1, torch.ones(1, HIDDEN))])


def meta_for(fingerprint: dict) -> dict:
    return {
        "model": "m",
        "model_fingerprint": fingerprint["fingerprint"],
        "fingerprint_version": fingerprint["version"],
        "fingerprint_covers": fingerprint["covers"],
        "dtype": "float32",
        "hidden_size": HIDDEN,
        "layers": [1],
    }


def write(path: Path, meta: dict, i: int, legacy: str | None = None) -> None:
    store = ActivationStore.for_writing(path, meta, legacy_fingerprint=legacy)
    store.add(request(i))
    store.flush()
    store.close()


def test_append_same_model_stores_v2_meta(tmp_path: Path) -> None:
    fingerprint = model_fingerprint(llama(), str(weights_dir(tmp_path / "m")))
    write(tmp_path / "s", meta_for(fingerprint), 0)
    write(tmp_path / "s", meta_for(fingerprint), 1)
    meta = json.loads((tmp_path / "s" / META_FILE).read_text())
    assert meta["model_fingerprint"] == fingerprint["fingerprint"]
    assert meta["fingerprint_version"] == 2 and meta["fingerprint_covers"] == fingerprint["covers"]
    assert len(ActivationStore.open(tmp_path / "s")) == 2


def test_append_other_model_refused_naming_both(tmp_path: Path) -> None:
    ours = model_fingerprint(llama(), str(weights_dir(tmp_path / "a", seed=0)))
    other = model_fingerprint(llama(), str(weights_dir(tmp_path / "b", seed=1)))
    write(tmp_path / "s", meta_for(ours), 0)
    with pytest.raises(StoreFormatError) as err:
        ActivationStore.check_appendable(tmp_path / "s", meta_for(other))
    message = str(err.value)
    assert ours["fingerprint"] in message and other["fingerprint"] in message
    assert ours["covers"] in message and other["covers"] in message
    assert len(ActivationStore.open(tmp_path / "s")) == 1


def legacy_store(path: Path, config: LlamaConfig) -> None:
    """A store as probehook 0.1 wrote it: whole-config hash, no fingerprint_version."""
    meta = {"model": "m", "model_fingerprint": legacy_fingerprint(config), "dtype": "float32"}
    write(path, {**meta, "hidden_size": HIDDEN, "layers": [1]}, 0)


def test_legacy_store_accepts_matching_legacy_fingerprint(tmp_path: Path, caplog) -> None:
    config = llama()
    legacy_store(tmp_path / "s", config)
    ours = model_fingerprint(config, str(weights_dir(tmp_path / "m")))
    with caplog.at_level(logging.INFO, logger="probehook.store.appendable"):
        write(tmp_path / "s", meta_for(ours), 1, legacy=legacy_fingerprint(config))
    assert "predates fingerprint v2" in caplog.text
    assert len(ActivationStore.open(tmp_path / "s")) == 2
    # meta.json is written once: the store stays legacy, checked the legacy way next time.
    assert "fingerprint_version" not in json.loads((tmp_path / "s" / META_FILE).read_text())


def test_legacy_store_refuses_unverifiable_run(tmp_path: Path, monkeypatch) -> None:
    legacy_store(tmp_path / "s", llama())
    stored = legacy_fingerprint(llama())
    monkeypatch.setattr(transformers.configuration_utils, "__version__", "99.0.0")
    newer = llama()  # same model, but v1 cannot tell
    ours = model_fingerprint(newer, None)
    for legacy in (legacy_fingerprint(newer), None):
        with pytest.raises(StoreFormatError, match="predates fingerprint v2") as err:
            ActivationStore.check_appendable(
                tmp_path / "s", meta_for(ours), legacy_fingerprint=legacy
            )
        message = str(err.value)
        assert stored in message
        assert ours["fingerprint"] in message and ours["covers"] in message
        assert '"fingerprint_version": 2' in message and os.fspath(tmp_path / "s") in message


# -- SAE fingerprints recorded by runs --------------------------------------------------------


def test_a_store_with_a_pre_v2_sae_fingerprint_takes_a_new_run_of_that_sae(tmp_path: Path) -> None:
    """SAE fingerprints changed scheme (the sha256 of every byte, then "v2:" and a sampled
    sha256). A run's record keeps whichever it was given; appending compares the model's
    fingerprint only, so a store whose earlier run recorded the old kind takes a run of the
    same SAE recording the new kind, both runs stay readable, and the old record still
    identifies the SAE (matches_fingerprint)."""
    from safetensors.torch import save_file

    from probehook import SAE
    from probehook.saes.files import legacy_fingerprint_of, matches_fingerprint

    folder = tmp_path / "sae"
    folder.mkdir()
    rng = torch.Generator().manual_seed(0)
    shapes = {"W_enc": (HIDDEN, 16), "W_dec": (16, HIDDEN), "b_enc": (16,), "b_dec": (HIDDEN,)}
    tensors = {name: torch.randn(shape, generator=rng) for name, shape in shapes.items()}
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    cfg = {"d_in": HIDDEN, "d_sae": 16, "hook_name": "blocks.1.hook_resid_post"}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    old = legacy_fingerprint_of(folder, "sae_weights.safetensors")
    new = SAE.load(folder, weights=False).fingerprint
    assert old != new and new.startswith("v2:")
    fingerprint = model_fingerprint(llama(), str(weights_dir(tmp_path / "m")))
    store_path = tmp_path / "s"
    for i, sae_fingerprint in enumerate((old, new)):
        store = ActivationStore.for_writing(store_path, meta_for(fingerprint))
        sae = {"d_sae": 16, "k": 4, "layer": 1, "fingerprint": sae_fingerprint,
               "path": os.fspath(folder)}  # fmt: skip
        store.begin_run({"saes": {"res1": sae}})
        store.add(request(i))
        store.flush()
        store.close()
    reader = ActivationStore.open(store_path)
    assert len(reader) == 2
    recorded = [run["saes"]["res1"]["fingerprint"] for run in reader.runs.values()]
    assert sorted(recorded) == sorted([old, new])
    assert all(matches_fingerprint(folder, f) for f in recorded)
