"""Per-request options and last-token modes on a real engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probehook.errors import CaptureConfigError

pytestmark = pytest.mark.engine


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


def test_steer_on_an_engine_without_steering_is_refused(eager_llm) -> None:
    """A request's ``steer`` and ``add_steering`` on an engine built without steering name
    the fix, before anything is generated; the engine goes on."""
    from probehook import SamplingParams, SteeringVector

    steered = SamplingParams(max_tokens=2, extra_args={"probehook": {"steer": {"v": 1.0}}})
    with pytest.raises(CaptureConfigError, match=r"engine has no steering vectors; build it"):
        eager_llm.generate(["1+1="], steered, use_tqdm=False)
    vector = SteeringVector({0: torch.ones(128)}, name="v")
    with pytest.raises(CaptureConfigError, match=r"built without steering; pass steering="):
        eager_llm.add_steering("v", vector)
    out = eager_llm.generate(["1+1="], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.hidden_states[0].shape[0] == 2


def test_plain_llm_outputs_have_empty_dicts(plain_engines: dict) -> None:
    """layers=None is plain vLLM, but the attributes still exist (the engine runs in the
    plain-engines subprocess, tests/plain_engines.py)."""
    report = plain_engines["probehook_llm"]
    assert report["session"] is False and report["tokens"] == 2, report
    assert report["hidden_states"] == report["prefill_hidden_states"] == "{}", report
    assert report["completion_hidden_states"] == "{}", report


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


def _params(value: object, **kwargs: object) -> object:
    from probehook import SamplingParams

    extra = {} if value is ... else {"extra_args": {"probehook": value}}
    return SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, **extra, **kwargs)


def test_malformed_options_storm(eager_llm) -> None:
    """Every malformed option object is refused before the engine with the parser's own
    words; the engine then serves a normal request exactly as before the storm."""
    from helpers import write_options
    from malformed_options import malformed

    from probehook.core.request_options import RequestOptions

    prompt = "12+34="
    before = eager_llm.generate([prompt], _params(...), use_tqdm=False)[0]
    from vllm.exceptions import VLLMValidationError

    sent = 0
    for value in malformed():
        with pytest.raises(CaptureConfigError) as want:
            RequestOptions.from_user(value, None, write_options())
        try:
            params = _params(value)
        except VLLMValidationError:
            continue  # vLLM's SamplingParams refuses it itself (an int over 64 bits)
        with pytest.raises(CaptureConfigError) as got:
            eager_llm.generate([prompt], params, use_tqdm=False)
        assert str(got.value) == str(want.value)
        sent += 1
    assert sent >= 100
    # Well formed, but not what this engine (layers 0 and 2, no probes) can serve.
    for value, words in [
        ({"layers": [1]}, "layer 1 was not captured"),
        ({"layers": [99]}, "layer 99 was not captured"),
        ({"layers": [-1]}, "layer -1 was not captured"),
        ({"probes": ["lies"]}, "engine has no probes"),
        ({"monitors": [{"probe": "lies", "threshold": 0.5}]}, "engine has no probes"),
    ]:
        with pytest.raises(CaptureConfigError, match=words):
            eager_llm.generate([prompt], _params(value), use_tqdm=False)
    assert not eager_llm.session.pending
    after = eager_llm.generate([prompt], _params(...), use_tqdm=False)[0]
    assert list(after.outputs[0].token_ids) == list(before.outputs[0].token_ids)
    for layer in (0, 2):
        torch.testing.assert_close(after.hidden_states[layer], before.hidden_states[layer])
        torch.testing.assert_close(
            after.prefill_hidden_states[layer], before.prefill_hidden_states[layer]
        )


def test_a_corrupt_wire_past_the_front_end_fails_its_request_alone(eager_llm, monkeypatch) -> None:
    """Wire objects the front end would never write, injected between the session and vLLM
    (the session registers the good one, the worker receives the bad one): each such request
    gets a failed capture with the reason, the requests between them are served normally."""
    from helpers import corrupt_wires_past_the_front_end
    from malformed_options import CORRUPTIONS

    from probehook import CaptureError

    corruptions = [(k, v) for k, v in CORRUPTIONS if k != "tag"]  # tag: nobody collects
    prompts = [f"{i}+{2 * i}=" for i in range(2 * len(corruptions) + 1)]
    reference = eager_llm.generate(prompts[::2], _params(...), use_tqdm=False)
    corrupt_wires_past_the_front_end(eager_llm.session, monkeypatch, corruptions)
    params = [_params(..., seed=i) for i in range(len(prompts))]
    outs = eager_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    for out in outs:
        i = prompts.index(out.prompt)
        if i % 2 == 0:
            ref = reference[i // 2]
            assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
            for layer in (0, 2):
                torch.testing.assert_close(out.hidden_states[layer], ref.hidden_states[layer])
            continue
        assert len(out.outputs[0].token_ids) == 3  # generated normally, only capture failed
        with pytest.raises(CaptureError, match="could not read this request's probehook"):
            out.hidden_states[0]
    # The engine is alive and correct afterwards.
    again = eager_llm.generate(prompts[::2], _params(...), use_tqdm=False)
    for got, ref in zip(again, reference, strict=True):
        torch.testing.assert_close(got.hidden_states[2], ref.hidden_states[2])
