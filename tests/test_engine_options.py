"""Every engine option alone, and the pairs users write first, on real in-process engines.

Each case starts an engine on the bundled tiny model and answers one request with what its
options promise (rows, scores, features, steering, a store, flags), or is refused at
construction with a probehook error naming the option. Every earlier test built a steered
engine together with a capture, so an engine that only steered died at model load unseen
(issue 43). The next option added joins :data:`ALONE` (and the pairs it forms).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_top_k

from probehook.errors import CaptureConfigError

pytestmark = pytest.mark.engine

PROMPT = "12+34="
TOKENS = 3
HIDDEN = 128  # the tiny model's
LAST = 3  # its last layer: the logit lens there is the model's own next-token distribution


def _probe() -> Any:
    from probehook import LinearProbe

    weight = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(0)) / HIDDEN**0.5
    return LinearProbe(weight, torch.zeros(1), layer=1, kind="binary", name="p")


def _vector() -> Any:
    from probehook import SteeringVector

    direction = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    return SteeringVector({1: direction / direction.norm() * 20.0}, name="v")


def _options(spec: str, tmp_path: Path) -> dict[str, Any]:
    """The engine arguments one word of a case names."""
    from probehook import SAE, FeatureMonitor, LensMonitor, ProbeMonitor, tiny_sae_path

    return {
        "layers": {"layers": [1]},
        "include_prefill": {"include_prefill": True},
        "probes": {"probes": {"p": _probe()}},
        "monitors": {"monitors": [ProbeMonitor("p", 0.0, action="flag")]},
        "feature_monitors": {"monitors": [FeatureMonitor("s", 0, -1.0, action="flag")]},
        "steering": {"steering": {"v": _vector()}},
        "steering_layers": {"steering_layers": [1]},
        "saes": {"saes": {"s": SAE.load(tiny_sae_path())}, "sae_top_k": 4},
        "sae_clamping": {"sae_clamping": True},
        "sae_dtype": {"sae_dtype": "bfloat16"},
        "sae_top_k": {"sae_top_k": 4},
        "store": {"store": tmp_path / "store"},
        "capture_only": {"capture_only": True},
        "include_decode": {"include_decode": True},
        "last_decode_token": {"last_decode_token": True},
        "max_request_capture_bytes": {"max_request_capture_bytes": 1 << 20},
        "steering_capacity": {"steering_capacity": 8},
        "store_options": {"store_options": {"keep_index": False}},
        "readout_top_k": {"readout_top_k": {"lens": 2}},
        "lenses": {"lenses": {"l": "logit"}, "lens_layers": [LAST]},
        "lens_layers": {"lens_layers": [LAST]},
        "lens_top_k": {"lens_top_k": 2},
        "lens_dtype": {"lens_dtype": "bfloat16"},
        # Token 0 (padding) is never likely: the engine's monitor flags nothing; requests
        # bring their own (_check_lens_monitors).
        "lens_monitors": {"monitors": [LensMonitor("l", LAST, 0, -1.0, action="flag")]},
        "low_lens_monitor": {"monitors": [LensMonitor("l", LAST, 0, -2.0, action="flag")]},
    }[spec]


ALONE = [
    # (options, None: starts and answers | the refusal's words)
    (("layers",), None),
    (("include_prefill",), "layers=None"),
    (("probes",), None),
    (("monitors",), "no probes were given"),
    (("steering",), None),
    (("steering_layers",), None),
    (("saes",), None),
    (("sae_clamping",), r"sae_clamping=True clamps the engine's SAEs, but it has none: pass saes="),
    (("sae_dtype",), r"sae_dtype='bfloat16' configures the sae_features readout, .* pass saes="),
    (("sae_top_k",), r"sae_top_k=4 configures the sae_features readout, .* pass saes="),
    (("store",), "needs something to store"),
    (("capture_only",), "capture_only=True needs something to capture"),
    (("lenses",), None),
    (("lens_layers",), r"lens_layers=.* configures the lens readout, .* pass lenses="),
    (("lens_top_k",), r"lens_top_k=.* configures the lens readout, .* pass lenses="),
    (("lens_dtype",), r"lens_dtype=.* configures the lens readout, .* pass lenses="),
    (("lens_monitors",), "LensMonitors, which watch lenses, but no lenses were given"),
    # Options that only configure others: each refused alone, not dropped (review D6).
    (("include_decode",), r"include_decode=True configures capture or steering, but this"),
    (("last_decode_token",), "layers=None captures nothing"),
    (("max_request_capture_bytes",), r"max_request_capture_bytes=1048576 configures capture"),
    (("steering_capacity",), r"steering_capacity=8 configures capture or steering"),
    (("store_options",), r"store_options=\{'keep_index': False\} configures capture"),
    (("readout_top_k",), r"lens_top_k=.* configures the lens readout"),
]
PAIRS = [
    (("layers", "include_prefill"), None),
    (("layers", "steering"), None),
    (("probes", "steering"), None),
    (("saes", "steering"), None),
    (("layers", "store"), None),
    (("probes", "store"), None),
    (("saes", "store"), None),
    (("layers", "monitors"), "no probes were given"),
    (("probes", "monitors"), None),
    (("saes", "feature_monitors"), None),
    (("saes", "sae_clamping"), None),
    (("saes", "sae_dtype"), None),
    (("layers", "capture_only"), None),
    (("saes", "capture_only"), None),
    (("steering", "capture_only"), "capture_only=True needs something to capture"),
    (("lenses", "include_prefill"), None),
    (("lenses", "steering"), None),
    (("lenses", "store"), None),
    (("lenses", "capture_only"), None),
    (("lenses", "lens_monitors"), None),
    # -2 is below -log(5 + 1): a token outside the top 5 may be that likely.
    (("lenses", "low_lens_monitor"), "raise lens_top_k to 8 or more"),
]


@pytest.mark.parametrize(
    ("specs", "refusal"), ALONE + PAIRS, ids=["+".join(specs) for specs, _ in ALONE + PAIRS]
)
def test_option_starts_and_answers(specs: tuple[str, ...], refusal: str | None, tmp_path) -> None:
    from probehook import LLM, tiny_model_path

    kwargs: dict[str, Any] = {}
    for spec in specs:
        kwargs.update(_options(spec, tmp_path))
    engine = dict(enforce_eager=True, max_model_len=64, seed=0, dtype="float32")
    if refusal is not None:
        with pytest.raises(CaptureConfigError, match=refusal):
            LLM(str(tiny_model_path()), **kwargs, **engine)
        return
    llm = LLM(str(tiny_model_path()), **kwargs, **engine)
    try:
        if "capture_only" in specs:
            out = llm.capture([PROMPT], use_tqdm=False)[0]
            n_prompt = len(out.prompt_token_ids)
            if "layers" in specs:
                assert out.prefill_hidden_states[1].shape == (n_prompt, HIDDEN)
            if "saes" in specs:
                assert len(out.prefill_sae_features["s"]) == n_prompt
            if "lenses" in specs:
                from probehook.testing import assert_lens_matches_hf

                assert_lens_matches_hf(tiny_model_path(), out, {"l": "logit"}, [LAST])
            return
        _check_generation(llm, specs, kwargs)
    finally:
        llm.shutdown()
    if {"lenses", "store"} <= set(specs):
        _check_lens_store_maintenance(kwargs["store"])


def _check_generation(llm: Any, specs: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    from probehook import SamplingParams
    from probehook.store import ActivationStore

    steers = "steering" in specs or "steering_layers" in specs
    if "steering_layers" in specs:
        llm.add_steering("v", _vector())  # the layer was given a steering op at load
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == TOKENS
    if "layers" in specs:
        assert completion.hidden_states[1].shape == (TOKENS, HIDDEN)
        if "include_prefill" in specs:
            assert out.prefill_hidden_states[1].shape == (len(out.prompt_token_ids), HIDDEN)
    if "probes" in specs:
        assert completion.probe_scores["p"].shape[0] == TOKENS
    if "monitors" in specs:  # a sigmoid's probability is above 0: every row crosses
        assert completion.probe_flags["p"] == list(range(TOKENS))
    if "saes" in specs:
        features = completion.sae_features["s"]
        assert len(features) == TOKENS and features.k == 4
        assert (features.l0 > 0).all()
    if "lenses" in specs:
        # The logit lens at the last layer is the model's own distribution: its target
        # log-prob is the log-prob vLLM reports for the token it sampled.
        reading = completion.lens["l"][LAST]
        assert len(reading) == TOKENS and reading.k == 5
        sampled = [
            p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        if not steers:
            torch.testing.assert_close(reading.target_logprob, torch.tensor(sampled))
            assert reading.token_ids[:, 0].tolist() == list(completion.token_ids)  # greedy
        if specs == ("lenses",):  # a request's k: the first entries of the engine's
            fewer = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                                   extra_args={"probehook": {"lens_top_k": 2}})  # fmt: skip
            two = llm.generate([PROMPT], fewer, use_tqdm=False)[0].outputs[0].lens["l"][LAST]
            assert two.k == 2 and torch.equal(two.token_ids, reading.token_ids[:, :2])
            torch.testing.assert_close(two.target_logprob, reading.target_logprob)
            more = SamplingParams(max_tokens=1, extra_args={"probehook": {"lens_top_k": 6}})
            with pytest.raises(CaptureConfigError, match=r"lens_top_k=6 is not valid: .* 1\.\.5"):
                llm.generate([PROMPT], more, use_tqdm=False)
        if "include_prefill" in specs:
            prompt = out.prefill_lens["l"][LAST]
            assert len(prompt) == len(out.prompt_token_ids)
            assert prompt.target_logprob[-1] == reading.target_logprob[0]
            # The last prompt row alone: one row computed and returned, the same reading.
            last = SamplingParams(
                max_tokens=1,
                temperature=0,
                extra_args={"probehook": {"last_prefill_token": True}},
            )
            alone = llm.generate([PROMPT], last, use_tqdm=False)[0].prefill_lens["l"][LAST]
            assert len(alone) == 1  # one row alone, the prompt's rows in one batch
            assert_same_top_k(alone.token_ids, alone.logprobs, prompt.token_ids[-1:],
                              prompt.logprobs[-1:])  # fmt: skip
            torch.testing.assert_close(alone.target_logprob, prompt.target_logprob[-1:])
    if "feature_monitors" in specs:
        assert completion.feature_flags["s:0"] == list(range(TOKENS))
    if "lens_monitors" in specs:
        assert completion.lens_flags == {f"l@{LAST}:0": []}
        _check_lens_monitors(llm)
    if "store" in specs:
        stored = ActivationStore.open(kwargs["store"])[out.store_id]
        if "layers" in specs:
            assert torch.equal(stored.hidden_states[1], completion.hidden_states[1])
        if "probes" in specs:
            assert torch.equal(stored.probe_scores["p"], completion.probe_scores["p"])
        if "saes" in specs:
            assert torch.equal(stored.sae_features["s"].indices, features.indices)
        if "lenses" in specs:
            kept = stored.top_k("lens")[f"l@{LAST}"]
            assert torch.equal(kept.token_ids, completion.lens["l"][LAST].token_ids)
            assert torch.equal(kept.target_logprob, completion.lens["l"][LAST].target_logprob)
            for prompt in ("5+6=", "70+8="):  # more shards, for compaction to merge
                llm.generate([prompt], params, use_tqdm=False)
    if steers:
        steered = llm.generate(
            [PROMPT],
            SamplingParams(
                max_tokens=TOKENS,
                temperature=0,
                ignore_eos=True,
                logprobs=0,
                extra_args={"probehook": {"steer": {"v": 1.0}}},
            ),
            use_tqdm=False,
        )[0].outputs[0]
        plain = [next(iter(p.values())).logprob for p in completion.logprobs]
        moved = [next(iter(p.values())).logprob for p in steered.logprobs]
        assert plain != moved, "the steered request's log-probs did not move"


# -- AsyncLLM and probehook serve with one option: steering only, SAEs only -----------------

ONE_OPTION = ["steering", "saes"]


@pytest.mark.parametrize("spec", ONE_OPTION)
def test_async_llm_with_one_option(spec: str, tmp_path: Path) -> None:
    """An ``AsyncLLM`` that only steers, or only reads an SAE, starts and streams what it
    promises (its engine core runs in a process of its own in either layout)."""
    import asyncio

    from probehook import AsyncLLM, SamplingParams, tiny_model_path

    engine = AsyncLLM(
        str(tiny_model_path()),
        **_options(spec, tmp_path),
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        dtype="float32",
    )

    async def last(request_id: str, options: dict[str, Any]) -> Any:
        params = SamplingParams(
            max_tokens=TOKENS,
            temperature=0,
            ignore_eos=True,
            logprobs=0,
            extra_args={"probehook": options} if options else None,
        )
        final = None
        async for out in engine.generate(PROMPT, params, request_id):
            final = out
        return final

    async def main() -> tuple[Any, Any]:
        plain = await last("plain", {})
        asked = await last("asked", {"steer": {"v": 1.0}} if spec == "steering" else {})
        return plain, asked

    try:
        plain, asked = asyncio.run(main())
    finally:
        engine.shutdown()
    if spec == "steering":
        assert asked.outputs[0].steering["vectors"] == {"v": 1.0}
        assert [list(p.values())[0].logprob for p in asked.outputs[0].logprobs] != [
            list(p.values())[0].logprob for p in plain.outputs[0].logprobs
        ]
    else:
        features = asked.outputs[0].sae_features["s"]
        assert len(features) == TOKENS and features.k == 4


def test_served_with_one_option(tmp_path: Path) -> None:
    """``probehook serve`` with only ``--steer``, and one with only ``--sae``, start and
    answer (started together: their start-ups overlap)."""
    import urllib.error
    import urllib.request

    import openai

    from probehook import tiny_model_path, tiny_sae_path
    from probehook.testing import ServerProcess

    servers = {}
    for spec in ONE_OPTION:
        argv = [str(tiny_model_path()), "--served-model-name", "tiny", "--enforce-eager"]
        argv += ["--dtype", "float32", "--max-model-len", "64", "--seed", "0"]
        if spec == "steering":
            argv += ["--steer", f"v={_vector().save(tmp_path / 'v.safetensors')}"]
        else:
            argv += ["--sae", f"s={tiny_sae_path()}", "--sae-top-k", "4"]
        servers[spec] = ServerProcess(argv, log=tmp_path / f"server-{spec}.log")
    try:
        for spec, server in servers.items():
            client = openai.OpenAI(base_url=server.wait().base_url, api_key="unused",
                                   max_retries=0)  # fmt: skip

            def complete(options: dict[str, Any], client: Any = client) -> Any:
                body = {"ignore_eos": True, "probehook": options}
                return client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=1,
                    extra_body=body,
                ).choices[0]  # fmt: skip

            if spec == "steering":
                no_ui = urllib.request.Request(
                    server.base_url.removesuffix("/v1") + "/probehook/ui"
                )
                with pytest.raises(urllib.error.HTTPError, match="404"):
                    urllib.request.urlopen(no_ui)  # no --ui: no route
                plain, steered = complete({}), complete({"steer": {"v": 1.0}})
                assert steered.model_extra["probehook"]["steering"]["vectors"] == {"v": 1.0}
                assert steered.logprobs.token_logprobs != plain.logprobs.token_logprobs
            else:
                answer = complete({"saes": ["s"]}).model_extra["probehook"]
                features = answer["sae_features"]["s"]
                assert len(features["l0"]) == TOKENS and len(features["indices"][0]) == 4
    finally:
        for server in servers.values():
            server.stop()


def _check_lens_monitors(llm: Any) -> None:
    """A lens monitor per request on the logit lens at the last layer, which is the model's
    own distribution: vLLM's log-probs of the whole vocabulary are the oracle. A flag monitor
    flags exactly the rows where the token's log-prob is above the threshold (the tokens
    outside the engine's top 5 included: the threshold is above -log 6); a stop monitor ends
    the completion at the first, in the worker, named."""
    from probehook import SamplingParams

    key_of = "l@{}:{}".format
    vocab = 19  # the tiny model's

    def run(monitors: list | None = None) -> Any:
        options: dict[str, Any] = {} if monitors is None else {"monitors": monitors}
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=vocab,
                                extra_args={"probehook": options})  # fmt: skip
        return llm.generate(["7+8="], params, use_tqdm=False)[0].outputs[0]

    plain = run()
    logprobs = torch.tensor(
        [[row[t].logprob for t in range(vocab)] for row in plain.logprobs]
    )  # [rows, vocab]
    floor = -math.log(5 + 1)
    found = None  # a token whose log-prob first rises above a threshold at row j >= 1
    for j in range(1, len(logprobs)):
        for token in range(vocab):
            threshold = max(float(logprobs[:j, token].max()), floor) + 1e-3
            if float(logprobs[j, token]) > threshold + 1e-3:
                found = (j, token, threshold)
                break
        if found:
            break
    assert found is not None, "no token's log-prob rises mid-generation"
    j, token, threshold = found
    watch = {"lens": "l", "layer": LAST, "token": token, "threshold": threshold}
    flagged = run([{**watch, "action": "flag"}])
    assert list(flagged.token_ids) == list(plain.token_ids)
    expected = torch.nonzero(logprobs[:, token] > threshold).flatten().tolist()
    assert flagged.lens_flags == {key_of(LAST, token): expected} and expected[0] == j
    stopped = run([{**watch, "action": "stop"}])
    assert len(stopped.token_ids) == j + 1 and stopped.finish_reason == "stop"
    assert stopped.stop_reason == f"lens:{key_of(LAST, token)}"
    assert list(stopped.token_ids[:j]) == list(plain.token_ids[:j])


def _check_lens_store_maintenance(root: Path) -> None:
    """An engine-written store of lens readings: fsck finds it whole, compaction merges its
    shards and changes no stored reading (bit-equal before and after)."""
    from probehook.store import ActivationStore
    from probehook.store.maintenance import compact, fsck

    def readings() -> dict[str, Any]:
        store = ActivationStore.open(root)
        return {r.request_id: r.top_k("lens") for r in store.requests}

    before = readings()
    assert len(before) == 3 and fsck(root).ok
    report = compact(root, progress=False)
    assert fsck(root).ok and report.shards_after < report.shards_before
    after = readings()
    assert after.keys() == before.keys()
    for request, rows in before.items():
        for name, got in rows.items():
            kept = after[request][name]
            for column in ("token_ids", "logprobs", "target_logprob"):
                torch.testing.assert_close(getattr(kept, column), getattr(got, column),
                                           rtol=0, atol=0, equal_nan=True)  # fmt: skip
