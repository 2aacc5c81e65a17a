"""Probes inside the engine without hidden-state capture, and monitors that act on them.

One eager engine with probes only (``layers=None``): scores must equal each probe applied to
Hugging Face's residual stream for the tokens the request returned; a stop monitor must end
its request at the first crossing while 31 concurrent requests run exactly as without it.
(Scores under compiled mode, chunked prefill, prefix caching and preemption are checked
against the captured rows in test_capture_under_load.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import first_record, random_probes, worker_stats

from probehook.testing import hf_residual_stream

pytestmark = pytest.mark.engine
ENGINE_DEFAULTS = dict(dtype="float32", max_model_len=256, gpu_memory_utilization=0.1, seed=0)


@pytest.fixture(scope="module")
def probe_llm(llama_dir: Path) -> Iterator[object]:
    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        probes=random_probes(128),
        include_prefill=True,
        enforce_eager=True,
        **ENGINE_DEFAULTS,
    )
    yield llm
    llm.shutdown()


def prompts(n: int) -> list[str]:
    return [f"{i}+{(7 * i) % 50}=" * (1 + i % 3) for i in range(n)]


def greedy(max_tokens: int = 24, **kwargs):
    from probehook import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def test_probe_only_scores_equal_probes_on_hf_rows(probe_llm, llama_dir: Path) -> None:
    probes = probe_llm.probes.probes
    assert probe_llm.capture_info["layers"] == []  # nothing captured as rows...
    assert probe_llm.capture_info["tapped_layers"] == [0, 1, 3]  # ...but the probes' layers
    outs = probe_llm.generate(prompts(6), greedy(12), use_tqdm=False)
    for out in outs:
        assert out.hidden_states == {} and out.prefill_hidden_states == {}
        p = len(out.prompt_token_ids)
        completion = out.outputs[0]
        n = len(completion.token_ids)
        ref = hf_residual_stream(llama_dir, list(out.prompt_token_ids) + list(completion.token_ids))
        for name, probe in probes.items():
            decode = probe.score(ref[probe.layer, p - 1 : p - 1 + n])
            prefill = probe.score(ref[probe.layer, :p])
            assert (completion.probe_scores[name] - decode).abs().max() < 1e-3, name
            assert (out.prefill_probe_scores[name] - prefill).abs().max() < 1e-3, name
        assert out.probe_scores is completion.probe_scores
        assert out.outputs[0].probe_scores["topic"].shape == (n, 3)
    stats = worker_stats(probe_llm)
    assert stats["pending_requests"] == 0 and stats["retained_bytes"] == 0


def test_per_request_probe_selection(probe_llm) -> None:
    params = [
        greedy(4, extra_args={"probehook": {"probes": ["truth"]}}),
        greedy(4, extra_args={"probehook": {"probes": False}}),
        greedy(4, extra_args={"probehook": {"include_prefill": False}}),
    ]
    only_truth, none, no_prefill = probe_llm.generate(prompts(3), params, use_tqdm=False)
    assert sorted(only_truth.probe_scores) == ["truth"]
    assert sorted(only_truth.prefill_probe_scores) == ["truth"]
    assert none.probe_scores == {} and none.prefill_probe_scores == {}
    assert no_prefill.prefill_probe_scores == {} and len(no_prefill.probe_scores) == 4


def test_bad_per_request_probe_options_fail_before_generation(probe_llm) -> None:
    from probehook.errors import CaptureConfigError

    with pytest.raises(CaptureConfigError, match=r"not engine probes; valid names"):
        probe_llm.generate(["1+1="], greedy(2, extra_args={"probehook": {"probes": ["lies"]}}))
    monitor = {"probe": "truth", "threshold": 0.5, "action": "stop"}
    bad = {"probehook": {"probes": ["size"], "monitors": [monitor]}}
    with pytest.raises(CaptureConfigError, match=r"switched off"):
        probe_llm.generate(["1+1="], greedy(2, extra_args=bad))
    assert not probe_llm.llm_engine.has_unfinished_requests()


def test_stop_monitor_ends_one_request_and_leaves_31_alone(probe_llm) -> None:
    batch = prompts(32)
    baseline = probe_llm.generate(batch, greedy(), use_tqdm=False)
    scores = baseline[0].outputs[0].probe_scores["size"]
    k, threshold, direction = first_record(scores)
    flag_scores = baseline[1].outputs[0].probe_scores["truth"]
    # Midway between two neighbouring scores, so float noise from another batch shape
    # cannot move a score across it.
    ordered = flag_scores.sort().values
    middle = len(ordered) // 2
    flag_threshold = float((ordered[middle - 1] + ordered[middle]) / 2)
    stop = {"probe": "size", "threshold": threshold, "action": "stop", "direction": direction}
    flag = {"probe": "truth", "threshold": flag_threshold, "action": "flag"}
    params = [greedy(extra_args={"probehook": {"monitors": [stop]}})]
    params += [greedy(extra_args={"probehook": {"monitors": [flag]}})]
    params += [greedy()] * 30
    outs = probe_llm.generate(batch, params, use_tqdm=False)

    stopped = outs[0].outputs[0]
    eos = probe_llm.get_tokenizer().eos_token_id
    # Rows 0..k-1 did not cross; row k crossed, so token k is the forced EOS, and the last.
    assert list(stopped.token_ids) == list(baseline[0].outputs[0].token_ids[:k]) + [eos]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "probe:size"
    # Another batch shape may change the last bits of a matmul; 1e-3 is the spec's bound.
    torch.testing.assert_close(stopped.probe_scores["size"], scores[: k + 1], atol=1e-4, rtol=0)
    for out, base in zip(outs[1:], baseline[1:], strict=True):
        assert list(out.outputs[0].token_ids) == list(base.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "length"
    flagged = outs[1].outputs[0].probe_flags["truth"]
    assert flagged == (flag_scores > flag_threshold).nonzero().flatten().tolist()
    assert 0 < len(flagged) < len(flag_scores)
    assert outs[2].outputs[0].probe_flags == {}
