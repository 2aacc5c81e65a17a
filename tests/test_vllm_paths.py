"""The vLLM paths a researcher takes, on a real engine, against Hugging Face.

Each path either returns rows equal to HF for exactly the returned tokens, or is refused with a
clear error before anything runs. All tests share the session's eager engine (layers [0, 2],
prefill + decode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import worker_stats

from probehook.errors import CaptureConfigError, CaptureError
from probehook.testing import assert_matches_hf

pytestmark = pytest.mark.engine
LAYERS = [0, 2]


def greedy(**kwargs):
    from probehook import SamplingParams

    return SamplingParams(**{"temperature": 0, "ignore_eos": True, **kwargs})


def assert_clean(llm) -> None:
    """Nothing pending or retained in the worker, nothing left in the engine."""
    stats = worker_stats(llm)
    assert stats["pending_requests"] == 0
    assert stats["retained_bytes"] == 0
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.session.pending == {}


def test_prompt_logprobs_record_once_per_forward(eager_llm, llama_dir: Path) -> None:
    # "forwards" counts the runner's execute_model calls that the scheduler gave tokens;
    # prompt_logprobs make vLLM call the logits head again per request in the same step.
    before = worker_stats(eager_llm)
    outs = eager_llm.generate(
        ["1+2=", "12+34=56. 7+", "99+1="], greedy(max_tokens=4, prompt_logprobs=2), use_tqdm=False
    )
    after = worker_stats(eager_llm)
    forwards = after["forwards"] - before["forwards"]
    assert forwards >= 4
    assert after["steps_recorded"] - before["steps_recorded"] == forwards
    for out in outs:
        assert out.prompt_logprobs is not None
        assert_matches_hf(llama_dir, out, LAYERS)
    assert_clean(eager_llm)


def test_interrupted_generate_aborts_its_requests(eager_llm, llama_dir: Path) -> None:
    """Ctrl-C after a few engine steps: the next generate() returns only its own outputs."""
    prompts = [f"{i}+{i}=" for i in range(24)]
    engine = eager_llm.llm_engine
    real_step = engine.step
    calls = {"n": 0}

    def step_then_interrupt():
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real_step()

    engine.step = step_then_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            eager_llm.generate(prompts, greedy(max_tokens=30), use_tqdm=False)
    finally:
        del engine.step
    assert_clean(eager_llm)
    again = [f"{i}{i}+1=" for i in range(12)]
    outs = eager_llm.generate(again, greedy(max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == again
    for out in outs[:3]:
        assert_matches_hf(llama_dir, out, LAYERS)
    for out in outs:
        assert out.hidden_states[0].shape[0] == 3
    assert_clean(eager_llm)


def test_failing_progress_callback_aborts_too(eager_llm) -> None:
    from tqdm import tqdm

    class Bar(tqdm):
        def update(self, n=1):
            raise RuntimeError("progress callback failed")

    with pytest.raises(RuntimeError, match="progress callback failed"):
        eager_llm.generate([f"{i}+2=" for i in range(8)], greedy(max_tokens=20), use_tqdm=Bar)
    assert_clean(eager_llm)
    (out,) = eager_llm.generate(["5+5="], greedy(max_tokens=2), use_tqdm=False)
    assert out.hidden_states[0].shape[0] == 2


def test_abort_removes_request_and_frees_rows(eager_llm, llama_dir: Path) -> None:
    ids = eager_llm.enqueue(["1+1=", "2+2="], greedy(max_tokens=60), use_tqdm=False)
    for _ in range(4):
        eager_llm.llm_engine.step()
    assert worker_stats(eager_llm)["retained_bytes"] > 0
    eager_llm.llm_engine.abort_request([ids[0]], internal=True)
    outs = eager_llm.wait_for_completion(use_tqdm=False)
    assert [o.prompt for o in outs] == ["2+2="]
    assert_matches_hf(llama_dir, outs[0], LAYERS)
    assert_clean(eager_llm)


def test_beam_search_is_refused(eager_llm) -> None:
    from vllm.sampling_params import BeamSearchParams

    with pytest.raises(CaptureConfigError, match="beam_search"):
        eager_llm.beam_search([{"prompt": "1+2="}], BeamSearchParams(beam_width=2, max_tokens=3))


def test_stop_strings_min_tokens_structured_output_and_seed(eager_llm, llama_dir: Path) -> None:
    from vllm.sampling_params import StructuredOutputsParams

    from probehook import SamplingParams

    last_only = {"probehook": {"last_decode_token": True, "last_prefill_token": True}}
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, stop=["7", "8"], seed=1),
        SamplingParams(max_tokens=20, temperature=1.0, stop=["7"], seed=2, extra_args=last_only),
        SamplingParams(max_tokens=8, min_tokens=6, temperature=0, stop_token_ids=[2, 3]),
        SamplingParams(
            max_tokens=8,
            temperature=0,
            structured_outputs=StructuredOutputsParams(json={"type": "integer"}),
        ),
        SamplingParams(max_tokens=6, temperature=1.0, seed=7),
        SamplingParams(max_tokens=6, temperature=1.0, seed=7),
    ]
    prompts = ["1+2=", "3+4=", "5+6=", "7+8=", "9+9=", "9+9="]
    outs = eager_llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        completion = out.outputs[0]
        if p.extra_args:
            ref = _hf_rows(llama_dir, out)
            n = len(completion.token_ids)
            p_len = len(out.prompt_token_ids)
            for layer in LAYERS:
                assert completion.hidden_states[layer].shape[0] == 1
                torch.testing.assert_close(
                    completion.hidden_states[layer][0], ref[layer, p_len - 2 + n], atol=1e-3, rtol=0
                )
        else:
            assert_matches_hf(llama_dir, out, LAYERS)
    assert len(outs[2].outputs[0].token_ids) >= 6
    assert outs[3].outputs[0].text.lstrip("-").isdigit(), outs[3].outputs[0].text
    assert outs[4].outputs[0].token_ids == outs[5].outputs[0].token_ids
    assert_clean(eager_llm)


def _hf_rows(model_dir: Path, out) -> torch.Tensor:
    from probehook.testing import hf_residual_stream

    return hf_residual_stream(
        model_dir, list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    )


def test_request_over_the_memory_limit_fails_alone(eager_llm, llama_dir: Path) -> None:
    # 2 layers x 128 floats = 1 KiB per row: 24 rows fit; a 28-token prompt does not.
    eager_llm.collective_rpc("probehook_start_recording", args=(24 * 1024,))
    try:
        big, small = eager_llm.generate(
            ["12+34=56. 12+34=56. 12+34=", "1+1="], greedy(max_tokens=16), use_tqdm=False
        )
    finally:
        eager_llm.collective_rpc("probehook_start_recording", args=(0,))
    with pytest.raises(CaptureError, match="per-request limit of 24,576 bytes"):
        big.prefill_hidden_states[0]
    assert "max_request_capture_bytes" in big.capture_error
    assert_matches_hf(llama_dir, small, LAYERS)
    assert_clean(eager_llm)


def test_v1_runner_selected_for_the_engine_only(eager_llm) -> None:
    """The engine runs vLLM's V1 runner; this process's setting is untouched, so a plain
    vllm.LLM built later chooses its runner as usual. (That the engine's own processes were
    started with V1 is a property of the user's layout: test_steering_engine.py checks it.)"""
    import os

    import vllm.envs

    assert eager_llm.capture_info["runner"].startswith("vllm.v1.worker.cpu_model_runner")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is None


def test_v2_only_request_option_is_refused_before_generation(eager_llm) -> None:
    from probehook import SamplingParams

    params = SamplingParams(max_tokens=2, prompt_logprob_token_ids=[[1, 2, 3]])
    with pytest.raises(CaptureConfigError, match="prompt_logprob_token_ids.*V2"):
        eager_llm.generate(["1+2="], params, use_tqdm=False)
    assert_clean(eager_llm)


def test_rows_travel_through_disk_when_shm_is_full(eager_llm, llama_dir: Path) -> None:
    """The worker gets ENOSPC from the first export path (a link to /dev/full, as a full
    /dev/shm answers) and writes the same rows to the disk path; they still equal HF."""
    spool = eager_llm.session.spool
    real_new_paths = spool.new_paths
    used: list[str] = []

    def full_shm_first() -> list[str]:
        shm, disk = real_new_paths()
        Path(shm).symlink_to("/dev/full")
        used.extend([shm, disk])
        return [shm, disk]

    spool.new_paths = full_shm_first
    try:
        outs = eager_llm.generate(["12+34=", "5+6="], greedy(max_tokens=5), use_tqdm=False)
    finally:
        del spool.new_paths
    assert used, "no export happened"
    for out in outs:
        assert_matches_hf(llama_dir, out, LAYERS)
    # The worker removed each failed shm file; the front end unlinked each disk file it read.
    assert not any(Path(p).is_symlink() or Path(p).exists() for p in used)
    assert_clean(eager_llm)
