"""``fit_jacobian_lens`` against its oracle, TransformerLens 3.9's ``JacobianLens.fit``.

Both fit the bundled tiny Llama (hidden 128, 4 layers) on the same prompts and settings and must
give the same matrices to float rounding; the file ``path=`` writes must read back in
TransformerLens as the same lens. TransformerLens is only the oracle here: probehook itself never
imports it. The prompts cover a prompt too short to fit on (skipped with a warning), one longer
than the model's 64-token context (cut there) and, with ``dim_batch=48``, a last backward pass
over fewer than ``dim_batch`` dimensions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from probehook.lenses.fit import fit_jacobian_lens
from probehook.models import tiny_model_path

PROMPTS = [
    "12+34=46. 5+6=11. 70+8=78. 9+9=18.",
    "1+2=",  # 5 tokens: too short for both settings' skips, so skipped with a warning
    "12+34=46. " * 8,  # 81 tokens: over the tiny model's context length of 64
]

SETTINGS: list[dict[str, Any]] = [
    {},  # TransformerLens's defaults: every layer but the last, dim_batch 8, skip 16
    # 48 does not divide 128: the last backward pass covers fewer dimensions
    {"layers": [-2, 0], "dim_batch": 48, "max_seq_len": 10, "skip_first_positions": 4},
]


@pytest.fixture(scope="module")
def bridge() -> Any:
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(str(tiny_model_path()), device="cpu")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is faster than two contending ones (3x here on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "custom"])
def test_fit_and_file_match_transformer_lens(
    bridge: Any, settings: dict[str, Any], tmp_path: Path, one_thread: None
) -> None:
    from transformer_lens.tools.analysis import JacobianLens

    tl_settings = {k: v for k, v in settings.items() if k != "layers"}
    with pytest.warns(UserWarning, match="skipping"):
        expected = JacobianLens.fit(
            bridge, PROMPTS, corpus="arith", source_layers=settings.get("layers"),
            show_progress=False, **tl_settings,
        )  # fmt: skip
    out = tmp_path / "lens.pt"
    with pytest.warns(UserWarning, match="skipping"):
        ours = fit_jacobian_lens(
            str(tiny_model_path()), PROMPTS, corpus="arith", path=str(out), progress=False,
            **settings,
        )  # fmt: skip

    assert ours["n_prompts"] == expected.n_prompts == 2
    assert ours["d_model"] == expected.d_model == 128
    assert sorted(ours["jacobians"]) == expected.source_layers
    for layer, matrix in expected.jacobians.items():
        got = ours["jacobians"][layer]
        assert got.dtype == torch.float32
        assert got.abs().max() > 0.1  # a real Jacobian, not zeros on both sides
        torch.testing.assert_close(got, matrix, atol=1e-5, rtol=1e-4)
    shared = ("corpus", "n_prompts", "target_layer", "dim_batch", "max_seq_len",
              "skip_first_positions", "model_name", "hook_convention", "fit_dtype")  # fmt: skip
    for key in shared:
        assert ours["metadata"][key] == expected.metadata[key], key

    # the file: TransformerLens's artifact format, read back by TransformerLens as our lens
    loaded = JacobianLens.load(str(out)).validate_model(bridge)
    assert (loaded.n_prompts, loaded.d_model) == (ours["n_prompts"], ours["d_model"])
    assert loaded.metadata == ours["metadata"]
    assert loaded.source_layers == sorted(ours["jacobians"])
    for layer, matrix in ours["jacobians"].items():  # stored in fp16, as TransformerLens does
        torch.testing.assert_close(loaded.jacobians[layer], matrix.half().float(), atol=0, rtol=0)
