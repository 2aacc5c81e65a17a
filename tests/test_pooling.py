"""Pooling models through probehook: embed, encode, score and classify on real BERT models
(all-MiniLM-L6-v2, and a random-weight BERT classifier), with per-token encoder rows and probe
scores checked against Hugging Face on the same weights."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_random_bert_classifier, write_options

from probehook.errors import CaptureConfigError
from probehook.probes import LinearProbe
from probehook.store import ActivationStore
from probehook.testing import minilm_path

pytestmark = pytest.mark.engine
TEXTS = ["The cat sat on the mat.", "Quantum physics is hard to learn", "hello"]
LAYERS = [0, 5]
TOL = 1e-4


def _probe(hidden: int, layer: int, seed: int) -> LinearProbe:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(1, hidden, generator=g) / hidden**0.5
    return LinearProbe(weight, torch.zeros(1), layer=layer, kind="binary", name=f"p{layer}")


PROBES = {"mid": _probe(384, 3, 0)}  # layer 3 is tapped for the probe only


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pooled") / "store"


@pytest.fixture(scope="module")
def minilm(engine_defaults: dict, store_path: Path) -> Iterator[Any]:
    from probehook import LLM

    llm = LLM(
        str(minilm_path()),
        layers=LAYERS,
        probes=PROBES,
        store=store_path,
        enforce_eager=True,
        **{**engine_defaults, "max_model_len": 128},
    )
    yield llm
    llm.shutdown()


def _hf_stream(
    model_dir: Path, cls: str, token_ids: list[int], token_type_ids: list[int] | None = None
) -> tuple[torch.Tensor, ...]:
    model = _hf_models(str(model_dir), cls)
    types = torch.tensor([token_type_ids]) if token_type_ids is not None else None
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), token_type_ids=types, output_hidden_states=True)
    return out.hidden_states


_HF: dict[tuple[str, str], Any] = {}


def _hf_models(model_dir: str, cls: str) -> Any:
    import transformers

    if (model_dir, cls) not in _HF:
        model = getattr(transformers, cls).from_pretrained(model_dir, dtype=torch.float32)
        _HF[(model_dir, cls)] = model.eval()
    return _HF[(model_dir, cls)]


def _assert_rows_equal_hf(
    output: Any, model_dir: Path, cls: str, layers: list[int], types: list[int] | None = None
) -> None:
    hf = _hf_stream(model_dir, cls, list(output.prompt_token_ids), types)
    n = len(output.prompt_token_ids)
    assert sorted(output.hidden_states) == layers
    assert output.prefill_hidden_states is output.hidden_states  # every row is an input row
    for layer in layers:
        rows = output.hidden_states[layer]
        assert rows.shape == (n, hf[0].shape[-1])
        diff = (rows - hf[layer + 1][0]).abs().max().item()
        assert diff < TOL, f"layer {layer}: max abs diff {diff} against HF"


def test_embed_rows_and_scores_equal_hf(minilm: Any) -> None:
    outputs = minilm.embed(TEXTS, use_tqdm=False)
    assert [o.request_id for o in outputs] == ["0", "1", "2"]
    for out in outputs:
        _assert_rows_equal_hf(out, minilm_path(), "BertModel", LAYERS)
        # Probe scores: one per input token, from the tapped (not captured) layer 3.
        hf = _hf_stream(minilm_path(), "BertModel", list(out.prompt_token_ids))
        want = PROBES["mid"].score(hf[4][0])
        assert out.probe_scores["mid"].shape == want.shape == (len(out.prompt_token_ids),)
        assert (out.probe_scores["mid"] - want).abs().max().item() < 1e-3
        # The embedding itself is vLLM's, untouched: mean pooling, normalised (as
        # sentence-transformers does it for this model).
        mean = hf[-1][0].mean(0)
        cosine = torch.nn.functional.cosine_similarity(
            torch.tensor(out.outputs.embedding), mean, dim=0
        )
        assert cosine.item() > 0.9999


def test_encode_and_score_carry_captures(minilm: Any) -> None:
    encoded = minilm.encode(TEXTS[:2], pooling_task="embed", use_tqdm=False)
    assert all(sorted(o.hidden_states) == LAYERS for o in encoded)
    scored = minilm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    assert len(scored) == 2
    for result, other in zip(scored, TEXTS[1:], strict=True):
        first, second = result.inputs  # the two pooled inputs the score compared
        _assert_rows_equal_hf(first, minilm_path(), "BertModel", LAYERS)
        _assert_rows_equal_hf(second, minilm_path(), "BertModel", LAYERS)
        assert minilm.get_tokenizer().decode(second.prompt_token_ids[1:-1]) == other.lower()
        cosine = torch.nn.functional.cosine_similarity(
            first.outputs.data.float(), second.outputs.data.float(), dim=0
        )
        assert abs(result.outputs.score - cosine.item()) < 1e-5


def test_store_keeps_pooled_requests(minilm: Any, store_path: Path) -> None:
    outputs = minilm.embed(TEXTS[:2], use_tqdm=False)
    reader = ActivationStore.open(store_path)
    for out in outputs:
        assert out.store_id in reader
        stored = reader[out.store_id]
        assert stored.prompt_token_ids == list(out.prompt_token_ids)
        assert stored.record["completions"] == []
        assert stored.record["pooling_params"]["task"] == "embed"
        for layer in LAYERS:
            assert torch.equal(stored.prefill_hidden_states[layer], out.hidden_states[layer])
        assert torch.equal(stored.prefill_probe_scores["mid"], out.probe_scores["mid"])


def test_pooling_only_options_refused_before_start_up(engine_defaults: dict) -> None:
    from probehook import LLM, ProbeMonitor

    monitor = ProbeMonitor("mid", threshold=0.5, action="flag")
    with pytest.raises(CaptureConfigError, match="pooling model: it generates nothing"):
        LLM(str(minilm_path()), probes=PROBES, monitors=[monitor], **engine_defaults)
    with pytest.raises(CaptureConfigError, match="last_decode_token=True, but BertModel"):
        LLM(str(minilm_path()), layers=[0], last_decode_token=True, **engine_defaults)


def test_per_request_monitors_and_steering_refused(minilm: Any) -> None:
    from vllm import PoolingParams

    params = PoolingParams(
        extra_kwargs={"probehook": {"monitors": [{"probe": "mid", "threshold": 0.5}]}}
    )
    with pytest.raises(CaptureConfigError, match="pooling request"):
        minilm.embed(TEXTS[:1], pooling_params=params, use_tqdm=False)
    steered = PoolingParams(extra_kwargs={"probehook": {"steer": {"up": 1.0}}})
    with pytest.raises(CaptureConfigError, match="pooling request: probehook steers generative"):
        minilm.embed(TEXTS[:1], pooling_params=steered, use_tqdm=False)


def test_malformed_options_storm(minilm: Any) -> None:
    """Pooling requests go through the same parser: the same words as generation."""
    from malformed_options import malformed
    from vllm import PoolingParams

    from probehook.core.request_options import RequestOptions

    address = re.compile(r"0x[0-9a-f]+")
    before = minilm.embed(TEXTS[:1], use_tqdm=False)[0]
    sent = 0
    for value in malformed():
        try:
            params = PoolingParams(extra_kwargs={"probehook": value})
        except ValueError:
            continue  # vLLM refuses it itself
        with pytest.raises(CaptureConfigError) as want:
            RequestOptions.from_user(value, None, write_options())
        with pytest.raises(CaptureConfigError) as got:
            minilm.embed(TEXTS[:1], pooling_params=params, use_tqdm=False)
        # (vLLM copies the params, so an object() differs in its address only)
        assert address.sub("0x", str(got.value)) == address.sub("0x", str(want.value))
        sent += 1
    assert sent >= 100
    after = minilm.embed(TEXTS[:1], use_tqdm=False)[0]
    for layer in LAYERS:
        assert torch.equal(after.hidden_states[layer], before.hidden_states[layer])


def test_classify_and_cross_encoder_score(tmp_path: Path, engine_defaults: dict) -> None:
    from probehook import LLM

    # One label: vLLM's score API takes cross-encoders with a single logit.
    model_dir = build_random_bert_classifier(tmp_path / "cls", num_labels=1)
    llm = LLM(str(model_dir), layers=[0, 1], enforce_eager=True, **engine_defaults)
    try:
        classified = llm.classify(TEXTS[:2], use_tqdm=False)
        cls = "BertForSequenceClassification"
        for out in classified:
            _assert_rows_equal_hf(out, model_dir, cls, [0, 1])
            with torch.no_grad():
                logits = _hf_models(str(model_dir), cls)(torch.tensor([out.prompt_token_ids]))
            want = logits.logits.sigmoid()[0]  # one label: a sigmoid, not a softmax
            assert torch.allclose(torch.tensor(out.outputs.probs), want, atol=1e-4)
        # A cross-encoder reads the pair as one input: one pooled input per score.
        (scored,) = llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)
        (pair,) = scored.inputs
        encoded = llm.get_tokenizer()(TEXTS[0], TEXTS[1])  # segment B has token type 1
        assert list(pair.prompt_token_ids) == encoded["input_ids"]
        _assert_rows_equal_hf(pair, model_dir, cls, [0, 1], encoded["token_type_ids"])
    finally:
        llm.shutdown()


def test_decoder_converted_to_an_embedding_model(llama_dir: Path, engine_defaults: dict) -> None:
    """A decoder LLM served as an embedding model (vLLM's ``convert="embed"``, as for
    e5-mistral-style embedders): its decoder layers' rows for every input token, as HF's."""
    from probehook import LLM

    llm = LLM(
        str(llama_dir),
        runner="pooling",
        convert="embed",
        layers=[0, 1],
        enforce_eager=True,
        **engine_defaults,
    )
    try:
        outputs = llm.embed(["1+1=", "2+3=5"], use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outputs:
        _assert_rows_equal_hf(out, llama_dir, "LlamaModel", [0, 1])
        # vLLM's embedding, untouched: the last token's final (normed) state, normalised.
        last = _hf_stream(llama_dir, "LlamaModel", list(out.prompt_token_ids))[-1][0, -1]
        cosine = torch.nn.functional.cosine_similarity(
            torch.tensor(out.outputs.embedding), last, dim=0
        )
        assert cosine.item() > 0.9999


def test_server_embeddings_carry_rows_and_scores(minilm: Any, tmp_path: Path) -> None:
    """The server runs probehook.AsyncLLM: this is also the test of ``AsyncLLM.encode`` (rows
    through the streaming data plane equal the offline LLM's)."""
    from helpers import post_json

    from probehook.frontend.response_fields import decode_array
    from probehook.testing import ServerProcess

    offline = minilm.embed(TEXTS, use_tqdm=False)
    probe_path = PROBES["mid"].save(tmp_path / "mid.safetensors")
    argv = [str(minilm_path()), "--layers", "0,5", "--probe", f"mid={probe_path}"]
    argv += ["--max-capture-response-mb", "0.1", "--served-model-name", "minilm"]
    argv += ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager"]
    argv += ["--gpu-memory-utilization", "0.1"]
    server = ServerProcess(argv, log=tmp_path / "server.log")
    try:
        server.wait()
        asked = {"layers": [5], "probes": ["mid"]}
        body = {"model": "minilm", "input": TEXTS, "probehook": asked}
        status, answer = post_json(server.port, "/v1/embeddings", body)
        assert status == 200, answer
        for item, want in zip(answer["data"], offline, strict=True):
            field = item["probehook"]
            assert sorted(field) == ["hidden_states", "probe_scores"]
            rows = torch.from_numpy(decode_array(field["hidden_states"]["5"]).copy())
            assert torch.allclose(rows, want.hidden_states[5], atol=TOL)
            assert torch.allclose(
                torch.tensor(field["probe_scores"]["mid"]), want.probe_scores["mid"], atol=1e-4
            )
            assert item["embedding"] == pytest.approx(want.outputs.embedding, abs=1e-5)
        # Without the field: vLLM's answer, untouched.
        status, plain = post_json(
            server.port, "/v1/embeddings", {"model": "minilm", "input": TEXTS}
        )
        assert status == 200 and all("probehook" not in item for item in plain["data"])
        # Refused before any model work, with the reason.
        for route, extra, message in [
            ("/v1/embeddings", {"probehook": {"layers": [3]}}, "was not captured by this engine"),
            ("/v1/embeddings", {"probehook": {"probes": ["nope"]}}, "nope"),
            ("/v1/embeddings", {"probehook": {"colour": 1}}, "colour"),
            ("/v1/embeddings", {"probehook": {"layers": [0, 5]}, "input": TEXTS * 20}, "cap"),
        ]:
            status, answer = post_json(
                server.port, route, {"model": "minilm", "input": TEXTS, **extra}
            )
            assert status == 400 and message in answer["error"]["message"], answer
        # Every malformed object is a 400 with the words of the one parser.
        from malformed_options import malformed

        from probehook.core.request_options import RequestOptions

        for value in malformed(json_only=True):
            with pytest.raises(CaptureConfigError) as want:
                RequestOptions.from_user(value, None, write_options())
            body = {"model": "minilm", "input": TEXTS[:1], "probehook": value}
            status, answer = post_json(server.port, "/v1/embeddings", body)
            assert status == 400 and answer["error"]["message"] == str(want.value), answer
        status, answer = post_json(server.port, "/v1/embeddings", body | {"probehook": asked})
        assert status == 200 and answer["data"][0]["embedding"] == pytest.approx(
            offline[0].outputs.embedding, abs=1e-5
        )
        score = {"model": "minilm", "text_1": TEXTS[0], "text_2": TEXTS[1], "probehook": asked}
        status, answer = post_json(server.port, "/score", score)
        assert status == 400 and "not available on /score" in answer["error"]["message"], answer
    finally:
        server.stop()
