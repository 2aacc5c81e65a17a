"""Capture-only engines: one forward pass per prompt, prompt rows only, and no layer after the
deepest one captured or probed (compiled mode, chunked prefill, prefix caching, a store)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import random_probes

from probehook.testing import hf_residual_stream

pytestmark = pytest.mark.engine

# Up to ~150 tokens: many prompts span several 32-token prefill chunks.
PROMPTS = [" ".join(f"{i * 7 + j}+{j}" for j in range(1 + i)) for i in range(24)]


@pytest.fixture(scope="module")
def capture_engine(
    llama_dir: Path, llama_lenses: dict[str, str], engine_defaults: dict, tmp_path_factory
) -> Iterator[Any]:
    """Compiled, layer 1 of 4 captured, probes on layers 0 and 1, the logit, J and tuned
    lenses on layers 0 and 1: layers 2-3 never run; the lenses apply the final norm and
    the LM head, which the model's own stream skips."""
    from probehook import LLM

    probes = random_probes(128)
    llm = LLM(
        str(llama_dir),
        layers=[1],
        probes={"size": probes["size"], "truth": probes["truth"]},
        capture_only=True,
        lenses=llama_lenses,
        lens_layers=[0, 1],
        store=tmp_path_factory.mktemp("capture-only") / "store",
        max_num_batched_tokens=32,
        max_num_seqs=16,
        enable_prefix_caching=True,
        **engine_defaults,
    )
    llm.test_probes = probes
    yield llm
    llm.shutdown()


def _assert_rows_equal_hf(llama_dir: Path, output: Any, probes: dict[str, Any]) -> None:
    ref = hf_residual_stream(llama_dir, list(output.prompt_token_ids))
    rows = output.prefill_hidden_states
    assert sorted(rows) == [1]
    assert rows[1].shape == (len(output.prompt_token_ids), 128)
    assert (rows[1] - ref[1]).abs().max().item() <= 1e-3
    scores = output.prefill_probe_scores
    assert sorted(scores) == ["size", "truth"]
    for name in ("size", "truth"):
        want = probes[name].score(ref[probes[name].layer])
        assert (scores[name] - want).abs().max().item() <= 1e-3, name


def test_rows_equal_hf_under_chunked_prefill_and_concurrency(
    capture_engine, llama_dir, llama_lenses
) -> None:
    from probehook.testing import assert_lens_matches_hf

    outputs = capture_engine.capture(PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
    assert [o.item_id for o in outputs] == [f"p{i}" for i in range(len(PROMPTS))]
    for output in outputs:
        _assert_rows_equal_hf(llama_dir, output, capture_engine.test_probes)
        # Every prompt row's next token under each lens; the last row's is not known (NaN).
        assert_lens_matches_hf(llama_dir, output, llama_lenses, [0, 1])
        assert output.outputs is None  # nothing pooled: the model stopped early
        assert output.store_id is not None


def test_the_model_stops_after_the_deepest_tapped_layer(capture_engine) -> None:
    info = capture_engine.capture_info
    assert info["layers_run"] == 2, info  # layers 0 and 1 of 4
    assert info["cut"] == ["model.layers[2:4]", "model.norm"], info


def test_prefix_cached_prompts_return_every_row(capture_engine, llama_dir) -> None:
    """The second capture of a prompt would hit the prefix cache: it is recomputed."""
    prompt = PROMPTS[-1]
    first, second = (capture_engine.capture([prompt], use_tqdm=False)[0] for _ in range(2))
    assert len(second.prompt_token_ids) > 64  # two whole cached blocks at least
    torch.testing.assert_close(
        second.prefill_hidden_states[1], first.prefill_hidden_states[1], atol=1e-5, rtol=0
    )
    _assert_rows_equal_hf(llama_dir, second, capture_engine.test_probes)


def test_store_keeps_item_ids_and_rows(capture_engine) -> None:
    from probehook.store import ActivationStore

    outputs = capture_engine.capture(
        ["1+1=2", {"prompt_token_ids": [1, 5, 14, 5]}], ids=["x", 7], use_tqdm=False
    )
    store = ActivationStore.open(capture_engine.store.root)
    for output, item_id in zip(outputs, ["x", "7"], strict=True):
        record = store[output.store_id]
        assert record.item_id == item_id
        assert record.prompt_token_ids == list(output.prompt_token_ids)
        assert torch.equal(record.prefill_hidden_states[1], output.prefill_hidden_states[1])
        assert torch.equal(
            record.prefill_probe_scores["truth"], output.prefill_probe_scores["truth"]
        )
        kept = record.top_k("lens", phase="prefill")["j@1"]
        assert torch.equal(kept.token_ids, output.prefill_lens["j"][1].token_ids)
        torch.testing.assert_close(  # the last row's target is NaN: no next token
            kept.target_logprob, output.prefill_lens["j"][1].target_logprob, rtol=0, atol=0,
            equal_nan=True,
        )  # fmt: skip
    assert {"x", "7"} <= store.item_ids()


def test_generate_and_bad_ids_are_refused(capture_engine) -> None:
    from probehook.errors import CaptureConfigError

    with pytest.raises(CaptureConfigError, match="capture-only engine.*Use capture"):
        capture_engine.generate(["1+1="])
    with pytest.raises(CaptureConfigError, match="chat"):
        capture_engine.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(CaptureConfigError, match=r"Duplicate item ids in ids: \['a'\]"):
        capture_engine.capture(["x", "y", "z"], ids=["a", "b", "a"])
    with pytest.raises(CaptureConfigError, match="2 ids for 3 prompts"):
        capture_engine.capture(["x", "y", "z"], ids=["a", "b"])


def test_capture_needs_a_capture_only_engine(eager_llm) -> None:
    from probehook.errors import CaptureConfigError

    with pytest.raises(CaptureConfigError, match="capture_only=True"):
        eager_llm.capture(["1+1="])


def test_lenses_with_tied_embeddings(tmp_path: Path, engine_defaults: dict) -> None:
    """A capture-only engine of a model whose LM head is its embedding matrix (the checkpoint
    has no ``lm_head.weight``): the rebuilt head reads the embeddings, and the logit lens
    equals Hugging Face's on every prompt row."""
    from helpers import build_random_checkpoint

    from probehook import LLM
    from probehook.testing import assert_lens_matches_hf

    tied = build_random_checkpoint(tmp_path / "tied", num_layers=2, seed=5, tie_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(tied / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.startswith("lm_head")]  # noqa: SIM118
    options = {**engine_defaults, "enforce_eager": True}
    llm = LLM(str(tied), lenses={"l": "logit"}, lens_layers=[0], capture_only=True, **options)
    try:
        for out in llm.capture(PROMPTS[:4], use_tqdm=False):
            assert_lens_matches_hf(tied, out, {"l": "logit"}, [0])
    finally:
        llm.shutdown()
