"""Several engines in one process, and tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engine
PROMPTS = ["1+2=", "12+34=56. 7+"]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shape of ``llama_dir`` with other weights: rows tell the two engines apart."""
    from helpers import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("llama-b"), arch="llama", seed=2)


def test_two_llms_in_one_process_capture_their_own_rows(
    compiled_llm, llama_dir: Path, other_llama_dir: Path, engine_defaults: dict
) -> None:
    """Two engines, other weights and other captures, requests of both in flight at once
    with the same prompts: each engine's rows equal Hugging Face on its own weights (rows
    from the other engine, or the other engine's capture, would not)."""
    from probehook import LLM, SamplingParams
    from probehook.testing import assert_matches_hf

    other = LLM(
        str(other_llama_dir),
        layers=[0, 2],
        include_prefill=True,
        enforce_eager=True,
        **engine_defaults,
    )
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        # Interleave: requests of both engines are in flight in the same process.
        ids_a = compiled_llm.enqueue(PROMPTS, params, use_tqdm=False)
        ids_b = other.enqueue(PROMPTS, params, use_tqdm=False)
        assert ids_a and ids_b
        out_b = other.wait_for_completion(use_tqdm=False)
        out_a = compiled_llm.wait_for_completion(use_tqdm=False)
    finally:
        other.shutdown()
    assert [o.prompt for o in out_a] == PROMPTS and [o.prompt for o in out_b] == PROMPTS
    for a, b in zip(out_a, out_b, strict=True):
        assert_matches_hf(llama_dir, a, [0, 1, 2, 3])
        assert_matches_hf(other_llama_dir, b, [0, 2])
        assert a.probe_scores and not b.probe_scores  # only the compiled engine has probes
        # The weights differ enough that a row of one engine never passes for the other's.
        assert (a.prefill_hidden_states[0] - b.prefill_hidden_states[0]).abs().max() > 0.1


WIDE_VOCAB = 96
"""The TP test model's vocabulary: vLLM pads it to 128, so rank 1 holds ids 64..95, real ones
(the tokenizer's 19 would all sit on rank 0, and rank 1's id mapping would go unchecked)."""


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import build_random_checkpoint

    return build_random_checkpoint(
        tmp_path_factory.mktemp("llama-wide"), arch="llama", seed=1, vocab_size=WIDE_VOCAB
    )


@pytest.mark.topology  # tests/README.md: RPC to two workers, each in its own process
def test_tensor_parallel_2_matches_tp_1(
    wide_vocab_dir: Path,
    llama_lenses: dict[str, str],
    engine_defaults: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Also: the workers find probehook's loader without inheriting ``PROBEHOOK_ENGINE``
    (withheld here), as under vLLM's Ray executor, which passes its workers only ``VLLM_``
    variables (issue 37, item 7; vLLM's CPU platform refuses the Ray executor, so this is the
    closest this machine runs: separate worker processes that did not inherit it). The model's
    vocabulary spans both ranks, so the lenses' merge of the ranks' shards is checked on real
    tokens of rank 1 (review 11-29, item 9). Attention per head (issue 51): each rank reads
    its query head against its own KV shard and only the readings are gathered; every row of
    both heads equals Hugging Face's eager attention."""
    from engine_layout import users_layout
    from helpers import assert_scores_match_rows, random_probes

    from probehook import LLM, SamplingParams, SteeringVector
    from probehook.adapter import plugin
    from probehook.testing import assert_lens_matches_hf

    llama_dir = wide_vocab_dir
    tp1 = LLM(str(llama_dir), layers=[0, 2], include_prefill=True, enforce_eager=True,
              **engine_defaults)  # fmt: skip
    try:
        plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
        want = tp1.generate(PROMPTS, plain, use_tqdm=False)
    finally:
        tp1.shutdown()
    # vLLM's CPU backend needs one core per TP worker named explicitly.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setattr(plugin, "ACTIVE_ENV", "PROBEHOOK_ENGINE_WITHHELD_IN_THIS_TEST")
    direction = torch.randn(128, generator=torch.Generator().manual_seed(3))
    up = SteeringVector({2: direction / direction.norm() * 5.0})
    with users_layout():
        tp2 = LLM(
            str(llama_dir),
            layers=[0, 2],
            include_prefill=True,
            enforce_eager=True,
            tensor_parallel_size=2,
            probes=random_probes(128),
            steering={"up": up},
            # Each rank holds half the vocabulary: its partial readings merge.
            lenses=llama_lenses,
            lens_layers=[2, 3],
            lens_top_k=4,
            # Each rank reads its head against its KV shard; the readings are gathered.
            attention_layers=[1, 3],
            attention_top_k=4,
            **engine_defaults,
        )
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
        got = tp2.generate(PROMPTS, params, use_tqdm=False)
        on_rank_1 = 0
        for g, w in zip(got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for layer in (0, 2):
                torch.testing.assert_close(
                    g.hidden_states[layer], w.hidden_states[layer], atol=1e-4, rtol=0
                )
                torch.testing.assert_close(
                    g.prefill_hidden_states[layer],
                    w.prefill_hidden_states[layer],
                    atol=1e-4,
                    rtol=0,
                )
            assert_lens_matches_hf(llama_dir, g, llama_lenses, [2, 3], prefill=True)
            for by_layer in (*g.outputs[0].lens.values(), *g.prefill_lens.values()):
                on_rank_1 += sum(int((r.token_ids >= 64).sum()) for r in by_layer.values())
            # Scores come back once (rank 0), equal to the probes on the returned rows.
            assert assert_scores_match_rows(g, tp2.probes.probes) > 0
            assert len(g.probe_scores["truth"]) == len(g.outputs[0].token_ids)
        assert on_rank_1 > 0, "no lens reading named a token of rank 1's shard"
        assert_attention_matches_hf(llama_dir, got)
        # Each rank holds its half of every lens matrix (review 11-29, item 7: every rank held
        # every J matrix), joined by one all-gather a step; the readings above are HF's.
        whole = lens_matrix_bytes(llama_dir, llama_lenses, [2, 3])
        assert whole > 0
        assert [b["lens"] for b in tp2.collective_rpc("probehook_bank_bytes")] == [whole // 2] * 2
        # A stop monitor is forced on every rank alike: the request ends where it crosses.
        scores = got[1].outputs[0].probe_scores["size"]
        k = 1 if scores[1] > scores[0] + 1e-4 else 0  # a margin over last-bit differences
        threshold = float((scores[0] + scores[1]) / 2) if k else float(scores[0]) - 1.0
        monitor = {"probe": "size", "threshold": threshold, "action": "stop"}
        stopped = tp2.generate(
            PROMPTS[1],
            SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True, detokenize=False,
                extra_args={"probehook": {"monitors": [monitor]}},
            ),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        eos = tp2.get_tokenizer().eos_token_id
        assert list(stopped.token_ids) == list(got[1].outputs[0].token_ids[:k]) + [eos]
        assert stopped.stop_reason == "probe:size"
        # Each rank forced it (rank 0's output alone could not tell a rank that did not).
        assert tp2.collective_rpc("probehook_forced_stops") == [1, 1]
        # A lens stop monitor too, forced on every rank alike: the J-lens at layer 2 gives
        # the token the model produced second a log-prob below 0 everywhere, so it stops at
        # the first row.
        token = got[1].outputs[0].token_ids[1]
        watch = {"lens": "j", "layer": 2, "token": token, "threshold": -1e-6,
                 "direction": "below", "action": "stop"}  # fmt: skip
        lens_stopped = tp2.generate(
            PROMPTS[1],
            SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False,
                           extra_args={"probehook": {"monitors": [watch]}}),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        assert list(lens_stopped.token_ids) == [eos]
        assert lens_stopped.stop_reason == f"lens:j@2:{token}"
        assert tp2.collective_rpc("probehook_forced_stops") == [2, 2]
        _check_tp2_steering(tp2, want, up, llama_dir)
    finally:
        tp2.shutdown()


def lens_matrix_bytes(llama_dir: Path, lenses: dict[str, str], layers: list[int]) -> int:
    """The bytes of every lens instance's matrix and bias at ``layers`` (float32), whole."""
    import json

    from probehook.lenses.artifacts import lens_affine, load_lens

    num_layers = json.loads((llama_dir / "config.json").read_text())["num_hidden_layers"]
    total = 0
    for path in (p for p in lenses.values() if p != "logit"):
        for layer in layers:
            matrix, bias = lens_affine(load_lens(path), layer, num_layers)
            total += sum(4 * t.numel() for t in (matrix, bias) if t is not None)
    return total


def _check_tp2_steering(tp2, unsteered, up, llama_dir: Path) -> None:  # noqa: ANN001
    """Both ranks steer alike: the prompt rows after layer 2 are TP=1's plus the vector, and
    the steered tokens' logprobs equal Hugging Face steered the same way."""
    from probehook import SamplingParams
    from probehook.testing_steering import hf_steered_logprobs, steering_terms

    params = SamplingParams(
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        extra_args={"probehook": {"steer": {"up": 1.5}}},
    )
    steered = tp2.generate(PROMPTS, params, use_tqdm=False)
    for got, plain in zip(steered, unsteered, strict=True):
        torch.testing.assert_close(
            got.prefill_hidden_states[2],
            plain.prefill_hidden_states[2] + 1.5 * up.vector(2),
            atol=1e-4,
            rtol=0,
        )
        completion = got.outputs[0]
        assert list(completion.token_ids) != list(plain.outputs[0].token_ids)
        terms = steering_terms({"up": up.vectors}, {"up": 1.5}, start=0)
        want = hf_steered_logprobs(llama_dir, got.prompt_token_ids, completion.token_ids, terms)
        pairs = zip(completion.logprobs, completion.token_ids, strict=True)
        logprobs = [lp[t].logprob for lp, t in pairs]
        assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-3


def assert_attention_matches_hf(model_dir: Path, outs: list) -> None:
    """Every prompt and generated row's attention at layers 1 and 3, both heads, equals
    Hugging Face's eager attention of the tokens returned (test_attention_rows' bounds)."""
    from test_attention_rows import assert_readings_match, readings_of
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    for out in outs:
        ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
        n = len(out.prompt_token_ids)
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_attentions=True).attentions
        for layer in (1, 3):
            probs = want[layer][0].transpose(0, 1)  # [rows, heads, keys]
            for rows, expected in ((out.prefill_attention[layer], probs[:n]),
                                   (out.outputs[0].attention[layer], probs[n - 1 :])):  # fmt: skip
                assert rows.heads == (0, 1) and len(rows) == len(expected)
                assert_readings_match(readings_of(rows), expected, [])
