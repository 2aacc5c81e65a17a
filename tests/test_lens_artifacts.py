"""The lens files against the specification, no engine: TransformerLens 3.9's J-lens artifact
(both directions, fp16 storage) and its fit checkpoint (read as TransformerLens reads it), the
tuned-lens package's folder against a hand computation of its translators, what the worker
applies at each layer (``lens_affine``), the spec ``load_lens`` takes, ``check_lens``'s
refusals and warnings, and every file read with ``weights_only=True`` (pickled code refused
with the path named, never run).

tests/test_lens_files.py covers the same files more briefly, with the steering vectors."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from probehook.errors import CaptureConfigError
from probehook.lenses.artifacts import (
    JacobianLens,
    TunedLens,
    check_lens,
    lens_affine,
    load_lens,
)

D = 8
N_LAYERS = 4  # the model's blocks: 0..3, the last (3) is the identity for both lenses


def _matrices(layers: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(D, D, generator=g) for layer in layers}


def _tl_lens():
    from transformer_lens.tools.analysis.jacobian_lens import JacobianLens as TLLens

    return TLLens


# --- J-lens: TransformerLens's artifact -------------------------------------------------------


def test_a_lens_transformer_lens_saved_loads_identically(tmp_path: Path) -> None:
    matrices = _matrices([0, 1, 2])
    meta = {"model_name": "org/m", "corpus": "c", "nested": {"a": [1, 2.5, None]}}
    tl = _tl_lens()(matrices, n_prompts=7, d_model=D, metadata=meta)
    tl.save(str(tmp_path / "tl.pt"))
    tl_back = _tl_lens().load(str(tmp_path / "tl.pt"))

    ours = JacobianLens.load(tmp_path / "tl.pt")
    assert ours.kind == "jacobian" and ours.path == str(tmp_path / "tl.pt")
    assert ours.source_layers == tl_back.source_layers == [0, 1, 2]
    assert (ours.n_prompts, ours.d_model, ours.metadata) == (7, D, meta)
    for layer, m in matrices.items():  # fp16 on disk: equal to the fp16-rounded values
        got = ours.jacobians[layer]
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.equal(got, m.half().float())
        assert torch.equal(got, tl_back.jacobians[layer])


def test_a_lens_we_save_loads_identically_in_transformer_lens(tmp_path: Path) -> None:
    matrices = _matrices([1, 2], seed=3)
    ours = JacobianLens(matrices, n_prompts=5, d_model=D, metadata={"model_name": "m"})
    assert ours.path is None
    ours.save(tmp_path / "ours.pt")
    assert ours.path == str(tmp_path / "ours.pt")

    # Exactly TransformerLens's keys, fp16 matrices by default.
    raw = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert set(raw) == {"J", "n_prompts", "source_layers", "d_model", "metadata"}
    assert raw["source_layers"] == [1, 2] and raw["d_model"] == D and raw["n_prompts"] == 5
    assert all(m.dtype == torch.float16 for m in raw["J"].values())

    tl = _tl_lens().load(str(tmp_path / "ours.pt"))
    assert tl.source_layers == [1, 2] and tl.n_prompts == 5 and tl.d_model == D
    assert tl.metadata == {"model_name": "m"}
    for layer, m in matrices.items():
        assert torch.equal(tl.jacobians[layer], m.half().float())
    # Our own reload agrees, and a float32 save keeps every bit.
    again = JacobianLens.load(tmp_path / "ours.pt")
    assert all(torch.equal(again.jacobians[k], tl.jacobians[k]) for k in matrices)
    ours.save(tmp_path / "fp32.pt", dtype=torch.float32)
    exact = _tl_lens().load(str(tmp_path / "fp32.pt"))
    assert all(torch.equal(exact.jacobians[k], m) for k, m in matrices.items())


def test_a_lens_without_metadata_writes_no_metadata_key(tmp_path: Path) -> None:
    JacobianLens(_matrices([0]), n_prompts=1, d_model=D).save(tmp_path / "j.pt")
    assert "metadata" not in torch.load(tmp_path / "j.pt", weights_only=True)
    assert JacobianLens.load(tmp_path / "j.pt").metadata == {}


def test_a_fit_checkpoint_reads_as_transformer_lens_reads_it(tmp_path: Path) -> None:
    sums = _matrices([0, 2], seed=4)
    torch.save(
        {
            "jacobian_sum": sums,
            "n_done": 4,
            "source_layers": [0, 2],
            "target_layer": 3,
            "model_name": "org/m",
            "metadata": {"corpus": "c", "dim_batch": 2, "mask": torch.ones(3)},
        },
        tmp_path / "ck.pt",
    )
    ours = load_lens(tmp_path / "ck.pt")
    tl = _tl_lens().load(str(tmp_path / "ck.pt"))
    assert isinstance(ours, JacobianLens)
    assert ours.n_prompts == tl.n_prompts == 4 and ours.d_model == tl.d_model == D
    assert ours.source_layers == tl.source_layers == [0, 2]
    for layer, s in sums.items():  # running sums over n_done prompts: the mean
        torch.testing.assert_close(ours.jacobians[layer], s / 4)
        assert torch.equal(ours.jacobians[layer], tl.jacobians[layer])
    assert ours.metadata == tl.metadata
    assert ours.metadata["converted_from"] == "jacobian_lens_checkpoint"
    assert ours.metadata["target_layer"] == 3 and ours.metadata["model_name"] == "org/m"


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"jacobian_sum": {0: torch.eye(D)}, "n_done": 0}, "0 prompts"),
        ({"jacobian_sum": {}, "n_done": 3}, "0 layers"),
    ],
)
def test_an_empty_fit_checkpoint_is_refused(tmp_path: Path, payload, match) -> None:
    torch.save(payload, tmp_path / "ck.pt")
    with pytest.raises(CaptureConfigError, match=rf"ck\.pt.*{match}"):
        JacobianLens.load(tmp_path / "ck.pt")


def test_the_matrix_of_a_layer_the_identity_last_and_a_missing_layer_refused() -> None:
    matrices = _matrices([0, 2])
    lens = JacobianLens(matrices, n_prompts=1, d_model=D)
    got = lens.matrix(2, N_LAYERS)
    assert got is not None and got.dtype == torch.float32 and torch.equal(got, matrices[2])
    assert lens.matrix(N_LAYERS - 1, N_LAYERS) is None  # never fitted: the identity
    with pytest.raises(CaptureConfigError, match=r"layer 1\b.*\[0, 2\].*lens_layers"):
        lens.matrix(1, N_LAYERS)
    # A lens that does hold the last layer uses it.
    fitted_last = JacobianLens(_matrices([3]), n_prompts=1, d_model=D)
    assert fitted_last.matrix(3, N_LAYERS) is not None


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"weights": torch.zeros(2)}, "neither a 'J' key"),
        ([torch.zeros(2)], "not a dict"),
        ({"J": {0: torch.eye(D)}, "n_prompts": 1}, "d_model"),
        ({"J": {0: torch.eye(D + 1)}, "n_prompts": 1, "d_model": D}, "shape"),
    ],
)
def test_a_file_that_is_no_j_lens_is_refused_naming_it(tmp_path: Path, payload, match) -> None:
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CaptureConfigError, match=rf"bad\.pt.*{match}"):
        JacobianLens.load(tmp_path / "bad.pt")


def test_metadata_a_weights_only_load_cannot_read_back_is_not_saved(tmp_path: Path) -> None:
    lens = JacobianLens(_matrices([0]), n_prompts=1, d_model=D, metadata={"x": object()})
    with pytest.raises(CaptureConfigError, match="metadata"):
        lens.save(tmp_path / "j.pt")
    assert not (tmp_path / "j.pt").exists()


# --- weights_only: a lens file is data, never code ---------------------------------------------


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what a malicious file would carry
        return (print, ("ran code",))


def test_a_pickled_object_is_refused_naming_the_file_and_never_run(tmp_path: Path, capsys) -> None:
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"J": {0: _Payload()}, "n_prompts": 1, "d_model": D}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):  # torch refuses it; the loaders say which file
        torch.load(tmp_path / "evil.pt", weights_only=True)
    for load in (JacobianLens.load, load_lens):
        with pytest.raises(CaptureConfigError, match=r"evil\.pt.*weights_only=True"):
            load(tmp_path / "evil.pt")
    torch.save({"0.weight": _Payload()}, tmp_path / "params.pt")  # a tuned lens's, too
    (tmp_path / "config.json").write_text(json.dumps({"d_model": D, "num_hidden_layers": 2}))
    with pytest.raises(CaptureConfigError, match=r"params\.pt.*weights_only=True"):
        TunedLens.load(tmp_path)
    assert "ran code" not in capsys.readouterr().out


def test_a_file_that_is_not_a_torch_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CaptureConfigError, match=r"junk\.pt"):
        load_lens(tmp_path / "junk.pt")


# --- Tuned lens: the tuned-lens package's folder -----------------------------------------------


def _tuned_folder(folder: Path, *, bias: bool = True, layers: int = N_LAYERS) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "base_model_name_or_path": "org/model",
        "d_model": D,
        "num_hidden_layers": layers,
        "bias": bias,
        "unembed_hash": "abc",
        "lens_type": "linear_tuned_lens",
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1)
    params = {}
    for i in range(layers):
        params[f"{i}.weight"] = torch.randn(D, D, generator=g) * 0.1
        if bias:
            params[f"{i}.bias"] = torch.randn(D, generator=g)
    torch.save(params, folder / "params.pt")
    return params


def test_a_tuned_lens_matches_a_hand_computation_of_its_translators(tmp_path: Path) -> None:
    params = _tuned_folder(tmp_path / "tuned")
    lens = TunedLens.load(tmp_path / "tuned")
    assert lens.kind == "tuned" and lens.path == str(tmp_path / "tuned")
    assert (lens.d_model, lens.num_hidden_layers) == (D, N_LAYERS)
    assert lens.config["unembed_hash"] == "abc" and sorted(lens.translators) == [0, 1, 2, 3]
    h = torch.randn(3, D, generator=torch.Generator().manual_seed(2))
    for layer in range(N_LAYERS - 1):
        # The package: h + Linear(h) on HF hidden_states[i]; probehook layer L = HF L + 1.
        w, b = params[f"{layer + 1}.weight"], params[f"{layer + 1}.bias"]
        want = h + h @ w.T + b
        matrix, bias = lens.affine(layer, N_LAYERS)
        assert matrix.dtype == torch.float32 and tuple(matrix.shape) == (D, D)
        torch.testing.assert_close(h @ matrix.T + bias, want)
        m2, b2 = lens_affine(lens, layer, N_LAYERS)
        assert torch.equal(m2, matrix) and torch.equal(b2, bias)
    assert lens.affine(N_LAYERS - 1, N_LAYERS) == (None, None)
    assert lens_affine(lens, N_LAYERS - 1, N_LAYERS) == (None, None)


def test_a_tuned_lens_round_trips_in_the_package_format(tmp_path: Path) -> None:
    params = _tuned_folder(tmp_path / "tuned")
    lens = TunedLens.load(tmp_path / "tuned")
    lens.save(tmp_path / "again")
    assert lens.path == str(tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["config.json", "params.pt"]
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config == json.loads((tmp_path / "tuned" / "config.json").read_text())
    saved = torch.load(tmp_path / "again" / "params.pt", weights_only=True)
    assert set(saved) == set(params)
    assert all(torch.equal(saved[k], v) for k, v in params.items())
    again = TunedLens.load(tmp_path / "again")
    for layer in range(N_LAYERS - 1):
        for x, y in zip(again.affine(layer, N_LAYERS), lens.affine(layer, N_LAYERS), strict=True):
            assert torch.equal(x, y)


def test_a_tuned_lens_without_bias(tmp_path: Path) -> None:
    params = _tuned_folder(tmp_path / "tuned", bias=False)
    lens = load_lens(tmp_path / "tuned")
    matrix, bias = lens_affine(lens, 0, N_LAYERS)
    assert bias is None and torch.equal(matrix, torch.eye(D) + params["1.weight"])
    lens.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["bias"] is False
    saved = torch.load(tmp_path / "again" / "params.pt", weights_only=True)
    assert not any(k.endswith(".bias") for k in saved)


def test_a_tuned_lens_refuses_a_layer_it_has_no_translator_for(tmp_path: Path) -> None:
    params = _tuned_folder(tmp_path / "tuned")
    del params["2.weight"], params["2.bias"]
    torch.save(params, tmp_path / "tuned" / "params.pt")
    lens = TunedLens.load(tmp_path / "tuned")
    assert lens.affine(0, N_LAYERS)[0] is not None
    with pytest.raises(CaptureConfigError, match=r"tuned.*no translator for layer 1\b"):
        lens.affine(1, N_LAYERS)
    with pytest.raises(CaptureConfigError, match="no translator for layer 7"):
        lens.affine(7, N_LAYERS)


def test_a_folder_that_is_no_tuned_lens_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    with pytest.raises(CaptureConfigError, match=r"'.*f'.*config\.json"):
        TunedLens.load(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CaptureConfigError, match=r"'.*f'.*config\.json"):
        TunedLens.load(folder)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(CaptureConfigError, match=r"lacks \['d_model'\]"):
        TunedLens.load(folder)
    (folder / "config.json").write_text(json.dumps({"d_model": D, "num_hidden_layers": 2}))
    with pytest.raises(CaptureConfigError, match=r"params\.pt"):
        TunedLens.load(folder)  # no params.pt
    torch.save({"1.weight": torch.zeros(D, D + 1)}, folder / "params.pt")
    with pytest.raises(CaptureConfigError, match=r"1\.weight.*shape"):
        TunedLens.load(folder)
    torch.save({"1.weight": torch.zeros(D, D), "1.bias": torch.zeros(2)}, folder / "params.pt")
    with pytest.raises(CaptureConfigError, match=r"1\.bias.*shape"):
        TunedLens.load(folder)


# --- load_lens, check_lens, lens_affine ---------------------------------------------------------


def test_load_lens_takes_logit_a_lens_a_file_or_a_folder(tmp_path: Path) -> None:
    assert load_lens("logit") == "logit"
    j = JacobianLens(_matrices([0]), n_prompts=1, d_model=D)
    assert load_lens(j) is j
    _tuned_folder(tmp_path / "tuned")
    tuned = TunedLens.load(tmp_path / "tuned")
    assert load_lens(tuned) is tuned
    j.save(tmp_path / "j.pt")
    for spec in (tmp_path / "j.pt", str(tmp_path / "j.pt")):
        assert isinstance(load_lens(spec), JacobianLens)
    for spec in (tmp_path / "tuned", str(tmp_path / "tuned")):
        assert isinstance(load_lens(spec), TunedLens)


@pytest.mark.parametrize("spec", [3, None, ["logit"], "logits", "missing.pt", "Logit"])
def test_load_lens_names_the_value_and_the_choices(spec) -> None:
    with pytest.raises(CaptureConfigError) as e:
        load_lens(spec)
    text = str(e.value)
    assert repr(str(spec) if isinstance(spec, str) else spec) in text
    for choice in ("'logit'", "JacobianLens", "TunedLens", ".pt", "tuned-lens folder"):
        assert choice in text


def test_load_lens_refuses_a_folder_that_is_no_tuned_lens(tmp_path: Path) -> None:
    with pytest.raises(CaptureConfigError, match="tuned-lens folder"):
        load_lens(tmp_path)


def test_lens_affine_per_kind(tmp_path: Path) -> None:
    assert lens_affine("logit", 0, N_LAYERS) == (None, None)
    assert lens_affine("logit", N_LAYERS - 1, N_LAYERS) == (None, None)
    matrices = _matrices([0, 1])
    j = JacobianLens(matrices, n_prompts=1, d_model=D)
    matrix, bias = lens_affine(j, 1, N_LAYERS)
    assert bias is None and torch.equal(matrix, matrices[1])
    assert lens_affine(j, N_LAYERS - 1, N_LAYERS) == (None, None)
    with pytest.raises(CaptureConfigError, match="layer 2"):
        lens_affine(j, 2, N_LAYERS)


def test_check_lens_refuses_another_width_and_unreadable_layers(tmp_path: Path) -> None:
    j = JacobianLens(_matrices([0, 1]), n_prompts=1, d_model=D)
    _tuned_folder(tmp_path / "tuned")
    tuned = TunedLens.load(tmp_path / "tuned")
    ok = dict(hidden_size=D, num_layers=N_LAYERS, model_name=None)
    for name, lens in (("j", j), ("t", tuned)):
        check_lens(lens, name, layers=[0, 1, N_LAYERS - 1], **ok)
        with pytest.raises(CaptureConfigError, match=rf"lenses\['{name}'\].*8.*16"):
            check_lens(lens, name, hidden_size=16, num_layers=N_LAYERS, layers=[0],
                       model_name=None)  # fmt: skip
    with pytest.raises(CaptureConfigError, match=r"lenses\['j'\].*layer 2"):
        check_lens(j, "j", layers=[0, 2], **ok)
    with pytest.raises(CaptureConfigError, match=r"lenses\['t'\].*of 4 layers.*has 8"):
        check_lens(tuned, "t", hidden_size=D, num_layers=8, layers=[0], model_name=None)
    del tuned.translators[2]
    with pytest.raises(CaptureConfigError, match=r"lenses\['t'\].*no translator for layer 1"):
        check_lens(tuned, "t", layers=[0, 1], **ok)
    check_lens("logit", "l", layers=[0, 3], **ok)


def test_check_lens_only_warns_about_another_model_name(tmp_path: Path) -> None:
    j = JacobianLens(_matrices([0]), n_prompts=1, d_model=D, metadata={"model_name": "org/m"})
    _tuned_folder(tmp_path / "tuned")
    tuned = TunedLens.load(tmp_path / "tuned")
    args = dict(hidden_size=D, num_layers=N_LAYERS, layers=[0])
    with pytest.warns(UserWarning, match=r"lenses\['j'\].*'org/m'.*'/local/m'"):
        check_lens(j, "j", model_name="/local/m", **args)
    with pytest.warns(UserWarning, match=r"lenses\['t'\].*'org/model'"):
        check_lens(tuned, "t", model_name="/local/m", **args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lens(j, "j", model_name="org/m", **args)
        check_lens(tuned, "t", model_name="org/model", **args)
        check_lens(j, "j", model_name=None, **args)
        check_lens(JacobianLens(_matrices([0]), n_prompts=1, d_model=D), "j",
                   model_name="x", **args)  # fmt: skip


def test_an_engine_checks_a_lens_by_its_description_without_reading_its_matrices(
    tmp_path, monkeypatch
) -> None:
    """The front end checks a J-lens file or tuned-lens folder with its tensors mapped from
    the file (``torch.load(mmap=True)``), never converted: a lens of gigabytes costs the user's
    process nothing (review D15: each was read whole, to float32, just to be checked). The
    workers still read the whole lens."""
    from probehook.outputs.lens import LensReadout

    j = JacobianLens(_matrices([1]), n_prompts=1, d_model=D).save(tmp_path / "j.pt")  # fp16
    tuned = TunedLens({2: (torch.zeros(D, D), None)}, {"d_model": D, "num_hidden_layers": 4})
    folder = tuned.save(tmp_path / "tuned")
    mapped = []
    real = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: mapped.append(k.get("mmap")) or real(*a, **k)
    )
    got = LensReadout().instances({"j": str(j), "t": str(folder)}, {"lens_layers": [1]},
                                  num_layers=4, hidden_size=D)  # fmt: skip
    assert sorted(got) == ["j@1", "t@1"] and mapped == [True, True]
    described = load_lens(j, weights=False)
    assert not described.weights and described.jacobians[1].dtype == torch.float16
    whole = load_lens(j)
    assert whole.weights and whole.jacobians[1].dtype == torch.float32
    with pytest.raises(CaptureConfigError, match="no matrix for layer 2"):
        LensReadout().instances({"j": str(j)}, {"lens_layers": [2]}, num_layers=4, hidden_size=D)
    with pytest.raises(CaptureConfigError, match="no translator for layer 0"):
        LensReadout().instances({"t": str(folder)}, {"lens_layers": [0]}, num_layers=4,
                                hidden_size=D)  # fmt: skip
