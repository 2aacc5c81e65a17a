"""Per-request options and last-token modes on a real engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probehook.errors import CaptureConfigError

pytestmark = pytest.mark.slow


def test_last_token_modes_match_full_capture(eager_llm) -> None:
    from probehook import SamplingParams

    full = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    last = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={"probehook": {"last_prefill_token": True, "last_decode_token": True}},
    )
    a, b = eager_llm.generate(["12+34=", "12+34="], [full, last], use_tqdm=False)
    for layer in (0, 2):
        assert b.prefill_hidden_states[layer].shape == (1, a.hidden_states[layer].shape[1])
        assert b.hidden_states[layer].shape[0] == 1
        torch.testing.assert_close(
            b.prefill_hidden_states[layer], a.prefill_hidden_states[layer][-1:]
        )
        torch.testing.assert_close(b.hidden_states[layer], a.hidden_states[layer][-1:])
        # Decode row 0 is the last prompt position.
        torch.testing.assert_close(a.hidden_states[layer][0], a.prefill_hidden_states[layer][-1])


def test_request_can_switch_capture_off(eager_llm) -> None:
    from probehook import SamplingParams

    off = SamplingParams(
        max_tokens=2, extra_args={"probehook": {"include_prefill": False, "include_decode": False}}
    )
    out = eager_llm.generate(["1+1="], off, use_tqdm=False)[0]
    assert out.prefill_hidden_states == {} and out.hidden_states == {}
    assert out.outputs[0].hidden_states == {}


def test_bad_request_option_fails_before_generation(eager_llm) -> None:
    from probehook import SamplingParams

    bad = SamplingParams(max_tokens=2, extra_args={"probehook": {"layers": [1]}})
    with pytest.raises(CaptureConfigError, match=r"layers=\[0, 2\]"):
        eager_llm.generate(["1+1=", "2+2="], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    # The engine is still usable and nothing leaked.
    out = eager_llm.generate(["1+1="], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.hidden_states[0].shape[0] == 2
    stats = eager_llm.collective_rpc("probehook_stats")[0]
    assert stats["pending_requests"] == 0 and stats["retained_bytes"] == 0


def test_plain_llm_outputs_have_empty_dicts(llama_dir: Path, engine_defaults: dict) -> None:
    """layers=None is plain vLLM, but the attributes still exist."""
    from probehook import LLM, SamplingParams

    llm = LLM(str(llama_dir), enforce_eager=True, **engine_defaults)
    try:
        out = llm.generate(["1+1="], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.hidden_states == {} and out.prefill_hidden_states == {}
        assert out.outputs[0].hidden_states == {}
    finally:
        llm.shutdown()


def test_chat_captures(eager_llm, llama_dir: Path) -> None:
    from probehook import SamplingParams
    from probehook.testing import assert_matches_hf

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = eager_llm.chat(
        [{"role": "user", "content": "12+34="}],
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        chat_template=template,
        use_tqdm=False,
    )[0]
    assert_matches_hf(llama_dir, out, [0, 2])
