"""Captured rows agree with Hugging Face transformers on the same fp32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probehook.testing import assert_matches_hf

pytestmark = pytest.mark.engine
PROMPTS = ["1+2=", "12+34=56. 7+", "99+99=198. 3+4=7. 50+5", "0"]


def test_compiled_matches_hf(compiled_llm, llama_dir: Path) -> None:
    from probehook import SamplingParams

    outs = compiled_llm.generate(
        PROMPTS, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    )
    for out in outs:
        assert_matches_hf(llama_dir, out, [0, 1, 2, 3])
        assert out.hidden_states is out.outputs[0].hidden_states
        assert out.hidden_states[0].dtype == torch.float32
        assert out.hidden_states[0].device.type == "cpu"


def test_eager_matches_hf_and_compiled(eager_llm, compiled_llm, llama_dir: Path) -> None:
    from probehook import SamplingParams

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eager = eager_llm.generate(PROMPTS, params)
    compiled = compiled_llm.generate(PROMPTS, params)
    for e, c in zip(eager, compiled, strict=True):
        assert_matches_hf(llama_dir, e, [0, 2])
        assert e.outputs[0].token_ids == c.outputs[0].token_ids
        for layer in (0, 2):
            torch.testing.assert_close(
                e.hidden_states[layer], c.hidden_states[layer], atol=1e-4, rtol=0
            )
            torch.testing.assert_close(
                e.prefill_hidden_states[layer], c.prefill_hidden_states[layer], atol=1e-4, rtol=0
            )


# Every other architecture (Qwen2 with grouped-query attention among them): one engine each in
# tests/test_architectures.py, every layer against HF.
