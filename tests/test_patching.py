"""Activation-patching sweeps (docs/patching.md) on a real compiled engine against a hand loop on
Hugging Face: one forward per cell with the clean run's row put in by a hook at the same site.

The prompts (40 tokens: a full 32-token KV block and more) differ at positions 5 and 36; the
corrupt prompt's blocks are in the prefix cache before the sweep (a plain request ran it), so a
cell that read them would skip its patch at position 5 and show the corrupt metric there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from probehook.testing import _hf_model

pytestmark = pytest.mark.engine

CORRUPT = [1, *(3 + (7 * i) % 15 for i in range(39))]  # the tokenizer's 19 ids
CLEAN = list(CORRUPT)
CLEAN[5], CLEAN[36] = 18, 2
ANSWER, FOIL = 7, 9
TOL = 1e-3


@pytest.fixture(scope="module")
def patch_llm(llama_dir: Path) -> Iterator[Any]:
    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        patching=4,  # MiB: 8192 rows of 128
        dtype="float32",
        seed=0,
        max_model_len=256,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        block_size=32,
    )
    yield llm
    llm.shutdown()


def _stream_inputs(model: Any, ids: list[int], hook: str) -> list[torch.Tensor]:
    """Each layer's row at ``hook`` (``[T, H]``) in HF's unpatched forward of ``ids``."""
    rows: list[torch.Tensor] = []
    handles = []
    for layer in model.model.layers:
        if hook == "resid_pre":
            handles.append(layer.register_forward_pre_hook(_keep_input(rows), with_kwargs=True))
        else:
            handles.append(layer.register_forward_hook(_keep_output(rows)))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return rows


def _keep_input(rows: list[torch.Tensor]) -> Any:
    def hook(m: Any, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        rows.append(hidden[0].clone())

    return hook


def _keep_output(rows: list[torch.Tensor]) -> Any:
    def hook(m: Any, args: tuple, out: Any) -> None:
        rows.append((out[0] if isinstance(out, tuple) else out)[0].clone())

    return hook


def _patched_logits(model: Any, ids: list[int], layer: int, hook: str, position: int,
                    row: torch.Tensor, alpha: float) -> torch.Tensor:  # fmt: skip
    """The last row's logits of ``ids`` with ``row`` lerped in at (layer, position)."""
    target = model.model.layers[layer]

    def lerp(h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[0, position] = (1 - alpha) * h[0, position] + alpha * row
        return h

    if hook == "resid_pre":

        def pre(m: Any, args: tuple, kwargs: dict) -> Any:
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": lerp(kwargs["hidden_states"])}
            return (lerp(args[0]), *args[1:]), kwargs

        handle = target.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(m: Any, args: tuple, out: Any) -> Any:
            return (lerp(out[0]), *out[1:]) if isinstance(out, tuple) else lerp(out)

        handle = target.register_forward_hook(post)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].double()
    finally:
        handle.remove()


def _metrics(logits: torch.Tensor) -> tuple[float, float]:
    return float(logits[ANSWER] - logits[FOIL]), float(logits.log_softmax(-1)[ANSWER])


def hf_grid(llama_dir: Path, hook: str, alpha: float = 1.0) -> tuple[np.ndarray, np.ndarray, tuple]:
    """The hand loop: (logit_diff grid, logprob grid, (clean, corrupt) metrics)."""
    model = _hf_model(str(llama_dir), torch.float32)
    clean_rows = _stream_inputs(model, CLEAN, hook)
    layers = len(model.model.layers)
    ld = np.zeros((layers, len(CORRUPT)))
    lp = np.zeros((layers, len(CORRUPT)))
    for layer in range(layers):
        for p in range(len(CORRUPT)):
            logits = _patched_logits(model, CORRUPT, layer, hook, p, clean_rows[layer][p], alpha)
            ld[layer, p], lp[layer, p] = _metrics(logits)
    with torch.no_grad():
        ends = [
            _metrics(model(torch.tensor([ids])).logits[0, -1].double()) for ids in (CLEAN, CORRUPT)
        ]
    return ld, lp, tuple(ends)


@pytest.mark.parametrize("hook", ["resid_pre", "resid_post"])
def test_the_grid_equals_a_hand_loop_on_hugging_face(patch_llm, llama_dir: Path, hook: str) -> None:
    """All three metrics, every layer and prompt position, with the corrupt prompt's blocks
    cached beforehand; a plain request after the sweeps equals the same request before them
    (no cell published its patched blocks)."""
    from probehook import SamplingParams

    plain = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    (before,) = patch_llm.generate([{"prompt_token_ids": CORRUPT}], plain, use_tqdm=False)
    ld, lp, ((clean_ld, clean_lp), (corrupt_ld, corrupt_lp)) = hf_grid(llama_dir, hook)
    want = {"logit_diff": ld, "logprob": lp,
            "recovered": (ld - corrupt_ld) / (clean_ld - corrupt_ld)}  # fmt: skip
    ends = {"logit_diff": (clean_ld, corrupt_ld), "logprob": (clean_lp, corrupt_lp),
            "recovered": (clean_ld, corrupt_ld)}  # fmt: skip
    for metric in ("logit_diff", "logprob", "recovered"):
        sweep = patch_llm.patch_sweep(prompt=CORRUPT, clean_prompt=CLEAN, answer_token_id=ANSWER,
                                      foil_token_id=FOIL, hook=hook, metric=metric,
                                      use_tqdm=False)  # fmt: skip
        assert sweep.grid.shape == (4, len(CORRUPT)) and sweep.grid.dtype == np.float32
        assert sweep.layers == [0, 1, 2, 3] and sweep.positions == list(range(len(CORRUPT)))
        worst = float(np.abs(sweep.grid - want[metric]).max())
        assert worst <= TOL, f"{hook} {metric}: max |engine - HF| {worst:.2e}"
        assert (
            abs(sweep.clean - ends[metric][0]) <= TOL
            and abs(sweep.corrupt - ends[metric][1]) <= TOL
        )
        assert sweep.noise_floor <= TOL and sweep.skipped == [] and sweep.recomputed_tokens == 40
    # at the first layer's input the grid moves only where the prompts differ (5 and 36), and
    # in the last layer's output only at the last position (the others no longer reach it)
    if hook == "resid_pre":
        moved = np.abs(ld[0] - corrupt_ld) > 1e-4
        assert np.flatnonzero(moved).tolist() == [5, 36], np.flatnonzero(moved)
    else:
        assert np.flatnonzero(np.abs(ld[3] - corrupt_ld) > 1e-4).tolist() == [39]
        assert abs(ld[3, 39] - clean_ld) < 1e-4  # the whole last row: the clean run's logits
    (after,) = patch_llm.generate([{"prompt_token_ids": CORRUPT}], plain, use_tqdm=False)
    assert list(after.outputs[0].token_ids) == list(before.outputs[0].token_ids)
    for a, b, token in zip(after.outputs[0].logprobs, before.outputs[0].logprobs,
                           after.outputs[0].token_ids, strict=True):  # fmt: skip
        assert abs(a[token].logprob - b[token].logprob) < 1e-5


def test_alpha_zero_is_the_corrupt_run_and_a_half_lerps(patch_llm, llama_dir: Path) -> None:
    sweep = patch_llm.patch_sweep(prompt=CORRUPT, clean_prompt=CLEAN, answer_token_id=ANSWER,
                                  foil_token_id=FOIL, alpha=0.0, layers=[0, 2],
                                  positions=[0, 5, 36], use_tqdm=False)  # fmt: skip
    assert np.abs(sweep.grid - sweep.corrupt).max() <= TOL
    half = patch_llm.patch_sweep(prompt=CORRUPT, clean_prompt=CLEAN, answer_token_id=ANSWER,
                                 foil_token_id=FOIL, alpha=0.5, layers=[1], positions=[5, 36],
                                 use_tqdm=False)  # fmt: skip
    ld, _, _ = hf_grid(llama_dir, "resid_pre", alpha=0.5)
    assert np.abs(half.grid[0] - ld[1, [5, 36]]).max() <= TOL


def test_prompts_of_different_lengths_align_on_prefix_and_suffix(patch_llm) -> None:
    """Positions between the common prefix and suffix are skipped, listed, and NaN."""
    clean = CORRUPT[:10] + [18, 18, 18] + CORRUPT[12:]  # one token longer
    sweep = patch_llm.patch_sweep(prompt=CORRUPT, clean_prompt=clean, answer_token_id=ANSWER,
                                  foil_token_id=FOIL, layers=[0], use_tqdm=False)  # fmt: skip
    assert sweep.skipped == [10, 11]
    assert sweep.alignment[9] == 9 and sweep.alignment[12] == 13 and sweep.alignment[39] == 40
    assert np.isnan(sweep.grid[0, [10, 11]]).all() and not np.isnan(sweep.grid[0, :10]).any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": [4]}, r"layers \[4\] are out of range: the model has layers 0..3"),
        ({"positions": [40]}, r"positions \[40\] are out of range"),
        ({"alpha": 1.5}, r"alpha=1.5 must be a number in \[0, 1\]"),
        ({"metric": "kl"}, r"metric='kl' is not one of"),
        ({"hook": "attn_out"}, r"hook='attn_out' is not one of"),
        ({"foil_token_id": None}, r"give one of foil_token .* not neither"),
        ({"clean_prompt": None}, r"give clean_prompt .* or corruption="),
        ({"corruption": {"noise": {"span": [3, 8]}}}, r"runs the prompt itself as the clean run"),
        (
            {"clean_prompt": None, "corruption": {"noise": {"span": [30, 41]}}},
            r"span=\[30, 41\] must be \[start, end\) inside the prompt's 40 positions",
        ),
        (
            {"clean_prompt": None, "corruption": {"noise": {"span": [1, 2], "scale": -1}}},
            r"scale=-1 must be a positive number",
        ),
        ({"clean_prompt": None, "corruption": {"blur": {}}}, r"corruption=.* is not valid"),
    ],
)
def test_bad_sweeps_are_refused_by_name(patch_llm, kwargs, message) -> None:
    from probehook import CaptureConfigError

    asked = dict(prompt=CORRUPT, clean_prompt=CLEAN, answer_token_id=ANSWER, foil_token_id=FOIL)
    with pytest.raises(CaptureConfigError, match=message):
        patch_llm.patch_sweep(**{**asked, **kwargs}, use_tqdm=False)


def test_a_sweep_needs_a_patching_engine_and_a_bank_that_holds_it(patch_llm) -> None:
    """The engine's own checks (no engine needed past the tokenizer): no patching entry, a
    bank too small for the sweep, an answer of two tokens."""
    from types import SimpleNamespace

    from probehook import CaptureConfigError
    from probehook.frontend.patch_sweep import patch_sweep

    def never(*args: Any) -> list[Any]:
        raise AssertionError("nothing may run")

    tokenizer = patch_llm.get_tokenizer()

    def sweep(writes: dict, **kwargs: Any) -> Any:
        asked = dict(prompt=CORRUPT, clean_prompt=CLEAN, answer_token_id=ANSWER, foil_token_id=FOIL)

        def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return patch_sweep(never, tokenize, str, writes, **{**asked, **kwargs})

    with pytest.raises(CaptureConfigError, match=r"engine built with patching=True"):
        sweep({})
    small = {f"resid_pre@{i}": {"layer": i, "site": "resid_pre", "rows": 100} for i in range(4)}
    with pytest.raises(CaptureConfigError, match=r"4 layers x 40 clean tokens = 160 rows, but the "
                                                 r"engine's patching bank holds 100"):  # fmt: skip
        sweep({"patch": SimpleNamespace(instances=small)})
    with pytest.raises(
        CaptureConfigError,
        match=r"answer_token='12' is not one token: it tokenizes as \[\d+, \d+\]",
    ):
        sweep({"patch": SimpleNamespace(instances=small)}, answer_token="12", answer_token_id=None)
    with pytest.raises(CaptureConfigError, match=r"engine built with patching=True"):
        from probehook import LLM  # an engine without patching: the same check, by its method

        plain = SimpleNamespace(session=SimpleNamespace(writes={}), capture_only=False,
                                get_tokenizer=lambda: tokenizer)  # fmt: skip
        LLM.patch_sweep(plain, prompt=CORRUPT, clean_prompt=CLEAN, answer_token_id=1,
                        foil_token_id=2)  # fmt: skip


def test_many_pairs_give_the_mean_each_pair_s_grid_and_a_bootstrap_interval(patch_llm) -> None:
    """Two pairs (a list of prompts and of clean prompts, one answer each) in one batch: each
    pair's grid equals its own sweep, the grid is their mean, the interval a seeded bootstrap
    of it."""
    from probehook.frontend.patch_sweep import bootstrap_ci

    other_corrupt = list(CORRUPT)
    other_corrupt[20] = 18
    other_clean = list(CORRUPT)
    pairs = dict(prompt=[CORRUPT, other_corrupt], clean_prompt=[CLEAN, other_clean],
                 answer_token_id=[ANSWER, FOIL], foil_token_id=[FOIL, ANSWER],
                 layers=[0, 3], positions=[5, 20, 36, 39])  # fmt: skip
    both = patch_llm.patch_sweep(**pairs, use_tqdm=False)
    assert both.grids.shape == (2, 2, 4) and both.ci.shape == (2, 2, 4)
    for i in range(2):
        alone = patch_llm.patch_sweep(
            prompt=pairs["prompt"][i], clean_prompt=pairs["clean_prompt"][i],
            answer_token_id=pairs["answer_token_id"][i], foil_token_id=pairs["foil_token_id"][i],
            layers=[0, 3], positions=[5, 20, 36, 39], use_tqdm=False,
        )  # fmt: skip
        assert np.abs(both.grids[i] - alone.grid).max() <= TOL
    np.testing.assert_allclose(both.grid, both.grids.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(both.ci, bootstrap_ci(both.grids, 0))
    assert (both.ci[0] <= both.grid + 1e-6).all() and (both.grid <= both.ci[1] + 1e-6).all()
    with pytest.raises(Exception, match="both lists of one length"):
        patch_llm.patch_sweep(prompt=[CORRUPT], clean_prompt=CLEAN, answer_token_id=ANSWER,
                              foil_token_id=FOIL, use_tqdm=False)  # fmt: skip


def test_noise_corruption_equals_hugging_face_with_the_same_noise(patch_llm, llama_dir) -> None:
    """ROME's causal tracing: the prompt is the clean run, its copy with seeded Gaussian noise
    (3 x the input embeddings' standard deviation) on positions [3, 8) the corrupt one; every
    cell equals HF with the same noise added at layer 0's input and the clean row put back."""
    from probehook.frontend.patch_sweep import noise_rows

    span, layers, positions = (3, 8), [0, 2], [0, 4, 6, 39]
    sweep = patch_llm.patch_sweep(
        prompt=CORRUPT, corruption={"noise": {"span": list(span), "scale": 3.0, "seed": 7}},
        answer_token_id=ANSWER, foil_token_id=FOIL, layers=layers, positions=positions,
        use_tqdm=False,
    )  # fmt: skip
    model = _hf_model(str(llama_dir), torch.float32)
    std = float(model.model.embed_tokens.weight.double().std(unbiased=False))
    assert abs(sweep.corruption["std"] - std) <= 1e-6 * std
    noise = torch.from_numpy(noise_rows(7, span[1] - span[0], 128, 3.0, std))
    clean_rows = _stream_inputs(model, CORRUPT, "resid_pre")

    def add_noise(m: Any, args: tuple, kwargs: dict) -> Any:
        key = "hidden_states" in kwargs
        h = (kwargs["hidden_states"] if key else args[0]).clone()
        h[0, span[0] : span[1]] += noise
        return (args, {**kwargs, "hidden_states": h}) if key else ((h, *args[1:]), kwargs)

    handle = model.model.layers[0].register_forward_pre_hook(add_noise, with_kwargs=True)
    try:
        with torch.no_grad():
            corrupt_ld, _ = _metrics(model(torch.tensor([CORRUPT])).logits[0, -1].double())
        for i, layer in enumerate(layers):
            for j, p in enumerate(positions):
                logits = _patched_logits(model, CORRUPT, layer, "resid_pre", p,
                                         clean_rows[layer][p], 1.0)  # fmt: skip
                ld, _ = _metrics(logits)
                assert abs(sweep.grid[i, j] - ld) <= TOL, (layer, p, sweep.grid[i, j], ld)
    finally:
        handle.remove()
    assert abs(sweep.corrupt - corrupt_ld) <= TOL
    assert abs(sweep.grid[0, 1] - sweep.corrupt) > 0.1  # position 4 at layer 0: its noise undone
    assert abs(sweep.grid[0, 0] - sweep.corrupt) <= TOL  # position 0: no noise there


def test_every_position_of_one_layer_s_input_patched_gives_the_clean_metric(patch_llm) -> None:
    """The write terms take several cells a request: the clean run kept at layer 2's input,
    then the corrupt prompt with all 40 of its rows there put back is the clean run from
    there on (its logit difference the clean one)."""
    from probehook import SamplingParams

    def run(ids: list[int], patch: dict) -> float:
        extra = {"probehook": {"layers": [], "patch": patch}}
        params = SamplingParams(max_tokens=1, temperature=0, logprob_token_ids=[ANSWER, FOIL],
                                extra_args=extra)  # fmt: skip
        (out,) = patch_llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        logprobs = out.outputs[0].logprobs[0]
        return logprobs[ANSWER].logprob - logprobs[FOIL].logprob

    clean = run(CLEAN, {"resid_pre@2": {"keep": 1, "run": "every"}})
    cells = [[p, 1 + p, 1.0] for p in range(len(CORRUPT))]
    patched = run(CORRUPT, {"resid_pre@2": {"cells": cells, "run": "every"}})
    corrupt = run(CORRUPT, {"resid_pre@2": {"cells": cells[:1], "run": "every-but"}})
    assert abs(patched - clean) <= TOL and abs(corrupt - clean) > 0.1
