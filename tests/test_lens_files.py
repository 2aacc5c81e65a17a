"""Lens files without an engine: the J-lens artifact TransformerLens 3.9 writes and reads (both
ways), its fit checkpoint, the tuned-lens package's folder (against a hand computation of
its translators), what the worker applies at each layer, and the clear errors (a file that is
not a lens, pickled code, another model's width, a layer the lens has no map for)."""

from __future__ import annotations

import json
import pickle
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


def _matrices(layers: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(D, D, generator=g) for layer in layers}


def test_a_j_lens_round_trips_with_transformer_lens(tmp_path: Path) -> None:
    from transformer_lens.tools.analysis.jacobian_lens import JacobianLens as TLLens

    matrices = _matrices([0, 1, 2])
    TLLens(matrices, n_prompts=7, d_model=D, metadata={"model_name": "m"}).save(
        str(tmp_path / "tl.pt")
    )
    ours = JacobianLens.load(tmp_path / "tl.pt")
    assert ours.source_layers == [0, 1, 2] and ours.n_prompts == 7
    assert ours.metadata["model_name"] == "m" and ours.path == str(tmp_path / "tl.pt")
    for layer, m in matrices.items():  # stored as fp16 by both
        assert torch.equal(ours.jacobians[layer], m.half().float())
    ours.save(tmp_path / "ours.pt")
    back = TLLens.load(str(tmp_path / "ours.pt"))
    assert back.source_layers == [0, 1, 2] and back.n_prompts == 7 and back.d_model == D
    for layer, m in matrices.items():
        assert torch.equal(back.jacobians[layer], m.half().float())
    # The last layer (3 of 4) is the identity; a layer it was not fitted on is refused.
    assert lens_affine(ours, 3, 4) == (None, None)
    assert torch.equal(lens_affine(ours, 1, 4)[0], m_half(matrices[1]))
    with pytest.raises(CaptureConfigError, match=r"no matrix for layer 4.*fitted on layers"):
        lens_affine(ours, 4, 6)


def m_half(m: torch.Tensor) -> torch.Tensor:
    return m.half().float()


def test_a_fit_checkpoint_is_averaged(tmp_path: Path) -> None:
    sums = _matrices([0, 1])
    torch.save({"jacobian_sum": sums, "n_done": 4, "target_layer": 3}, tmp_path / "ck.pt")
    lens = load_lens(tmp_path / "ck.pt")
    assert isinstance(lens, JacobianLens) and lens.n_prompts == 4
    torch.testing.assert_close(lens.jacobians[1], sums[1] / 4)
    assert lens.metadata["converted_from"] == "jacobian_lens_checkpoint"


def _tuned_folder(folder: Path, layers: int = 4) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"d_model": D, "num_hidden_layers": layers, "bias": True,
                    "base_model_name_or_path": "org/model"})
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    params = {}
    for i in range(layers):
        params[f"{i}.weight"] = torch.randn(D, D, generator=g)
        params[f"{i}.bias"] = torch.randn(D, generator=g)
    torch.save(params, folder / "params.pt")
    return params


def test_a_tuned_lens_uses_translator_l_plus_one_and_the_identity_last(tmp_path: Path) -> None:
    params = _tuned_folder(tmp_path / "tuned")
    lens = load_lens(tmp_path / "tuned")
    assert isinstance(lens, TunedLens) and lens.path == str(tmp_path / "tuned")
    h = torch.randn(D)
    for layer in range(3):  # the package's translator: h + W h + b, on HF hidden_states[L + 1]
        matrix, bias = lens_affine(lens, layer, 4)
        want = h + params[f"{layer + 1}.weight"] @ h + params[f"{layer + 1}.bias"]
        torch.testing.assert_close(matrix @ h + bias, want)
    assert lens_affine(lens, 3, 4) == (None, None)
    lens.save(tmp_path / "again")
    again = TunedLens.load(tmp_path / "again")
    assert sorted(again.translators) == [0, 1, 2, 3]
    assert torch.equal(again.translators[2][0], params["2.weight"])
    assert json.loads((tmp_path / "again" / "config.json").read_text())["bias"] is True


def test_checks_name_what_is_wrong(tmp_path: Path) -> None:
    _tuned_folder(tmp_path / "tuned")
    tuned = load_lens(tmp_path / "tuned")
    with pytest.raises(CaptureConfigError, match=r"d_model 8.*hidden size is 16"):
        check_lens(tuned, "t", hidden_size=16, num_layers=4, layers=[1])
    with pytest.raises(CaptureConfigError, match="tuned lens of 4 layers, and the model has 6"):
        check_lens(tuned, "t", hidden_size=D, num_layers=6, layers=[1])
    with pytest.warns(UserWarning, match="fitted on 'org/model'"):
        check_lens(tuned, "t", hidden_size=D, num_layers=4, layers=[1], model_name="/local/m")
    check_lens("logit", "l", hidden_size=D, num_layers=4, layers=[0, 3])
    for bad, match in [
        (tmp_path / "missing.pt", "no such file or folder"),
        (3, "is not a lens"),
        ("logits", "no such file or folder"),
    ]:
        with pytest.raises(CaptureConfigError, match=match):
            load_lens(bad)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CaptureConfigError, match="neither a 'J' key"):
        load_lens(tmp_path / "other.pt")


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what a malicious file would carry
        return (print, ("ran code",))


def test_a_pickled_object_is_refused_not_run(tmp_path: Path, capsys) -> None:
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"J": _Payload()}, f)
    with pytest.raises(CaptureConfigError, match=r"evil.pt.*weights_only=True"):
        load_lens(tmp_path / "evil.pt")
    assert "ran code" not in capsys.readouterr().out


def test_lens_vectors_are_rows_of_the_unembedding_times_the_map(tmp_path: Path) -> None:
    """``SteeringVector.from_lens``: ``v_t = M^T W_U[t]`` (TransformerLens's J-lens vectors)
    at the lens's layer, ``W_U`` the model's own (here read by transformers for comparison)."""
    from transformers import AutoModelForCausalLM

    from probehook import SteeringVector, tiny_model_path

    model = tiny_model_path()
    w_u = AutoModelForCausalLM.from_pretrained(model).lm_head.weight.detach().float()
    d = w_u.shape[1]
    g = torch.Generator().manual_seed(5)
    lens = JacobianLens({1: torch.randn(d, d, generator=g)}, n_prompts=1, d_model=d,
                        metadata={"model_name": str(model)})  # fmt: skip
    lens.save(tmp_path / "j.pt")
    vector = SteeringVector.from_lens(JacobianLens.load(tmp_path / "j.pt"), 1, 7, scale=2.0)
    assert tuple(vector.layers) == (1,)
    want = 2.0 * lens.jacobians[1].half().float().T @ w_u[7]
    torch.testing.assert_close(vector.vectors[1], want)
    logit = SteeringVector.from_lens("logit", 3, 7, model=model)
    torch.testing.assert_close(logit.vectors[3], w_u[7])
    assert logit.made_by["method"] == "lens"
    with pytest.raises(CaptureConfigError, match="pass model=PATH"):
        SteeringVector.from_lens("logit", 3, 7)
    with pytest.raises(CaptureConfigError, match="outside the model's vocabulary"):
        SteeringVector.from_lens("logit", 3, 10_000, model=model)
