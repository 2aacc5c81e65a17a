"""SAE features of every token, read inside a real engine (compiled mode, chunked prefill,
prefix caching, n = 2, 24+ concurrent requests), against SAELens's own ``encode`` of Hugging
Face's rows (the margin rule of tests/sae_oracle.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sae_oracle import (
    assert_features_match,
    assert_output_features,
    hf_streams_clamped,
    make_saelens_sae,
    oracle,
)

pytestmark = pytest.mark.engine

HIDDEN = 128
TOP_K = 16
SAES = {
    # name: (architecture, hook name, layer it means, extra config)
    "res1": ("jumprelu", "blocks.1.hook_resid_post", 1, {}),
    "res2": ("standard", "blocks.3.hook_resid_pre", 2, {}),
    "res3": ("topk", "model.layers.3", 3, {"k": 24}),
}
PROMPTS = ["1+2=", "12+34=56. 7+", "99+99=198. 3+4=7. 50+5", "0", "7+7=14. 8+8=16. 9+9="]


@pytest.fixture(scope="module")
def sae_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saes")
    return {
        name: make_saelens_sae(arch, root / name, HIDDEN, 512, hook, seed=i, **extra)
        for i, (name, (arch, hook, _, extra)) in enumerate(SAES.items())
    }


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sae_store") / "store"


@pytest.fixture(scope="module")
def sae_llm(
    llama_dir: Path, engine_defaults: dict, sae_dirs: dict[str, Path], store_dir: Path
) -> Iterator[Any]:
    """Compiled, SAEs only (no rows), prompt features, a store, small prefill chunks and KV
    cache, prefix caching on, an ablation at layer 1 (with the clamps there); in-process."""
    from probehook import LLM, SAE, SteeringVector

    llm = LLM(
        str(llama_dir),
        store=store_dir,
        saes={
            "res1": SAE.load(sae_dirs["res1"]),
            "res2": str(sae_dirs["res2"]),
            "res3": sae_dirs["res3"],
        },  # fmt: skip
        sae_top_k=TOP_K,
        sae_clamping=True,
        steering={"abl": SteeringVector({1: ABLATED}).with_op("ablate")},
        include_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        num_gpu_blocks_override=24,
        block_size=32,
        **engine_defaults,
    )
    yield llm
    llm.shutdown()


def _oracles(sae_dirs: dict[str, Path]) -> dict[str, Any]:
    return {name: oracle(folder) for name, folder in sae_dirs.items()}


LAYERS = {name: layer for name, (_, _, layer, _) in SAES.items()}
ABLATED = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(52))


def test_the_user_process_holds_no_weights_of_a_folder(sae_llm, sae_dirs) -> None:
    """An SAE given as a folder is read for its config and shapes in the user's process (the
    workers read the weights); one given loaded stays as it was; the engine's session keeps
    each SAE's settings only (JSON: folder, layer, fingerprint), no tensors."""
    import json

    from probehook import SAE
    from probehook.saes.readout import SAEReadout

    given = {"res1": SAE.load(sae_dirs["res1"]), "res2": str(sae_dirs["res2"])}
    read = SAEReadout().named_specs(given)
    assert read["res1"] is given["res1"] and read["res1"].has_weights
    assert not read["res2"].has_weights
    instances = sae_llm.session.readouts["sae"].instances
    assert sorted(instances) == ["res1", "res2", "res3"]
    assert json.loads(json.dumps(instances)) == instances


def test_features_under_load_equal_saelens(sae_llm, llama_dir: Path, sae_dirs) -> None:
    """27 requests at once: every SAE, a subset, a smaller k, none, n = 2, a repeated prompt
    (prefix cache); requests without SAEs generate what the others generate."""
    from probehook import SamplingParams

    lenses = _oracles(sae_dirs)
    asks: list[tuple[str, dict[str, Any], int]] = []
    for i in range(27):
        prompt = PROMPTS[i % len(PROMPTS)]
        options = [{}, {"saes": ["res3"]}, {"saes": ["res1", "res2"], "sae_top_k": 4},
                   {"saes": False}, {"saes": True}][i % 5]  # fmt: skip
        asks.append((prompt, options, 2 if i % 7 == 3 else 1))
    params = [
        SamplingParams(
            max_tokens=6,
            temperature=0 if n == 1 else 1.0,
            ignore_eos=True,
            n=n,
            extra_args={"probehook": options},
        )
        for _, options, n in asks
    ]
    outs = sae_llm.generate([prompt for prompt, _, _ in asks], params)
    tokens_by_prompt: dict[str, list[int]] = {}
    for (prompt, options, n), out in zip(asks, outs, strict=True):
        assert len(out.outputs) == n
        if n == 1:  # greedy: the same tokens with or without SAEs
            tokens = list(out.outputs[0].token_ids)
            assert tokens_by_prompt.setdefault(prompt, tokens) == tokens, prompt
        saes = options.get("saes", True)
        names = tuple(SAES) if saes is True else tuple(saes) if saes else ()
        if not names:
            assert out.sae_features == {} and out.prefill_sae_features == {}
            continue
        k = options.get("sae_top_k", TOP_K)
        assert_output_features(out, llama_dir, lenses, LAYERS, names, k)


def test_features_are_stored_without_rows(sae_llm, store_dir: Path, sae_dirs) -> None:
    """The store holds each output's features exactly, sparse, and no rows; the run names
    each SAE's fingerprint, layer and k."""
    from probehook import SAE, ActivationStore, SamplingParams

    options = {"saes": ["res1", "res3"], "sae_top_k": 8}
    params = SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, extra_args={"probehook": options}
    )
    outs = sae_llm.generate(PROMPTS[:3], params)
    store = ActivationStore.open(store_dir)
    for out in outs:
        stored = store[out.store_id]
        assert stored.hidden_states == {} and stored.prefill_hidden_states == {}
        for name in ("res1", "res3"):
            for got, want in [
                (stored.sae_features[name], out.outputs[0].sae_features[name]),
                (stored.prefill_sae_features[name], out.prefill_sae_features[name]),
            ]:
                assert torch.equal(got.indices, want.indices)
                assert torch.equal(got.values, want.values) and torch.equal(got.l0, want.l0)
        assert sorted(stored.sae_features) == ["res1", "res3"]
    saes = store.runs[store[outs[0].store_id].run]["saes"]
    assert saes["res3"]["fingerprint"] == SAE.load(sae_dirs["res3"]).fingerprint
    assert (saes["res3"]["layer"], saes["res3"]["k"], saes["res1"]["d_sae"]) == (3, TOP_K, 512)


def test_feature_monitors_flag_and_stop(sae_llm) -> None:
    """A flag monitor lists the decode rows where the feature crosses (as the returned
    features show it); a stop monitor ends the completion at the first, in the worker, with
    the feature named; both per request, on an SAE the request reads."""
    from probehook import SamplingParams

    def run(monitors: list | None = None, max_tokens: int = 10) -> Any:
        options: dict[str, Any] = {"saes": ["res1"]}
        if monitors is not None:
            options["monitors"] = monitors
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args={"probehook": options}
        )
        return sae_llm.generate([PROMPTS[2]], params)[0].outputs[0]

    plain = run()
    features = plain.sae_features["res1"]
    # A feature whose activation first rises above everything before it at row j >= 2.
    found = None
    for j in range(2, len(features)):
        for feature in features.indices[j].tolist():
            if feature < 0:
                continue
            values = features.activation(feature)
            threshold = float(values[:j].max())
            if float(values[j]) > threshold + 1e-2:
                found = (j, feature, threshold + 5e-3)
                break
        if found:
            break
    assert found is not None, "no feature rises mid-generation"
    j, feature, threshold = found
    key = f"res1:{feature}"
    watch = {"sae": "res1", "feature": feature, "threshold": threshold}
    flagged = run([{**watch, "action": "flag"}])
    assert list(flagged.token_ids) == list(plain.token_ids)
    expected = [i for i, v in enumerate(features.activation(feature).tolist()) if v > threshold]
    assert flagged.feature_flags == {key: expected} and expected[0] == j
    stopped = run([{**watch, "action": "stop"}])
    assert len(stopped.token_ids) == j + 1 and stopped.finish_reason == "stop"
    assert stopped.stop_reason == f"feature:{key}"
    assert list(stopped.token_ids[:j]) == list(plain.token_ids[:j])


def test_clamping_equals_hf_with_the_same_hook(sae_llm, llama_dir: Path, sae_dirs) -> None:
    """Feature 1 of res1 held at 0 (removed where it was on) and another held at 3.0 on every
    token, in compiled mode: every layer's features downstream equal SAELens's on Hugging
    Face's streams with the same hook (teacher-forced on the engine's tokens). The clamped
    prompt's KV is never shared with the unclamped one's (prefix-cache salt): the clamped
    request below reads no prompt rows, so it would take the cached blocks if it could."""
    from probehook import SamplingParams

    lenses = _oracles(sae_dirs)
    prompt = PROMPTS[2] * 3  # two full KV blocks of 32 tokens: cached and shareable
    plain_params = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, extra_args={"probehook": {}}
    )
    plain = sae_llm.generate([prompt], plain_params)[0]
    on = plain.prefill_sae_features["res1"]
    strong = int(on.indices[-1, 0])  # on at the last prompt token: clamp it off
    off = next(f for f in range(512) if bool((on.indices != f).all()))  # never in the top k
    held = {strong: 0.0, off: 3.0}
    options = {"clamp": {"res1": {str(f): v for f, v in held.items()}}, "include_prefill": False}
    for _ in range(2):  # the second run could reuse the first's blocks: it must not
        clamped = sae_llm.generate(
            [prompt],
            SamplingParams(
                max_tokens=6, temperature=0, ignore_eos=True, extra_args={"probehook": options}
            ),  # fmt: skip
        )[0]
        tokens = list(clamped.prompt_token_ids) + list(clamped.outputs[0].token_ids)
        ref = hf_streams_clamped(llama_dir, tokens, 1, lenses["res1"], held)
        p, n = len(clamped.prompt_token_ids), len(clamped.outputs[0].token_ids)
        for name in SAES:
            f = clamped.outputs[0].sae_features[name]
            rows = ref[LAYERS[name], p - 1 : p - 1 + n]
            assert_features_match(f.indices, f.values, f.l0, lenses[name], rows, TOP_K)
        # The held feature reads back near its value where the clamp wrote it.
        assert not bool((clamped.outputs[0].sae_features["res1"].indices == strong).all())
        # The output says what was held, on every token (the viewer marks it).
        want = {"res1": {str(f): v for f, v in held.items()}}
        assert clamped.outputs[0].steering == {
            "vectors": {}, "phase": "both", "start": 0, "clamp": want
        }  # fmt: skip
    assert plain.outputs[0].steering is None
    stats = next(s for s in sae_llm.collective_rpc("probehook_stats") if s is not None)
    assert stats["steps_written"] > 0


def test_a_clamp_then_an_ablation_at_one_layer_equal_hf_in_that_order(
    sae_llm, llama_dir: Path, sae_dirs
) -> None:
    """One request clamps a feature of res1 and ablates a direction at the same layer: the
    clamp applies first, then the steering op (docs/steering.md "Order"), and every SAE's
    features downstream equal SAELens's on HF with that hook; the reverse order would not."""
    from probehook import SamplingParams
    from probehook.testing_steering import apply_op

    lenses = _oracles(sae_dirs)
    prompt = PROMPTS[4]
    options = {"clamp": {"res1": {"5": 4.0}}, "steer": {"abl": 1.0}, "include_prefill": False}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            extra_args={"probehook": options})  # fmt: skip
    out = sae_llm.generate([prompt], params)[0]
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)

    def ablate(stream: torch.Tensor) -> torch.Tensor:
        return apply_op(stream, "ablate", {}, ABLATED, 1.0).float()

    ref = hf_streams_clamped(llama_dir, tokens, 1, lenses["res1"], {5: 4.0}, then=ablate)
    p, n = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    for name in SAES:
        f = out.outputs[0].sae_features[name]
        rows = ref[LAYERS[name], p - 1 : p - 1 + n]
        assert_features_match(f.indices, f.values, f.l0, lenses[name], rows, TOP_K)
    u = ABLATED / ABLATED.norm()
    assert float((ref[1, p - 1 :] @ u).abs().max()) < 1e-4  # the oracle ablated last
    assert out.outputs[0].steering["ops"] == {"abl": "ablate"}
    assert out.outputs[0].steering["clamp"] == {"res1": {"5": 4.0}}


def test_bad_sae_requests_fail_before_generation(sae_llm) -> None:
    from probehook import SAEError, SamplingParams

    for options, match in [
        ({"saes": ["nope"]}, "not engine SAEs"),
        ({"sae_top_k": TOP_K + 1}, rf"in 1\.\.{TOP_K} \(the engine's sae_top_k"),
        ({"sae_top_k": 0}, rf"sae_top_k=0 is not valid: pass an int in 1\.\.{TOP_K}"),
        ({"saes": "res1"}, "list of readout names"),
        (
            {"saes": ["res1"], "monitors": [{"sae": "res2", "feature": 1, "threshold": 0}]},
            "does not read",
        ),
        ({"monitors": [{"sae": "res1", "feature": 512, "threshold": 0}]}, "out of range"),
        ({"monitors": [{"sae": "res1", "feature": 1}]}, "'threshold' required"),
        ({"clamp": {"nope": {"1": 0.0}}}, "does not have"),
        ({"clamp": {"res1": {"512": 0.0}}}, "out of range"),
        ({"clamp": {"res1": {"x": 0.0}}}, "not a feature index"),
    ]:
        with pytest.raises(ValueError, match=match) as error:
            sae_llm.generate(
                ["1+1="], SamplingParams(max_tokens=2, extra_args={"probehook": options})
            )
        assert isinstance(error.value, SAEError) or "probehook option" in str(error.value)


def test_construction_refuses_a_wrong_sae(llama_dir: Path, engine_defaults: dict, tmp_path) -> None:
    """Before any engine starts: another hidden size, a layer the model lacks."""
    from probehook import LLM, SAE, SAEError

    wide = make_saelens_sae("standard", tmp_path / "wide", 64, 32, "blocks.1.hook_resid_post")
    with pytest.raises(SAEError, match="d_in=64.*hidden size is 128"):
        LLM(str(llama_dir), saes={"wide": wide}, **engine_defaults)
    deep = make_saelens_sae("standard", tmp_path / "deep", HIDDEN, 32, "blocks.9.hook_resid_post")
    with pytest.raises(SAEError, match="layer 9"):
        LLM(str(llama_dir), saes={"deep": SAE.load(deep)}, **engine_defaults)
    with pytest.raises(SAEError, match="sae_top_k"):
        LLM(str(llama_dir), saes={"d": SAE.load(deep, layer=1)}, sae_top_k=0, **engine_defaults)
