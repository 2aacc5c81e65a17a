"""``probehook serve``: vLLM's OpenAI server with probehook's engine, over real HTTP.

The server runs in a subprocess on localhost and the tests talk to it with the official
``openai`` client. The reference is the offline ``probehook.LLM`` on the same weights, probes
and steering vector (its rows equal Hugging Face's, see test_capture_parity.py): the session's
shared ``reference_llm`` (tests/conftest.py), run before the server starts, idle while it
serves.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_layout import USERS_LAYOUT_ENV
from helpers import assert_same_top_k, first_record, random_probes, reference_steering

from probehook.frontend.response_fields import decode_array
from probehook.testing import ServerProcess

# The topology set's server (tests/README.md): probehook serve, its engine core and worker,
# each in its own process, as users run it.
pytestmark = [pytest.mark.engine, pytest.mark.topology]
ENGINE = dict(dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
TOL = 1e-4
MAX_TOKENS = 12
CAP_MB = 0.4  # two prompts of one layer with prefill rows fit; see test_size_cap
# --capture-default: what a request without a probehook object captures on this server
DEFAULT = {"probes": ["truth"], "layers": [3]}
STEER = {"up": 1.5}
SAE_TOP_K = 8
# The template adds the BOS the offline prompt gets, so chat and offline see the same ids.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def prompts(n: int) -> list[str]:
    return [f"{i}+{(7 * i) % 30}=" * (1 + i % 2) for i in range(n)]


@pytest.fixture(scope="module")
def probe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("probes")
    return {
        name: probe.save(out / f"{name}.safetensors") for name, probe in random_probes(128).items()
    }


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A topk SAE on layer 3, saved by SAELens: the server's --sae res3."""
    from sae_oracle import make_saelens_sae

    folder = tmp_path_factory.mktemp("sae") / "res3"
    return make_saelens_sae("topk", folder, 128, 256, "blocks.3.hook_resid_post", seed=2, k=12)


@pytest.fixture(scope="module")
def lens_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The server's --lens logit=logit and --lens j=... (a random J-lens file)."""
    from helpers import write_random_lenses

    files = write_random_lenses(tmp_path_factory.mktemp("lenses"), 128, 4, seed=3)
    return {"logit": "logit", "j": files["j"]}


@pytest.fixture(scope="module")
def steer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference engine's vector "up" on layer 2 (between the two captured layers)."""
    return reference_steering().save(tmp_path_factory.mktemp("steer") / "up.safetensors")


@pytest.fixture(scope="module")
def offline(reference_llm: Any) -> dict[str, Any]:
    """Solo offline runs of every prompt, by prompt; steered runs by ("steered", prompt). The
    shared reference engine has the server's probes and steering vector (tests/conftest.py)."""
    from probehook import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    steered = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0,
        ignore_eos=True,
        extra_args={"probehook": {"steer": STEER}},
    )
    outs = [reference_llm.generate([p], params, use_tqdm=False)[0] for p in prompts(8)]
    steers = [reference_llm.generate([p], steered, use_tqdm=False)[0] for p in prompts(2)]
    return {out.prompt: out for out in outs} | {("steered", o.prompt): o for o in steers}


@pytest.fixture(scope="module")
def servers(offline: dict) -> Iterator[list[ServerProcess]]:
    """The module's servers, the live one last (the offline reference runs first, so the two
    engines never share the machine)."""
    started: list[ServerProcess] = []
    yield started
    for process in started:
        process.stop()


@pytest.fixture()
def server(
    servers: list[ServerProcess],
    llama_dir: Path,
    probe_files: dict[str, Path],
    steer_file: Path,
    sae_dir: Path,
    lens_files: dict[str, str],
    entry_point_path: str,
    tmp_path_factory: Any,
) -> ServerProcess:
    """The module's server; a test that kills it (the kill -9 test) leaves the next test a
    fresh one with an empty store, whatever the order the tests run in."""
    if servers and servers[-1].process.poll() is None:
        return servers[-1]
    work = tmp_path_factory.mktemp("server")
    (work / "chat.jinja").write_text(CHAT_TEMPLATE)
    argv = [str(llama_dir), "--layers", "0,3", "--include-prefill"]
    for name, path in probe_files.items():
        argv += ["--probe", f"{name}={path}"]
    argv += ["--monitor", "other:flag:0.5", "--max-capture-response-mb", str(CAP_MB)]
    argv += ["--steer", f"up={steer_file}", "--allow-inline-steering", "--allow-steering-edits"]
    argv += ["--sae", f"res3={sae_dir}", "--sae-top-k", str(SAE_TOP_K), "--sae-dtype", "bfloat16"]
    argv += ["--sae-clamping"]
    argv += [arg for name, path in lens_files.items() for arg in ("--lens", f"{name}={path}")]
    argv += ["--lens-layers", "0,3", "--lens-top-k", "3"]
    # the toy readout (tests/toy_readout.py), known to the server's processes by its entry
    # point (test_a_registered_readout_is_served_in_choices_and_chunks), by the flag its
    # engine option generates
    argv += ["--norms", "n3=3", "--peaks", "p3=3:4"]  # the per-head toy readout too
    argv += ["--scale-layers", "[1]"]  # the toy intervention (tests/toy_intervention.py)
    argv += ["--patching"]  # test_patch_sweep_is_served
    argv += ["--attention-layers", "3", "--attention-top-k", "4"]  # (test_attention_is_served)
    argv += ["--store", str(work / "store"), "--store-flush-interval", "0.5"]
    argv += ["--capture-default", json.dumps(DEFAULT)]
    argv += ["--chat-template", str(work / "chat.jinja"), "--served-model-name", "tiny"]
    argv += ["--ui"]  # the live viewer (test_the_live_page_paints_a_streamed_reply_per_token)
    argv += ["--dtype", "float32", "--max-model-len", "256", "--seed", "0", "--enforce-eager"]
    env = {**USERS_LAYOUT_ENV, "PYTHONPATH": entry_point_path}
    process = ServerProcess(argv, log=work / "server.log", env=env)
    servers.append(process)
    return process.wait()


@pytest.fixture()
def client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def greedy(**kwargs: Any) -> dict[str, Any]:
    return dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def ignore_eos(options: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"ignore_eos": True}
    if options is not None:
        body["probehook"] = options
    return body


def close(got: Any, want: torch.Tensor) -> bool:
    got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    return got.shape == want.shape and bool((got - want.float()).abs().max() <= TOL)


def field(choice: Any) -> dict[str, Any]:
    return (choice.model_extra or {}).get("probehook", {})


def test_sae_features_in_choices_and_chunks(client, sae_dir: Path) -> None:
    """A request that asks for SAE features gets each token's top-k in its choice (what
    SAELens reads on the rows the server returned alongside, within the bfloat16 encoder's
    margin: the server runs --sae-dtype bfloat16) and, streamed, in the chunk of its own
    tokens; the chunks join to the whole. Unknown SAEs and a k over the server's are
    refused before generation; requests that do not ask get no features."""
    import openai
    from sae_oracle import assert_features_match, oracle

    prompt = prompts(8)[3]
    options = {"layers": [3], "saes": ["res3"], "include_prefill": True}
    whole = client.completions.create(prompt=prompt, extra_body=ignore_eos(options), **greedy())
    got = field(whole.choices[0])
    lens = oracle(sae_dir)
    for rows, features in [
        (got["hidden_states"]["3"], got["sae_features"]["res3"]),
        (got["prefill_hidden_states"]["3"], got["prefill_sae_features"]["res3"]),
    ]:
        indices, values = torch.tensor(features["indices"]), torch.tensor(features["values"])
        assert indices.shape == (len(features["l0"]), SAE_TOP_K)
        rows = torch.from_numpy(decode_array(rows))
        l0 = torch.tensor(features["l0"])
        assert_features_match(indices, values, l0, lens, rows, SAE_TOP_K, tau=1e-2)
    body = {**ignore_eos({"saes": ["res3"], "sae_top_k": 4}), "return_token_ids": True}
    stream = client.completions.create(prompt=prompt, stream=True, extra_body=body, **greedy())
    joined: dict[str, list] = {"indices": [], "values": [], "l0": []}
    for chunk in stream:
        for choice in chunk.choices:
            tokens = (choice.model_extra or {}).get("token_ids") or []
            if tokens:
                features = field(choice)["sae_features"]["res3"]
                assert len(features["l0"]) == len(tokens)
                for part in joined:
                    joined[part] += features[part]
    full = got["sae_features"]["res3"]
    assert joined["l0"] == full["l0"]
    assert joined["indices"] == [row[:4] for row in full["indices"]]
    for bad, match in [
        ({"saes": ["nope"]}, "not engine SAEs"),
        ({"sae_top_k": 99}, r"in 1\.\.8 \(the engine's sae_top_k"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(prompt=prompt, extra_body=ignore_eos(bad), **greedy())
    plain = client.completions.create(prompt=prompt, extra_body=ignore_eos({}), **greedy())
    assert "sae_features" not in field(plain.choices[0])


def test_lenses_in_choices_chunks_and_the_store(client, server, llama_dir, lens_files) -> None:
    """--lens: a request that asks gets each token's lens readings, Hugging Face's lens on
    the tokens it returned (prompt and generated); each streamed chunk carries its own tokens'
    readings and they join to the whole; the store keeps them. An unknown lens or layer is a
    400 before generation; a request that does not ask gets none."""
    from types import SimpleNamespace

    import openai
    from transformers import AutoTokenizer

    from probehook import ActivationStore, LensRows
    from probehook.testing import assert_lens_matches_hf

    def rows(reading: dict[str, list]) -> LensRows:
        return LensRows(
            torch.tensor(reading["token_ids"]),
            torch.tensor(reading["logprobs"], dtype=torch.float32),
            torch.tensor(reading["target_logprob"], dtype=torch.float32),
        )

    def readings(value: dict[str, dict[str, dict]]) -> dict[str, dict[int, LensRows]]:
        return {n: {int(layer): rows(r) for layer, r in v.items()} for n, v in value.items()}

    prompt = prompts(8)[2]
    options = {"lenses": ["logit", "j"], "lens_layers": [3], "include_prefill": True}
    body = {**ignore_eos(options), "return_token_ids": True}
    whole = client.completions.create(prompt=prompt, extra_body=body, **greedy())
    choice = whole.choices[0]
    got = field(choice)
    assert sorted(got) == ["lens", "prefill_lens"]
    output = SimpleNamespace(
        prompt_token_ids=choice.model_extra["prompt_token_ids"],
        prefill_lens=readings(got["prefill_lens"]),
        outputs=[
            SimpleNamespace(
                index=0, token_ids=choice.model_extra["token_ids"], lens=readings(got["lens"])
            )
        ],
    )
    assert len(output.outputs[0].token_ids) == MAX_TOKENS
    assert_lens_matches_hf(llama_dir, output, lens_files, [3])
    # Each entry's text beside its id, as the tokenizer decodes the id alone.
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for reading in (got["lens"]["j"]["3"], got["prefill_lens"]["logit"]["3"]):
        want = [[tokenizer.decode([i]) for i in ids] for ids in reading["token_ids"]]
        assert reading["tokens"] == want and len(want[0]) == 3

    streamed = {**ignore_eos({"lenses": ["j"], "lens_layers": [3]}), "return_token_ids": True}
    stream = client.completions.create(prompt=prompt, stream=True, extra_body=streamed, **greedy())
    joined: list[int] = []
    joined_logprobs: list[float] = []
    for chunk in stream:
        for part in chunk.choices:
            tokens = (part.model_extra or {}).get("token_ids") or []
            if tokens:
                reading = field(part)["lens"]["j"]["3"]
                assert len(reading["token_ids"]) == len(reading["tokens"]) == len(tokens)
                joined += reading["token_ids"]
                joined_logprobs += reading["logprobs"]
    decoded = got["lens"]["j"]["3"]  # decode row 0 read with the prompt there, alone here
    assert_same_top_k(joined, joined_logprobs, decoded["token_ids"], decoded["logprobs"])

    only_layers = client.completions.create(
        prompt=prompt, extra_body=ignore_eos({"lens_layers": [0]}), **greedy()
    )
    assert sorted(field(only_layers.choices[0])["lens"]) == ["j", "logit"]
    assert list(field(only_layers.choices[0])["lens"]["j"]) == ["0"]
    bad_ones = [({"lenses": ["nope"]}, "nope"), ({"lenses": ["j"], "lens_layers": [2]}, "layer")]
    for bad, match in bad_ones:
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(prompt=prompt, extra_body=ignore_eos(bad), **greedy())
    plain = client.completions.create(prompt=prompt, extra_body=ignore_eos({}), **greedy())
    assert "lens" not in field(plain.choices[0])
    # A lens monitor in the request body: flagged where the token's log-prob among the
    # served top 3 is below -1, or where it is not among them (-inf).
    token = choice.model_extra["token_ids"][0]
    watch = {"lens": "logit", "layer": 3, "token": token, "threshold": -1.0, "direction": "below"}
    flagged = client.completions.create(
        prompt=prompt,
        extra_body=ignore_eos({"lenses": ["logit"], "lens_layers": [3], "monitors": [watch]}),
        **greedy(),
    )
    served = field(flagged.choices[0])
    reading = rows(served["lens"]["logit"]["3"])
    expected = torch.nonzero(reading.value_of(token, float("-inf")) < -1.0).flatten().tolist()
    assert served["lens_flags"] == {f"logit@3:{token}": expected} and expected

    root = Path(server.log).parent / "store"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stored = {r.request_id: r for r in ActivationStore.open(root).requests}
        if f"{whole.id}-0" in stored:
            break
        time.sleep(0.5)
    record = stored[f"{whole.id}-0"]
    kept = record.top_k("lens")
    assert sorted(kept) == ["j@3", "logit@3"]
    for name, layer in [("j", 3), ("logit", 3)]:
        want = output.outputs[0].lens[name][layer]
        assert torch.equal(kept[f"{name}@{layer}"].token_ids, want.token_ids)
        assert torch.allclose(kept[f"{name}@{layer}"].target_logprob, want.target_logprob)
    assert sorted(record.top_k("lens", phase="prefill")) == ["j@3", "logit@3"]


def test_a_served_request_clamps_a_feature(client, sae_dir: Path) -> None:
    """--sae-clamping: a request's "clamp" holds a feature at a value on its tokens. Clamped
    to 0, the prompt's last row after layer 3 is the unclamped row minus the feature's
    activation times its decoder row (SAELens's numbers, within the bfloat16 encoder's
    error); a bad clamp is a 400 before generation."""
    import openai
    from sae_oracle import oracle

    prompt = prompts(8)[5]
    options = {"layers": [3], "saes": ["res3"], "include_prefill": True}
    plain = field(
        client.completions.create(
            prompt=prompt, extra_body=ignore_eos(options), **greedy()
        ).choices[0]
    )
    strong = int(plain["prefill_sae_features"]["res3"]["indices"][-1][0])
    clamp = {"res3": {str(strong): 0.0}}
    clamped = field(
        client.completions.create(
            prompt=prompt, extra_body=ignore_eos({**options, "clamp": clamp}), **greedy()
        ).choices[0]
    )
    before = torch.from_numpy(decode_array(plain["prefill_hidden_states"]["3"]))[-1]
    after = torch.from_numpy(decode_array(clamped["prefill_hidden_states"]["3"]))[-1]
    lens = oracle(sae_dir)
    with torch.no_grad():
        activation = float(lens.encode(before[None].float())[0, strong])
        want = before - activation * lens.W_dec[strong].float()
    assert activation > 0.1
    torch.testing.assert_close(after, want, atol=2e-2 * activation, rtol=0)
    assert clamped["steering"]["clamp"] == clamp and plain.get("steering") is None
    for bad, match in [({"res3": {"100000": 0.0}}, "out of range"), ({"nope": {"1": 0.0}}, "")]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(
                prompt=prompt, extra_body=ignore_eos({"clamp": bad}), **greedy()
            )


def test_an_opted_out_request_gets_an_ordinary_response(client, offline) -> None:
    """``"probehook": {}`` opts out of the server's --capture-default (a server without one
    treats a request without the field the same way: request_options(None) is OFF)."""
    prompt = prompts(8)[0]
    response = client.completions.create(prompt=prompt, extra_body=ignore_eos({}), **greedy())
    choice = response.choices[0]
    assert choice.text == offline[prompt].outputs[0].text
    assert "probehook" not in (choice.model_extra or {})
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}], extra_body=ignore_eos({}), **greedy()
    )
    assert "probehook" not in (chat.choices[0].model_extra or {})


def test_capture_default_applies_to_requests_without_the_field(client, offline, server) -> None:
    """What lm-eval and other fixed-body clients get: the server's default, stored under the
    request id so that their samples can be joined to the records."""
    from probehook import ActivationStore

    prompt = prompts(8)[5]
    want = offline[prompt]
    response = client.completions.create(prompt=prompt, extra_body=ignore_eos(), **greedy())
    got = field(response.choices[0])
    assert response.choices[0].text == want.outputs[0].text
    assert set(got["hidden_states"]) == {"3"} and set(got["probe_scores"]) == {"truth"}
    assert close(decode_array(got["hidden_states"]["3"]), want.outputs[0].hidden_states[3])
    assert close(got["probe_scores"]["truth"], want.outputs[0].probe_scores["truth"])
    assert "prefill_hidden_states" not in got  # the default's options, not the engine's
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}], extra_body=ignore_eos(), **greedy()
    )
    assert close(
        field(chat.choices[0])["probe_scores"]["truth"], want.outputs[0].probe_scores["truth"]
    )
    # A request's own object wins over the default.
    own = client.completions.create(
        prompt=prompt, extra_body=ignore_eos({"probes": ["size"]}), **greedy()
    )
    assert set(field(own.choices[0])) == {"probe_scores"}
    assert set(field(own.choices[0])["probe_scores"]) == {"size"}
    # vLLM names a completion prompt's request "<response id>-<prompt index>"; chat: the id.
    root = Path(server.log).parent / "store"
    wanted = {f"{response.id}-0": [3], chat.id: [3], f"{own.id}-0": []}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stored = {r.request_id: r for r in ActivationStore.open(root).requests}
        if set(wanted) <= set(stored):
            break
        time.sleep(0.5)
    assert set(wanted) <= set(stored), sorted(stored)
    for request_id, layers in wanted.items():
        assert sorted(stored[request_id].hidden_states) == layers, request_id
    rows = stored[f"{response.id}-0"].hidden_states[3].numpy()
    assert close(rows, want.outputs[0].hidden_states[3])


def test_beam_search_is_refused_when_the_request_captures(client) -> None:
    import openai

    beam = dict(model="tiny", prompt="1+1=", n=2, max_tokens=1, temperature=0)
    message = r"use_beam_search cannot be combined with capture \(asked for by %s\)"
    with pytest.raises(openai.BadRequestError, match=message % "this server's --capture-default"):
        client.completions.create(extra_body={"use_beam_search": True}, **beam)
    with pytest.raises(openai.BadRequestError, match=message % "the request"):
        client.completions.create(
            extra_body={"use_beam_search": True, "probehook": {"probes": ["truth"]}}, **beam
        )
    with pytest.raises(openai.BadRequestError, match=message % "the request"):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "1+1="}],
            extra_body={"use_beam_search": True, "probehook": {"layers": [0]}},
            **{k: v for k, v in beam.items() if k != "prompt"},
        )
    # Opted out, beam search is vLLM's own.
    plain = client.completions.create(extra_body={"use_beam_search": True, "probehook": {}}, **beam)
    assert len(plain.choices) == 2 and "probehook" not in (plain.choices[0].model_extra or {})


def test_completion_returns_scores_and_rows_equal_to_offline(client, offline) -> None:
    batch = prompts(8)[:2]
    options = {"layers": [3], "probes": ["truth", "topic"], "include_prefill": True}
    response = client.completions.create(prompt=batch, extra_body=ignore_eos(options), **greedy())
    assert [c.index for c in response.choices] == [0, 1]
    for prompt, choice in zip(batch, response.choices, strict=True):
        want, got = offline[prompt], field(choice)
        assert choice.text == want.outputs[0].text
        assert set(got["hidden_states"]) == {"3"}  # only the layer asked for
        assert close(decode_array(got["hidden_states"]["3"]), want.outputs[0].hidden_states[3])
        assert close(decode_array(got["prefill_hidden_states"]["3"]), want.prefill_hidden_states[3])
        assert set(got["probe_scores"]) == {"truth", "topic"}
        for name in ("truth", "topic"):
            assert close(got["probe_scores"][name], want.outputs[0].probe_scores[name])
            assert close(got["prefill_probe_scores"][name], want.prefill_probe_scores[name])


def test_each_stream_chunk_carries_the_scores_of_its_own_tokens(client, offline) -> None:
    prompt = prompts(8)[2]
    want = offline[prompt].outputs[0]
    body = {**ignore_eos({"layers": [0], "probes": ["size"]}), "return_token_ids": True}
    stream = client.completions.create(prompt=prompt, stream=True, extra_body=body, **greedy())
    scores, rows, chunks = [], [], 0
    for chunk in stream:
        for choice in chunk.choices:
            tokens = (choice.model_extra or {}).get("token_ids") or []
            got = field(choice)
            if tokens:
                chunks += 1
                assert len(got["probe_scores"]["size"]) == len(tokens)
                scores += got["probe_scores"]["size"]
                rows.append(decode_array(got["hidden_states"]["0"]))
    assert chunks > 1  # really streamed
    assert close(scores, want.probe_scores["size"])
    assert close(np.concatenate(rows), want.hidden_states[0])


def test_chat_streamed_and_not_equals_offline(client, offline) -> None:
    prompt = prompts(8)[3]
    want = offline[prompt]
    messages = [{"role": "user", "content": prompt}]
    options = {"probes": ["truth"], "layers": [3], "include_prefill": True}
    body = {**ignore_eos(options), "return_token_ids": True}
    full = client.chat.completions.create(messages=messages, extra_body=body, **greedy())
    assert getattr(full, "prompt_token_ids", None) == list(want.prompt_token_ids)
    got = field(full.choices[0])
    assert close(got["probe_scores"]["truth"], want.outputs[0].probe_scores["truth"])
    assert close(decode_array(got["hidden_states"]["3"]), want.outputs[0].hidden_states[3])
    assert close(decode_array(got["prefill_hidden_states"]["3"]), want.prefill_hidden_states[3])
    stream = client.chat.completions.create(
        messages=messages, stream=True, extra_body=ignore_eos(options), **greedy()
    )
    scores, prefill = [], []
    for chunk in stream:
        for choice in chunk.choices:
            got = field(choice)
            if not choice.delta.content and not choice.finish_reason:
                assert not got  # the role chunk holds no token, so no rows
                continue
            # Every chunk with tokens keeps the shape: each asked layer and probe, prefill too
            # (0 rows after the first).
            assert list(got["prefill_hidden_states"]) == ["3"], got.keys()
            assert list(got["probe_scores"]) == ["truth"]
            scores += got["probe_scores"]["truth"]
            prefill.append(decode_array(got["prefill_hidden_states"]["3"]))
    assert close(scores, want.outputs[0].probe_scores["truth"])
    assert prefill[0].shape[0] > 0 and all(p.shape == (0, 128) for p in prefill[1:])
    assert close(np.concatenate(prefill), want.prefill_hidden_states[3])


def test_concurrent_clients_each_get_their_own_rows(client, offline) -> None:
    def one(i: int) -> None:
        prompt = prompts(8)[i]
        want = offline[prompt].outputs[0]
        options = {"probes": ["truth", "other"], "layers": [0, 3]}
        if i % 2:
            response = client.completions.create(
                prompt=prompt, extra_body=ignore_eos(options), **greedy()
            )
            got = field(response.choices[0])
            scores = got["probe_scores"]["truth"]
            hidden = decode_array(got["hidden_states"]["0"])
        else:
            scores, pieces = [], []
            stream = client.completions.create(
                prompt=prompt, stream=True, extra_body=ignore_eos(options), **greedy()
            )
            for chunk in stream:
                for choice in chunk.choices:
                    scores += field(choice).get("probe_scores", {}).get("truth", [])
                    if "hidden_states" in field(choice):
                        pieces.append(decode_array(field(choice)["hidden_states"]["0"]))
            hidden = np.concatenate(pieces)
        assert close(scores, want.probe_scores["truth"]), i
        assert close(hidden, want.hidden_states[0]), i

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))  # re-raises the first failure


def test_flag_and_stop_monitors(client, offline) -> None:
    prompt = prompts(8)[4]
    want = offline[prompt].outputs[0]
    # The server's --monitor other:flag:0.5 acts on requests that ask for "other".
    got = field(
        client.completions.create(
            prompt=prompt, extra_body=ignore_eos({"probes": ["other"]}), **greedy()
        ).choices[0]
    )
    expected = [i for i, s in enumerate(want.probe_scores["other"].tolist()) if s > 0.5]
    assert got.get("probe_flags", {}).get("other", []) == expected
    k, threshold, direction = first_record(want.probe_scores["size"])
    monitor = {"probe": "size", "threshold": threshold, "action": "stop", "direction": direction}
    response = client.completions.create(
        prompt=prompt,
        extra_body=ignore_eos({"probes": ["size"], "monitors": [monitor]}),
        **greedy(),
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == "probe:size"
    assert response.usage.completion_tokens == k + 1  # token k is the forced EOS
    assert len(field(choice)["probe_scores"]["size"]) == k + 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers": [1]}, r"layer 1 was not captured.*layers=\[0, 3\]"),
        ({"probes": ["lies"]}, r"not engine probes; valid names are \['other', 'size'"),
        ({"probes": "truth"}, r"probes='truth' \(str\) is not valid: pass a list of probe names"),
        ({"layers": [[0]]}, r"not an int"),
        ({"colour": "red"}, r"Unknown probehook option\(s\) 'colour'.*'probes'"),
        ("all", r"probehook options must be a dict \(a JSON object\)"),
        ({"monitors": [{"probe": "truth"}]}, r"monitors\[0\].*lacks \['threshold'\]"),
    ],
)
def test_guard_rails(client, options, message) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(prompt="1+1=", extra_body={"probehook": options}, **greedy())
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "1+1="}],
            stream=True,
            extra_body={"probehook": options},
            **greedy(),
        )


def test_malformed_options_storm(client, server, offline) -> None:
    """Every malformed option object a JSON body can carry is a 400 on both routes with the
    words of the one parser (the same as the offline LLM's and AsyncLLM's); the server then
    answers a normal request with the offline reference's rows."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import post_json
    from malformed_options import malformed

    from probehook.core.request_options import RequestOptions
    from probehook.errors import CaptureConfigError

    objects = malformed(json_only=True)
    assert len(objects) >= 100
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        readouts = json.load(reply)["readouts"]
    # The server's readouts (lenses, SAEs) add their options to the valid ones the refusals
    # list.
    options = {o: name for name, r in readouts.items() for o in r["options"]}
    assert options == {"lenses": "lenses", "lens_top_k": "lenses", "lens_layers": "lenses",
                       "norms": "norms", "norms_top_k": "norms", "saes": "saes",
                       "sae_top_k": "saes", "peaks": "peaks", "peaks_top_k": "peaks",
                       "attention": "attention_layers", "attention_top_k": "attention_layers",
                       "attention_layers": "attention_layers",
                       "attention_heads": "attention_layers",
                       "attention_spans": "attention_layers"}  # fmt: skip
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        writes = list(json.load(reply)["writes"])  # the write table's entries' options too
    assert writes == ["patch", "clamp", "scale"]
    messages = []
    for value in objects:
        with pytest.raises(CaptureConfigError) as err:
            RequestOptions.from_user(value, options, writes)
        messages.append(str(err.value))
    chat = {"messages": [{"role": "user", "content": "1+1="}]}
    bodies = [
        ({"model": "tiny", "max_tokens": 2, "probehook": value, **route}, path)
        for value in objects
        for path, route in (("/v1/completions", {"prompt": "1+1="}), ("/v1/chat/completions", chat))
    ]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: post_json(server.port, b[1], b[0]), bodies))
    for i, (status, answer) in enumerate(answers):
        assert status == 400, (bodies[i], answer)
        assert answer["error"]["message"] == messages[i // 2], (bodies[i], answer)
    prompt = prompts(8)[2]
    want = offline[prompt]
    response = client.completions.create(
        prompt=prompt, extra_body=ignore_eos({"layers": [0, 3]}), **greedy()
    )
    assert response.choices[0].text == want.outputs[0].text
    got = field(response.choices[0])["hidden_states"]
    for layer in (0, 3):
        assert close(decode_array(got[str(layer)]), want.outputs[0].hidden_states[layer])


def test_size_cap_refuses_before_generation(client) -> None:
    import openai

    big = {"probehook": {"layers": [0, 3], "include_prefill": True}}
    message = r"up to 1.0 MiB of hidden states .* over this server's cap of 0.4 MiB"
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(prompt=["1+1="] * 3, extra_body=big, **greedy())
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "1+1="}],
            stream=True,
            extra_body=big,
            **{**greedy(), "n": 3, "temperature": 1.0},
        )
    small = {"probehook": {"layers": [0, 3]}}  # 12 decode rows: far under the cap
    assert client.completions.create(prompt=["1+1="] * 3, extra_body=small, **greedy()).choices


def test_size_cap_counts_the_token_texts_of_lens_entries(client) -> None:
    """A lens entry is served with its token's text beside its id: the cap counts it (review
    D11: only ids and values were counted, so this request passed the cap at 0.2 MiB and
    could return ~0.6 MiB)."""
    import openai

    lenses = {"probehook": {"lenses": True, "include_prefill": True, "layers": []}}
    message = r"top-k readings \(0 layer\(s\), 4 lens instance\(s\) x top-3 x 256 rows x 2 "
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(
            prompt="1+1=", extra_body=lenses, **{**greedy(), "n": 2, "temperature": 1.0}
        )


def test_reserved_xargs_key_and_info_route(client, server) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match=r"reserved"):
        client.completions.create(
            prompt="1+1=", extra_body={"vllm_xargs": {"probehook": "x"}}, **greedy()
        )
    # The store record's key is probehook's too: a string there once failed inside generate.
    with pytest.raises(openai.BadRequestError, match=r"vllm_xargs\['probehook_record'\]"):
        client.completions.create(
            prompt="1+1=", extra_body={"vllm_xargs": {"probehook_record": "x"}}, **greedy()
        )
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        info = json.load(reply)
    assert info["layers"] == [0, 3] and info["include_prefill"] is True
    assert sorted(info["probes"]) == ["other", "size", "topic", "truth"]
    assert info["probes"]["topic"]["labels"] == ["a", "b", "c"]
    assert info["max_capture_response_bytes"] == int(CAP_MB * (1 << 20))
    assert info["capture_default"] == DEFAULT
    assert info["steering"]["layers"] == [2] and list(info["steering"]["vectors"]) == ["up"]
    assert info["steering"]["capacity"] == 64
    # the write table's entries: SAE clamping and the toy intervention, by request option
    scale = {"layer": 1, "site": "resid_pre"}
    want = {"engine_option": "scale_layers", "name": "row_scale", "instances": {"L1": scale}}
    assert info["writes"]["scale"] == want
    clamp = info["writes"]["clamp"]
    assert clamp["engine_option"] == "sae_clamping" and list(clamp["instances"]) == ["res3"]
    assert clamp["instances"]["res3"]["layer"] == 3
    served = {f"{lens}@{layer}": [lens, str(layer)] for lens in ("logit", "j") for layer in (0, 3)}
    lenses = {"options": ["lenses", "lens_top_k", "lens_layers"], "names": ["logit", "j"],
              "layers": [0, 3],
              "k": 3, "name": "lens", "attribute": "lens", "served": served,
              "columns": ["token_ids", "logprobs", "target_logprob"], "tokens": True,
              "positions": False,
              "series": ["target", "logprob"], "flags": "lens_flags",
              "column_series": {}}  # fmt: skip
    norms = {"options": ["norms", "norms_top_k"], "names": ["n3"], "layers": [3], "k": 1,
             "name": "row_norms", "attribute": "row_norms", "columns": ["indices", "values", "l0"],
             "served": {"n3": ["n3"]}, "tokens": False, "positions": False, "series": None,
             "flags": "norm_flags", "column_series": {}}  # fmt: skip
    peaks = {"options": ["peaks", "peaks_top_k"], "names": ["p3"], "layers": [3], "k": 2,
             "name": "chunk_peaks", "attribute": "chunk_peaks",
             "columns": ["offsets", "peaks", "chunk_norms"], "served": {"p3": ["p3"]},
             "tokens": False, "positions": False, "series": ["norm", "activation"],
             "flags": "peak_flags",
             "column_series": {"mean": "activation"}}  # fmt: skip
    saes = info["readouts"].pop("saes")  # SAE features: a readout as the others
    assert saes["options"] == ["saes", "sae_top_k"] and saes["names"] == ["res3"]
    assert (saes["name"], saes["attribute"], saes["flags"]) == ("sae", "sae_features",
                                                                "feature_flags")  # fmt: skip
    assert saes["columns"] == ["indices", "values", "l0"] and saes["served"] == {"res3": ["res3"]}
    attention = info["readouts"].pop("attention_layers")  # attention per head (issue 51)
    assert attention["options"] == ["attention", "attention_top_k", "attention_layers",
                                    "attention_heads", "attention_spans"]  # fmt: skip
    assert (attention["names"], attention["layers"], attention["k"]) == (["attention"], [3], 4)
    assert attention["columns"] == ["positions", "probs", "entropy"] and attention["positions"]
    assert info["readouts"] == {"lenses": lenses, "norms": norms, "peaks": peaks}
    assert info["saes"] == ["res3"] and info["lenses"] == ["j", "logit"]
    # The server is still serving after every refusal above.
    assert client.completions.create(prompt="1+1=", **greedy()).choices[0].text is not None


def test_steered_completions_and_chat_equal_offline(client, offline) -> None:
    """``"steer": {"up": 1.5}`` in the probehook object: tokens and the rows after layer 3
    (past the steered layer 2) equal the offline engine's steered run; the chat route too,
    and a stream."""
    for prompt in prompts(2):
        want = offline[("steered", prompt)]
        plain = offline[prompt]
        assert want.outputs[0].token_ids != plain.outputs[0].token_ids  # steering shows
        body = ignore_eos({"steer": STEER, "layers": [3]})
        choice = client.completions.create(prompt=prompt, extra_body=body, **greedy()).choices[0]
        assert choice.text == want.outputs[0].text
        assert field(choice)["steering"] == {"vectors": STEER, "phase": "both", "start": 0}
        rows = decode_array(field(choice)["hidden_states"]["3"])
        assert close(rows, want.outputs[0].hidden_states[3])
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], extra_body=body, **greedy()
        )
        assert chat.choices[0].message.content == want.outputs[0].text
        stream = list(
            client.completions.create(
                prompt=prompt, extra_body=ignore_eos({"steer": STEER}), stream=True, **greedy()
            )
        )
        assert "".join(c.choices[0].text for c in stream) == want.outputs[0].text
        assert field(stream[0].choices[0])["steering"]["vectors"] == STEER


@pytest.mark.parametrize(
    ("steer", "message"),
    [
        ({"down": 1.0}, r"'down'.*its vectors are \['up'\]"),
        ({"up": "big"}, r"scale of 'up' is 'big', not a number"),
        ({"up": 1.0, "x": 2}, r"\['x'\].*\['up'\]"),
        ([1, 2], r"steer=\[1, 2\] is not valid"),
        ({}, r"non-empty dict"),
    ],
)
def test_bad_steering_is_a_400_naming_the_vectors(client, steer, message) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(
            prompt="1+1=", extra_body={"probehook": {"steer": steer}}, **greedy()
        )


def test_non_finite_scale_is_a_400(server) -> None:
    """JSON has no NaN, but Python's parser (and so vLLM's) reads 1e999 as infinity."""
    raw = b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 2, '
    raw += b'"probehook": {"steer": {"up": 1e999}}}'
    request = urllib.request.Request(
        f"{server.base_url}/completions", data=raw, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    assert "finite" in err.value.read().decode()


def test_inline_vectors_steer_like_the_servers_own(client, offline, server, steer_file) -> None:
    """--allow-inline-steering: a request sends the up vector's values under its own name and
    gets the offline steered run; the bank holds it only while requests use it."""
    from probehook import SteeringVector

    values = SteeringVector.load(steer_file).vector(2).tolist()
    prompt = prompts(2)[1]
    want = offline[("steered", prompt)].outputs[0].text
    body = ignore_eos({"steer": {"mine": STEER["up"]}, "steer_vectors": {"mine": {"2": values}}})

    def one(stream: bool) -> str:
        if not stream:
            return (
                client.completions.create(prompt=prompt, extra_body=body, **greedy())
                .choices[0]
                .text
            )
        chunks = client.completions.create(prompt=prompt, extra_body=body, stream=True, **greedy())
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, [False, True, False, True]))
    assert texts == [want] * 4
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        steering = json.load(reply)["steering"]
    assert steering["inline_in_use"] == 0 and list(steering["vectors"]) == ["up"]


def test_steering_ops_are_served(client, server, steer_file, llama_dir) -> None:
    """--allow-steering-edits: POST /v1/steering puts a vector with its op in the bank (here
    a cap and a swap on the up vector's layer); a request steering with both, in that order,
    gets logprobs equal to HF with the two formulas applied in that order; its choice names
    the ops; the same ops sent inline give the same text; GET /v1/probehook lists them; bad
    bodies are 400s naming the fault; DELETE takes them out."""
    from helpers import post_json

    from probehook import SteeringVector
    from probehook.testing_steering import hf_steered_logprobs, steering_terms

    port = server.port
    up = SteeringVector.load(steer_file).vector(2)
    other = torch.roll(up, 7)
    cap = {"vectors": {"2": up.tolist()}, "op": "cap", "max": 0.0}
    swap = {"vectors": {"2": up.tolist()}, "op": "swap", "to": {"2": other.tolist()}}
    for name, body in (("capped", cap), ("swapped", swap)):
        status, answer = post_json(port, "/v1/steering", {"name": name, **body})
        assert status == 200 and answer["layers"] == [2], answer
    assert answer["op"] == "swap"
    try:
        steer = {"capped": 1.0, "swapped": 0.8}
        body = {**ignore_eos({"steer": steer}), "return_tokens_as_token_ids": True}
        reply = client.completions.create(prompt="3+4=", extra_body=body, logprobs=1, **greedy())
        choice = reply.choices[0]
        tokens = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
        vectors = {
            "capped": SteeringVector({2: up}).with_op("cap", max=0.0),
            "swapped": SteeringVector.swap(SteeringVector({2: up}), SteeringVector({2: other})),
        }
        prompt_ids = (
            client.completions.create(
                prompt="3+4=", max_tokens=1, extra_body={"return_token_ids": True}, model="tiny"
            )
            .choices[0]
            .prompt_token_ids
        )
        want = hf_steered_logprobs(llama_dir, prompt_ids, tokens, steering_terms(vectors, steer, 0))
        got = choice.logprobs.token_logprobs
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3, (got, want)
        steering = choice.probehook["steering"]
        assert steering["vectors"] == steer and steering["ops"] == {
            "capped": "cap(max=0)",
            "swapped": "swap",
        }
        inline = {"a": cap, "b": swap}
        body = ignore_eos({"steer": {"a": 1.0, "b": 0.8}, "steer_vectors": inline})
        again = client.completions.create(prompt="3+4=", extra_body=body, **greedy())
        assert again.choices[0].text == choice.text
        with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
            listed = json.load(reply)["steering"]["vectors"]
        assert listed["capped"]["op"] == "cap(max=0)" and listed["swapped"]["op"] == "swap"
        for bad, message in [
            (
                {"name": "x", "vectors": {"2": up.tolist()}, "op": "rotate"},
                "op 'rotate' is not one of",
            ),
            (
                {"name": "x", "vectors": {"2": up.tolist()}, "op": "cap"},
                "cap needs min, max or both",
            ),
            (
                {"name": "x", "vectors": {"2": up.tolist()}, "op": "cap", "min": 2, "max": 1},
                "above max",
            ),
            ({"name": "x", "vectors": {"2": [0.0] * 128}, "op": "ablate"}, "all zeros"),
            ({"name": "x", **swap, "to": {"1": up.tolist()}}, "same layers"),
            ({"name": "capped", **cap}, "already in the bank"),
            (
                {"name": "x", "vectors": {"1": up.tolist()}, "op": "ablate"},
                "steers only layers [2]",
            ),
            ({"vectors": {"2": up.tolist()}}, 'needs a "name"'),
            ({"name": "x", "vectors": {"2": up.tolist()}, "scale": 2}, "unknown keys"),
        ]:
            status, answer = post_json(port, "/v1/steering", bad)
            assert status == 400 and message in answer["error"]["message"], (bad, answer)
    finally:
        for name in ("capped", "swapped"):
            request = urllib.request.Request(f"{server.base_url}/steering/{name}", method="DELETE")
            with urllib.request.urlopen(request) as reply:
                assert json.load(reply) == {"name": name, "removed": True}
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        assert list(json.load(reply)["steering"]["vectors"]) == ["up"]


def test_patch_sweep_is_served(server, llama_dir) -> None:
    """--patching: POST /v1/patch_sweep with the RhizoNymph fork's field names (its hook name
    post_block, layers as {start, stop, step}) answers its response fields, the grid equal to
    the hand loop on HF (tests/test_patching.py); a later sweep naming the same source_run
    without clean_prompt streams one event per cell, then the same result; an unknown
    source_run and a bad alpha are 400s."""
    from helpers import post_json
    from test_patching import ANSWER, CLEAN, CORRUPT, FOIL, hf_grid

    every_other = {"start": 1, "stop": 4, "step": 2}
    body = {"prompt": CORRUPT, "clean_prompt": CLEAN, "answer_token_id": ANSWER,
            "foil_token_id": FOIL, "hook": "post_block", "layers": every_other,
            "positions": [5, 36, 39], "metric": "logit_diff", "source_run": "run-a"}  # fmt: skip
    status, answer = post_json(server.port, "/v1/patch_sweep", body)
    assert status == 200, answer
    for field in ("grid", "clean", "corrupt", "argmax", "skipped", "alignment", "noise_floor"):
        assert field in answer, field
    ld, _, ((clean_ld, _), (corrupt_ld, _)) = hf_grid(llama_dir, "resid_post")
    want = ld[[1, 3]][:, [5, 36, 39]]
    assert np.abs(np.array(answer["grid"]) - want).max() <= 1e-3
    assert abs(answer["clean"] - clean_ld) <= 1e-3 and abs(answer["corrupt"] - corrupt_ld) <= 1e-3
    i, j = np.unravel_index(np.argmax(want), want.shape)
    assert answer["layers"] == [1, 3] and answer["argmax"] == [[1, 3][i], [5, 36, 39][j]]
    again = {k: v for k, v in body.items() if k != "clean_prompt"} | {"stream": True}
    request = urllib.request.Request(
        f"{server.base_url}/patch_sweep",
        data=json.dumps(again).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        events = [
            line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]" and len(events) == 2 * 3 + 2
    cells = [json.loads(e) for e in events[:-2]]
    assert sorted((c["layer"], c["position"]) for c in cells) == [
        (1, 5),
        (1, 36),
        (1, 39),
        (3, 5),
        (3, 36),
        (3, 39),
    ]
    streamed = json.loads(events[-2])
    assert np.abs(np.array(streamed["grid"]) - want).max() <= 1e-3
    for c in cells:
        assert abs(c["value"] - ld[c["layer"], c["position"]]) <= 1e-3
    for bad, message in [
        ({**again, "source_run": "nope", "stream": False}, "source_run 'nope' names no clean run"),
        ({**body, "alpha": 2}, "alpha=2 must be a number in [0, 1]"),
        ({**body, "answer_token": "12", "answer_token_id": None}, "is not one token"),
        ({**body, "temperature": 1}, "unknown fields ['temperature']"),
    ]:
        status, answer = post_json(server.port, "/v1/patch_sweep", bad)
        assert status == 400 and message in answer["error"]["message"], (bad, answer)


@pytest.mark.parametrize(
    ("vectors", "message"),
    [
        ({"mine": {"2": [1.0] * 64}}, r"64.*128|128.*64"),
        ({"mine": {"1": [1.0] * 128}}, r"layer\(s\) \[1\].*steers only layers \[2\]"),
        ({"up": {"2": [1.0] * 128}}, r"names 'up', a vector of this server"),
        ({f"v{i}": {"2": [1.0] * 128} for i in range(5)}, r"at most 4"),
        ({"mine": {"2": "x"}}, r"lists of numbers"),
        ({"mine": {"two": [1.0] * 128}}, r"layers must be integers"),
        ([1.0], r"object of named vectors"),
    ],
)
def test_bad_inline_vectors_are_400s(client, server, vectors, message) -> None:
    import openai

    body = {"probehook": {"steer": {"mine": 1.0}, "steer_vectors": vectors}}
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(prompt="1+1=", extra_body=body, **greedy())
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        assert json.load(reply)["steering"]["inline_in_use"] == 0


def test_malformed_inline_vectors_and_reserved_xargs_storm(server) -> None:
    """Every malformed ``steer_vectors`` value a JSON body can carry is a 400 on both routes
    and leaves the bank as it was; so is every malformed value under a reserved
    ``vllm_xargs`` key (issue 37: the fuzz reaches the server's body and vllm_xargs)."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import post_json
    from malformed_options import malformed, malformed_inline_vectors

    chat = {"messages": [{"role": "user", "content": "1+1="}]}
    routes = (("/v1/completions", {"prompt": "1+1="}), ("/v1/chat/completions", chat))
    bodies = []
    for vectors in malformed_inline_vectors(hidden=128, layer=2):
        inline = {"steer": {"v": 1.0}, "steer_vectors": vectors}
        bodies += [
            ({"model": "tiny", "max_tokens": 2, "probehook": inline, **r}, p) for p, r in routes
        ]
    for value in malformed(json_only=True)[::3]:
        for key in ("probehook", "probehook_record"):
            xargs = {"vllm_xargs": {key: value}}
            bodies.append(
                ({"model": "tiny", "max_tokens": 2, "prompt": "1+1=", **xargs}, routes[0][0])
            )
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: post_json(server.port, b[1], b[0]), bodies))
    for body, (status, answer) in zip(bodies, answers, strict=True):
        assert status == 400, (body, answer)
    with urllib.request.urlopen(f"{server.base_url}/probehook") as reply:
        steering = json.load(reply)["steering"]
    assert steering["inline_in_use"] == 0 and list(steering["vectors"]) == ["up"]


def test_inline_infinity_is_a_400(server) -> None:
    raw = b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 2, "probehook": {"steer": '
    raw += b'{"mine": 1.0}, "steer_vectors": {"mine": {"2": [1e999' + b", 0.0" * 127 + b"]}}}}"
    request = urllib.request.Request(
        f"{server.base_url}/completions", data=raw, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    assert "infinite" in err.value.read().decode()


def test_openai_client_example_against_this_server(server) -> None:
    """examples/openai_client.py, pointed at this module's server (saves a server start-up;
    the example starts its own when run without arguments)."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "openai_client.py"
    result = subprocess.run(
        [sys.executable, str(example), server.base_url, "truth", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "layer 3 rows (" in out and "truth per token:" in out, out
    assert "chat " in out, out
    # The example's request without a probehook object gets this server's --capture-default.
    assert "ordinary request: extension field present: True" in out, out


def test_the_live_page_paints_a_streamed_reply_per_token(client, server) -> None:
    """``--ui``: in Chromium, the page lists the server's probes, SAEs and top-k readouts
    (lenses, the toy readout: known from the server's description alone), sends a
    streamed chat completion through the server's own route, and paints the reply token by
    token while it streams (the painted count grows); at the end its tokens are the reply's,
    each painted with its lens reading's colour, and the panel shows the token's readings.
    Nothing but the server is asked for, no script errs."""
    import urllib.request

    from browser import chromium, open_page

    from probehook.viewer.page import level, shade

    root = server.base_url.removesuffix("/v1")
    message = prompts(8)[3]
    body = {"lenses": ["j"], "probes": ["truth"], "saes": ["res3"], "norms": ["n3"],
            "peaks": ["p3"], "attention": True}  # fmt: skip
    want = client.chat.completions.create(
        messages=[{"role": "user", "content": message}], logprobs=True,
        extra_body={"probehook": body, "return_token_ids": True}, **{**greedy(), "max_tokens": 12},
    )  # fmt: skip
    want, want_usage = want.choices[0], want.usage
    tokens = [c.token for c in want.logprobs.content]
    ids = want.model_extra["token_ids"]
    target = field(want)["lens"]["j"]["3"]["target_logprob"]
    with chromium() as browser:
        page, errors, off_machine = open_page(browser, f"{root}/probehook/ui", root)
        page.wait_for_selector(".ph-live[data-ph-ready='1']")
        boxes = page.locator("#ph-choices input")
        assert {b.get_attribute("value") for b in boxes.all()} >= {"truth", "res3", "j", "up", "n3"}
        for box in boxes.all():  # ask what the request above asked
            group, name = box.get_attribute("data-group"), box.get_attribute("value")
            wanted = {"probe": ["truth"], "sae": ["res3"], "lens": ["j"], "row_norms": ["n3"],
                      "chunk_peaks": ["p3"], "attention": ["attention"]}.get(group, [])  # fmt: skip
            box.set_checked(name in wanted)
        page.fill("#ph-message", message)
        page.fill("#ph-max", "12")
        page.evaluate(
            """() => { window.counts = []; new MutationObserver(() => window.counts.push(
                document.querySelectorAll('#ph-reply .ph-token').length))
                .observe(document.getElementById('ph-reply'), {childList: true}); }"""
        )
        page.click("#ph-send")
        page.wait_for_selector(".ph-live[data-ph-done='1']", timeout=60_000)
        counts = page.evaluate("window.counts")
        assert len(set(counts)) >= 3 and counts == sorted(counts), counts  # grew as it came
        spans = page.locator("#ph-reply .ph-token")
        assert spans.all_inner_texts()[1:] == tokens  # position 0: the prompt's last token
        page.select_option("select.ph-series", label="lens j@3 target")
        for p, value in enumerate(target):  # decode row p at position p
            colour = shade(level(value, "logprob", 0.0))
            got = spans.nth(p).evaluate("e => getComputedStyle(e).backgroundColor")
            assert got == colour, p
        spans.nth(2).hover()
        panel = page.inner_text(".ph-panel")
        assert "position 2" in panel and "lens j@3" in panel and "sae res3" in panel
        assert f"(id {ids[1]}, position 2" in panel  # the ids came with the chunks
        # the toy readout, which the page knows only from the server's description
        norm = field(want)["row_norms"]["n3"]["values"][2][0]
        line = page.inner_text(".ph-top-k[data-name='row_norms n3']")
        assert line == f"row_norms n3: #0 {norm:.4f}", line
        # the per-head toy readout: a block per head, its second scalar a series
        peaks = field(want)["chunk_peaks"]["p3"]
        offset, value = peaks["offsets"][2][1][0], peaks["peaks"][2][1][0]
        line = page.inner_text(".ph-top-k[data-name='chunk_peaks p3 h1']")
        assert line.startswith(f"chunk_peaks p3 h1: #{offset} {value:.4f}"), line
        page.select_option("select.ph-series", label="chunk_peaks p3 mean")
        page.select_option("select.ph-series", label="chunk_peaks p3 h3 norm")
        # attention: pointing at a token shades each token by how much it attends to it
        # (key positions are the sequence's; position 0 here is the prompt's last token)
        rows = field(want)["attention"]["3"]
        first = want_usage.prompt_tokens - 1
        weights = {p - first: w for p, w in zip(rows["positions"][2][1], rows["probs"][2][1],
                                                strict=True) if p >= first}  # fmt: skip
        page.select_option(
            "select.ph-series", label="attention 3 h1: attention of the pointed token"
        )
        spans.nth(2).hover()
        for q in range(spans.count()):
            got = spans.nth(q).evaluate("e => getComputedStyle(e).backgroundColor")
            assert got == (shade(min(1.0, weights[q])) if q in weights else "rgba(0, 0, 0, 0)"), q
        # Flags and a labelled feature: a truth flag monitor typed in as JSON (its threshold
        # between the reply's scores), a label for row 2's strongest feature.
        scores = field(want)["probe_scores"]["truth"]
        ordered = sorted(set(scores))  # split at the widest gap: last bits cannot cross it
        gap = max(range(1, len(ordered)), key=lambda j: ordered[j] - ordered[j - 1])
        middle = (ordered[gap - 1] + ordered[gap]) / 2
        feature = field(want)["sae_features"]["res3"]["indices"][2][0]
        flag = {"probe": "truth", "threshold": middle, "action": "flag"}
        # (with the toy intervention at a scale of 1: the same reply, marked as written)
        send(page, {"monitors": [flag], "scale": 1.0}, {"res3": {str(feature): "a name"}})
        classes = spans.evaluate_all("es => es.map(e => e.className)")
        assert spans.all_inner_texts()[1:] == tokens
        assert [p for p, c in enumerate(classes) if "ph-flag" in c] == [
            i for i, s in enumerate(scores) if s > middle
        ]  # decode row i at position i
        page.select_option("select.ph-series", label=f"sae res3 #{feature} a name")
        spans.nth(2).hover()
        assert f"#{feature} (a name)" in page.inner_text(".ph-top-k[data-name='sae res3']")
        assert 'scale\tscale {"L1":1}' in page.inner_text(".ph-panel")
        # A stop monitor at the first row that tops every row before it, with steering at
        # scale 0 (the same reply, marked as steered from its first position).
        row = next(i for i in range(1, len(scores)) if scores[i] > max(scores[:i]) + 1e-4)
        stop = {"probe": "truth", "action": "stop",
                "threshold": (scores[row] + max(scores[:row])) / 2}  # fmt: skip
        page.locator("#ph-choices input[data-group='steer'][value='up']").set_checked(True)
        page.fill("#ph-scale", "0")
        send(page, {"monitors": [stop]}, {})
        classes = spans.evaluate_all("es => es.map(e => e.className)")
        assert [p for p, c in enumerate(classes) if "ph-stop" in c] == [row], classes
        assert all("ph-steered" in c for c in classes)
        assert "stopped by probe:truth" in page.inner_text("#ph-status")
        spans.nth(row).hover()
        panel = page.inner_text(".ph-panel")
        assert "stopped\tprobe:truth" in panel and "steered\tup x0" in panel
        assert errors == [] and off_machine == []
    with urllib.request.urlopen(f"{root}/probehook/ui") as response:
        assert response.status == 200 and b"probehook live" in response.read()


def test_a_registered_readout_is_served_in_choices_and_chunks(client) -> None:
    """The toy readout of tests/toy_readout.py (``--readout norm:n3=3``; the server's
    processes know it by its entry point, probehook names it nowhere): each token's norm of
    the rows the same response carries, in its choice and, streamed, joined from its chunks;
    opt-in (a request that does not ask gets none)."""
    prompt, tokens = prompts(8)[5], 4
    body = {"ignore_eos": True, "probehook": {"norms": ["n3"], "layers": [3]}}
    choice = client.completions.create(
        prompt=prompt, extra_body=body, **{**greedy(), "max_tokens": tokens}
    ).choices[0]
    rows = torch.from_numpy(decode_array(field(choice)["hidden_states"]["3"]).copy())
    got = field(choice)["row_norms"]["n3"]
    assert got["indices"] == [[0]] * tokens and got["l0"] == [1] * tokens
    torch.testing.assert_close(torch.tensor(got["values"])[:, 0], rows.float().norm(dim=1))
    chunks = client.completions.create(
        prompt=prompt, extra_body=body, stream=True, **{**greedy(), "max_tokens": tokens}
    )
    joined = []
    for chunk in chunks:
        extra = chunk.choices[0].model_extra or {}
        joined += extra.get("probehook", {}).get("row_norms", {}).get("n3", {}).get("values", [])
    assert joined == got["values"]
    plain = client.completions.create(prompt=prompt, extra_body=ignore_eos(), **greedy())
    assert "row_norms" not in field(plain.choices[0])  # opt-in
    # The per-head toy readout (``--peaks p3=3:4``: a top-k per chunk of 4, a second scalar),
    # at a request's k of 1: nested columns in the choice and, streamed, in its chunks
    from toy_readout import PeakRows

    body = {"ignore_eos": True, "probehook": {"peaks": ["p3"], "peaks_top_k": 1, "layers": [3]}}
    choice = client.completions.create(
        prompt=prompt, extra_body=body, **{**greedy(), "max_tokens": tokens}
    ).choices[0]
    rows = torch.from_numpy(decode_array(field(choice)["hidden_states"]["3"]).copy()).float()
    got = PeakRows.from_columns(field(choice)["chunk_peaks"]["p3"])
    chunks = rows.reshape(tokens, 4, -1)
    peaks, offsets = chunks.topk(1, dim=-1)
    assert torch.equal(got.offsets, offsets) and got.offsets.shape == (tokens, 4, 1)
    torch.testing.assert_close(got.peaks, peaks)
    torch.testing.assert_close(got.chunk_norms, chunks.norm(dim=-1))
    torch.testing.assert_close(got.mean, rows.mean(dim=1))
    streamed = client.completions.create(
        prompt=prompt, extra_body=body, stream=True, **{**greedy(), "max_tokens": tokens}
    )
    joined = []
    for chunk in streamed:
        extra = chunk.choices[0].model_extra or {}
        joined += extra.get("probehook", {}).get("chunk_peaks", {}).get("p3", {}).get("mean", [])
    assert joined == field(choice)["chunk_peaks"]["p3"]["mean"]


def test_attention_is_served(client, llama_dir: Path) -> None:
    """``--attention-layers 3``: a request's ``"attention": true`` gets each prompt and
    generated token's attention per head in its choice (``attention`` and
    ``prefill_attention``, by layer), of the heads it names (``{"3": [1]}``, a JSON key) with
    the mass on the spans it names, equal to Hugging Face's eager attention on the tokens the
    server returned alongside; streamed chunks carry the same rows; a bad span is a 400
    naming it; unasked, none."""
    import openai
    from transformers import AutoModelForCausalLM

    from probehook.outputs.attention import AttentionRows

    options = {"attention": True, "include_prefill": True, "attention_heads": {"3": [1]},
               "attention_spans": {"start": [0, 2], "rest": [2, 60]}}  # fmt: skip
    body = {**ignore_eos(options), "return_token_ids": True}
    choice = client.completions.create(prompt=prompts(8)[1], extra_body=body, **greedy()).choices[0]
    got = field(choice)
    assert sorted(got) == ["attention", "prefill_attention"]
    prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    with torch.no_grad():
        want = hf(torch.tensor([[*prompt_ids, *token_ids[:-1]]]), output_attentions=True)
    probs = want.attentions[3][0].transpose(0, 1)[:, [1]]  # [rows, heads, keys]
    n = len(prompt_ids)
    for rows, expected in ((got["prefill_attention"]["3"], probs[:n]),
                           (got["attention"]["3"], probs[n - 1 :])):  # fmt: skip
        read = AttentionRows.from_columns(rows)
        assert read.heads == (1,) and list(read.spans) == ["start", "rest"]
        for name, (lo, hi) in options["attention_spans"].items():
            torch.testing.assert_close(read.spans[name], expected[..., lo:hi].sum(-1),
                                       rtol=0, atol=1e-4)  # fmt: skip
        top = expected.topk(4, dim=-1).values
        torch.testing.assert_close(read.probs, top, rtol=0, atol=1e-4)
        taken = expected.gather(-1, read.positions.clamp(min=0))  # each position's probability
        taken = torch.where(read.positions >= 0, taken, 0.0)  # -1: fewer keys than k
        torch.testing.assert_close(taken, read.probs, rtol=0, atol=1e-4)
        entropy = -(expected * expected.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(read.entropy, entropy, rtol=0, atol=1e-4)
    streamed = client.completions.create(prompt=prompts(8)[1], extra_body=body, stream=True,
                                         **greedy())  # fmt: skip
    joined = []
    for chunk in streamed:
        extra = (chunk.choices[0].model_extra or {}).get("probehook", {})
        joined += extra.get("attention", {}).get("3", {}).get("entropy", [])
    assert joined == got["attention"]["3"]["entropy"]
    bad = {**options, "attention_spans": {"start": [4, 2]}}
    with pytest.raises(openai.BadRequestError, match=r"'start': \[4, 2\] is not a span"):
        client.completions.create(prompt="1+1=", extra_body=ignore_eos(bad), **greedy())
    plain = client.completions.create(prompt=prompts(8)[1], extra_body=ignore_eos(), **greedy())
    assert "attention" not in field(plain.choices[0])  # opt-in


def test_a_registered_intervention_is_served(client) -> None:
    """The toy intervention (``--scale-layers [1]``, a flag its engine option generates; known
    to the server's processes by its entry point): a request's ``scale`` scales the stream at
    layer 1's input, so the rows after layer 0 are unchanged and those after layer 3 are not;
    what it applied is the choice's ``steering["scale"]``, streamed too; a bad one is a 400
    naming the instances."""
    import openai

    prompt = "12+34="
    asked = {"layers": [0, 3], "include_prefill": True}
    body = {"ignore_eos": True, "probehook": {**asked, "scale": 0.5}}
    plain_body = {"ignore_eos": True, "probehook": asked}
    scaled, plain = (
        field(client.completions.create(prompt=prompt, extra_body=b, **greedy()).choices[0])
        for b in (body, plain_body)
    )
    assert scaled["steering"] == {"vectors": {}, "phase": "both", "start": 0, "scale": {"L1": 0.5}}
    assert plain.get("steering") is None

    def rows(f: dict, layer: int) -> torch.Tensor:
        return torch.from_numpy(decode_array(f["prefill_hidden_states"][str(layer)]).copy())

    torch.testing.assert_close(rows(scaled, 0), rows(plain, 0), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rows(scaled, 3), rows(plain, 3), rtol=1e-3, atol=1e-3)
    streamed = client.completions.create(prompt=prompt, extra_body=body, stream=True, **greedy())
    marks = [
        (c.choices[0].model_extra or {}).get("probehook", {}).get("steering") for c in streamed
    ]
    assert {"vectors": {}, "phase": "both", "start": 0, "scale": {"L1": 0.5}} in marks
    with pytest.raises(openai.BadRequestError, match=r"scale names 'L2'; this engine scales"):
        client.completions.create(
            prompt=prompt, extra_body={"probehook": {"scale": {"L2": 2.0}}}, **greedy()
        )


def test_probehook_view_draws_a_file_of_saved_responses(
    client, server, llama_dir: Path, tmp_path: Path
) -> None:
    """``probehook view responses.jsonl -o page.html``: responses a client saved (the JSON
    bodies, sent with vLLM's return_token_ids) give the page the same data as the same
    requests read back from the server's store: tokens, probe scores, SAE features and lens
    readings at their positions. A file without token ids is refused with the fix."""
    from probehook import ActivationStore, view
    from probehook.cli import main
    from probehook.viewer.served import read_responses

    body = {"lenses": ["j"], "probes": ["truth"], "saes": ["res3"], "layers": [3],
            "include_prefill": True}  # fmt: skip
    saved = tmp_path / "responses.jsonl"
    with saved.open("w") as lines:
        for prompt in prompts(3)[1:]:
            response = client.completions.create(
                prompt=prompt, extra_body={"probehook": body, "return_token_ids": True},
                **greedy(),
            )  # fmt: skip
            lines.write(response.model_dump_json() + "\n\n")  # blank lines are skipped
    page = tmp_path / "page.html"
    main(["view", str(saved), "-o", str(page), "--tokenizer", str(llama_dir)])
    assert page.read_text().count('class="ph-request"') == 2
    served = list(read_responses(saved))
    root = Path(server.log).parent / "store"
    wanted = {o.request_id for o in served}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the periodic flush
        stored = {r.request_id: r for r in ActivationStore.open(root).requests}
        if wanted <= set(stored):
            break
        time.sleep(0.5)
    for output in served:
        from_file = view(output).requests[0]
        from_store = view(stored[output.request_id]).requests[0]
        names = {s["name"] for s in from_file["series"]}
        assert {"probe truth", "lens j@3 target"} <= names, names
        assert {t["name"] for t in from_file["top_k"]} >= {"sae res3", "lens j@3", "lens j@0"}
        for key in ("ids", "n_prompt", "series", "top_k", "grids"):
            assert from_file[key] == from_store[key], key
    bare = tmp_path / "bare.jsonl"
    bare.write_text(client.completions.create(prompt="1+1=", **greedy()).model_dump_json())
    with pytest.raises(SystemExit, match="line 1, choice 0 has no token ids: send the request"):
        main(["view", str(bare), "-o", str(page)])


def send(page: Any, extra: dict[str, Any], labels: dict[str, Any]) -> None:
    """Send the live page's message again with more options and labels, typed in as JSON;
    wait for the reply's end."""
    page.fill("#ph-extra", json.dumps(extra))
    page.fill("#ph-labels", json.dumps(labels))
    page.evaluate("() => document.querySelector('.ph-live').removeAttribute('data-ph-done')")
    page.click("#ph-send")
    page.wait_for_selector(".ph-live[data-ph-done='1']", timeout=60_000)


def test_served_captures_are_committed_while_serving_and_survive_kill_9(
    client, server, offline
) -> None:
    """Kills the server and everything it started with SIGKILL, a crash: the requests this
    test made, once the periodic flush committed them, are all in the store (the next test
    gets a fresh server)."""
    from probehook import ActivationStore

    prompt = prompts(8)[0]
    want = offline[prompt]
    options = {
        "prefill": {"layers": [3], "include_prefill": True},
        "both": {"layers": [0, 3]},
        "steered": {"layers": [3], "steer": STEER},
    }
    ids = {
        f"{client.completions.create(prompt=prompt, extra_body=ignore_eos(o), **greedy()).id}-0": k
        for k, o in options.items()
    }
    root = Path(server.log).parent / "store"

    def mine() -> dict:
        records = ActivationStore.open(root).requests
        return {ids[r.request_id]: r for r in records if r.request_id in ids}

    deadline = time.monotonic() + 60
    while len(mine()) < len(ids) and time.monotonic() < deadline:  # the flush, server up
        time.sleep(0.5)
    server.kill()
    stored = mine()
    assert sorted(stored) == sorted(options)
    assert {k: sorted(r.hidden_states) for k, r in stored.items()} == {
        k: o["layers"] for k, o in options.items()
    }
    for key in ("prefill", "both"):
        record = stored[key]
        assert record.steering is None
        assert record.output_token_ids == list(want.outputs[0].token_ids)
        for layer, rows in record.hidden_states.items():
            assert close(rows.numpy(), want.outputs[0].hidden_states[layer])
    prefill = stored["prefill"].prefill_hidden_states[3].numpy()
    assert close(prefill, want.prefill_hidden_states[3])
    steered = stored["steered"]
    assert steered.steering["vectors"] == STEER
    reference = offline[("steered", prompt)].outputs[0]
    assert steered.output_token_ids == list(reference.token_ids)
    assert close(steered.hidden_states[3].numpy(), reference.hidden_states[3])
