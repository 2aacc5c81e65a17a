"""``probehook serve``'s own flags, parsed without starting anything."""

from __future__ import annotations

import argparse

import pytest

from probehook.adapter.server.serve import capture_kwargs, parse_monitor
from probehook.core.monitors import ProbeMonitor
from probehook.errors import CaptureConfigError


def flags(**overrides: object) -> argparse.Namespace:
    values = dict(
        layers="1,5",
        probe=["truth=probes/truth.safetensors"],
        monitor=[],
        include_prefill=False,
        store=None,
        max_capture_response_mb=64.0,
        store_flush_interval=5.0,
        steer=[],
        steering_layers=None,
        steering_capacity=64,
        sae=[],
        sae_top_k=None,
        sae_dtype=None,
        sae_clamping=False,
        readout=[],
        readout_top_k=[],
        lens=[],
        lens_layers=None,
        lens_top_k=None,
        lens_dtype=None,
    )
    return argparse.Namespace(**{**values, **overrides})


def test_lens_flags_become_lens_arguments() -> None:
    lens = dict(lens=["logit=logit", "j=j.pt"], lens_layers="2,4", lens_top_k=3)
    kwargs = capture_kwargs(flags(**lens, lens_dtype="bfloat16"))
    assert kwargs["lenses"] == {"logit": "logit", "j": "j.pt"}
    assert kwargs["lens_layers"] == [2, 4] and kwargs["lens_top_k"] == 3
    assert kwargs["lens_dtype"] == "bfloat16"
    with pytest.raises(SystemExit, match="--lens-dtype needs --lens"):
        capture_kwargs(flags(lens_dtype="float16"))
    assert "lenses" not in capture_kwargs(flags())
    with pytest.raises(SystemExit, match="--lens-layers needs --lens"):
        capture_kwargs(flags(lens_layers="1"))
    with pytest.raises(SystemExit, match="--lens-top-k needs --lens"):
        capture_kwargs(flags(lens_top_k=3))
    with pytest.raises(SystemExit, match="NAME=PATH"):
        capture_kwargs(flags(lens=["j"]))


def test_flags_become_async_llm_arguments() -> None:
    kwargs = capture_kwargs(flags(monitor=["truth:stop:0.9"], include_prefill=True))
    assert kwargs["layers"] == [1, 5] and kwargs["include_prefill"] is True
    assert kwargs["probes"] == {"truth": "probes/truth.safetensors"}
    assert kwargs["monitors"] == [ProbeMonitor("truth", 0.9, "stop")]
    assert capture_kwargs(flags(layers=None, probe=[]))["probes"] is None
    steering = capture_kwargs(flags(steer=["up=up.st"], steering_layers="2", steering_capacity=8))
    assert steering["steering"] == {"up": "up.st"} and steering["steering_layers"] == [2]
    assert steering["steering_capacity"] == 8
    saes = capture_kwargs(flags(sae=["res3=saes/l3"], sae_top_k=8, sae_clamping=True))
    assert saes["saes"] == {"res3": "saes/l3"} and saes["sae_top_k"] == 8
    assert saes["sae_clamping"] is True and saes.get("sae_dtype") is None
    readouts = capture_kwargs(flags(readout=["norm:n3=3", "norm:n1=1"], readout_top_k=["norm=1"]))
    assert readouts["readouts"] == {"norm": {"n3": "3", "n1": "1"}}
    assert readouts["readout_top_k"] == {"norm": 1}
    for bad in (["norm=3"], ["norm:n3"], ["norm:n3=3", "norm:n3=4"]):
        with pytest.raises(SystemExit, match="--readout"):
            capture_kwargs(flags(readout=bad))


def test_monitor_specs() -> None:
    assert parse_monitor("truth:flag:0.2:below") == ProbeMonitor("truth", 0.2, "flag", "below")
    assert parse_monitor('{"probe": "topic", "threshold": 0.5, "label": "b"}').label == "b"
    for bad, message in [
        ("truth:0.9", "PROBE:ACTION:THRESHOLD"),
        ("truth:stop:high", "not a number"),
        ("truth:explode:0.9", "action"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(CaptureConfigError, match=message):
            parse_monitor(bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"probe": ["truth"]}, "must be NAME=PATH"),
        ({"probe": ["a=x", "a=y"]}, "given twice"),
        ({"monitor": ["truth:stop"]}, "PROBE:ACTION:THRESHOLD"),
        ({"max_capture_response_mb": 0.0}, "must be positive"),
        ({"layers": "1,x"}, "comma-separated ints"),
        ({"store_flush_interval": -1.0}, "store-flush-interval"),
        ({"steer": ["up"]}, r"--steer 'up' must be NAME=PATH"),
        ({"steer": ["a=x", "a=y"]}, "--steer a is given twice"),
        ({"steering_capacity": 0}, "--steering-capacity must be a positive"),
        ({"steering_layers": "x"}, "comma-separated ints"),
        ({"sae": ["res3"]}, r"--sae 'res3' must be NAME=PATH"),
        ({"sae_top_k": 0}, "--sae-top-k must be a positive"),
        ({"sae_top_k": 8}, "--sae-top-k needs --sae"),
    ],
)
def test_bad_flags_exit_with_a_message(overrides: dict, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        capture_kwargs(flags(**overrides))


def test_capture_default_is_a_json_object_checked_before_start() -> None:
    from probehook.adapter.server.serve import parse_capture_default

    assert parse_capture_default(None) is None
    assert parse_capture_default('{"probes": true, "layers": [3]}') == {
        "probes": True,
        "layers": [3],
    }
    with pytest.raises(SystemExit, match=r"--capture-default '\{probes' is not valid JSON"):
        parse_capture_default("{probes")
    with pytest.raises(SystemExit, match=r"must be a JSON object .* got '\[3\]'"):
        parse_capture_default("[3]")


def test_serve_flags_parse_with_the_installed_vllms_parser() -> None:
    """The parser comes from wherever the installed vLLM keeps it (vllm_names)."""
    from probehook.adapter.server.serve import parse_args

    args = parse_args(["MODEL", "--layers", "3", "--capture-default", "{}", "--port", "8123"])
    assert args.model == "MODEL" and args.layers == "3" and args.port == 8123
    assert args.capture_default == "{}"  # parsed into an object by main()
    with pytest.raises(SystemExit, match="--data-parallel-size > 1 is not supported"):
        parse_args(["MODEL", "--data-parallel-size", "2"])


def test_token_embed_handler_refuses_the_opt_in() -> None:
    """vLLM 0.33's ServingTokenEmbedding (absent on 0.32, so a stand-in base here): a request
    with a probehook object gets the refusal (vLLM answers 400 with it), one without is
    vLLM's."""
    import asyncio
    from types import SimpleNamespace

    from probehook.adapter.server import pooling_serving

    class TokenEmbedding:  # the one method the capture class calls before refusing
        async def _init_ctx(self, io_processor: object, request: object, raw: object) -> object:
            return SimpleNamespace()

    handler = pooling_serving.capture_class(
        TokenEmbedding, "/v1/embeddings", refusal=pooling_serving.TOKEN_EMBED_REFUSAL
    )()
    asked = SimpleNamespace(model_extra={"probehook": {"layers": [0]}})
    with pytest.raises(CaptureConfigError, match="token_embed model's /v1/embeddings"):
        asyncio.run(handler._init_ctx(None, asked, None))
    plain = asyncio.run(handler._init_ctx(None, SimpleNamespace(model_extra={}), None))
    assert plain.probehook_wanted is False


def test_inline_vectors_are_refused_unless_the_server_allows_them() -> None:
    import asyncio
    from types import SimpleNamespace

    from probehook.adapter.server.serving import CaptureServing

    handler = CaptureServing()
    handler.engine_client = SimpleNamespace(steering={"up": object(), "inline:abc": object()})
    body = {"probehook": {"steer": {"mine": 1.0}, "steer_vectors": {"mine": {"2": [1.0]}}}}
    request = SimpleNamespace(model_extra=body)
    with pytest.raises(CaptureConfigError, match=r"--allow-inline-steering.*\['up'\]"):
        asyncio.run(handler._acquire_inline(request))
    assert asyncio.run(handler._acquire_inline(SimpleNamespace(model_extra={}))) == []


def test_a_stream_never_started_still_gives_its_inline_vectors_back() -> None:
    """A client gone before its streamed response began: the response's generator is never
    iterated, so its ``finally`` never runs; the request's inline vectors must still leave
    the bank when the generator is dropped, or each such request holds a bank row for good
    (issue 37, item 4)."""
    import asyncio
    import gc
    from types import SimpleNamespace

    from probehook.adapter.server.serving import CaptureServing

    released: list[str] = []

    class Engine:
        steering: dict = {}
        readout_options: dict = {}

        async def acquire_inline_steering(self, vector: object) -> str:
            return "inline:mine"

        async def release_inline_steering(self, name: str) -> None:
            released.append(name)

        def check_request(self, params: object) -> None:
            return None

    handler = CaptureServing()
    handler.engine_client = Engine()
    handler.allow_inline_steering = True
    body = {"probehook": {"steer": {"mine": 1.0}, "steer_vectors": {"mine": {"2": [1.0]}}}}
    request = SimpleNamespace(model_extra=body, vllm_xargs=None, n=1)

    async def stream() -> object:
        yield "data: never sent\n\n"

    async def run() -> object:
        return stream()

    async def main() -> None:
        result = await handler._run(request, 1, run)
        assert released == []  # the stream holds its vector while it may still run
        del result
        gc.collect()
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert released == ["inline:mine"]


def test_served_features_in_lists_or_compact_base64() -> None:
    """A choice's ``sae_features`` as JSON lists, or (``--sae-encoding base64``) as arrays
    ``decode_array`` reads back to the same numbers."""
    from types import SimpleNamespace

    import torch

    from probehook.frontend.response_fields import ChoiceFields, decode_array
    from probehook.saes import SAEFeatures

    got = SAEFeatures(
        torch.tensor([[7, 3, -1], [400, 2, 1]]),
        torch.tensor([[2.5, 1.25, 0.0], [9.0, 0.5, 0.125]]),
        torch.tensor([2, 5]),
    )
    completion = SimpleNamespace(index=0, sae_features={"res": got}, capture_error=None)
    output = SimpleNamespace(prefill_sae_features={}, processor_errors={})
    plain, compact = ChoiceFields(), ChoiceFields(compact=True)
    for fields in (plain, compact):
        fields.add(0, output, completion)
    lists = plain.take(0)["sae_features"]["res"]
    arrays = compact.take(0)["sae_features"]["res"]
    assert lists["indices"] == got.indices.tolist() and lists["l0"] == got.l0.tolist()
    for part in ("indices", "values", "l0"):
        assert decode_array(arrays[part]).tolist() == getattr(got, part).tolist(), part
    assert arrays["indices"]["dtype"] == "int32" and arrays["values"]["dtype"] == "float32"


def test_no_response_carries_a_non_finite_number_unflagged() -> None:
    """A float16 encoder can overflow to inf: JSON has no such number (Python writes
    ``Infinity``, which clients refuse), so it is null and its token is named in
    ``non_finite``; in base64 the array keeps it and ``non_finite`` names it too. Probe scores
    likewise come back as null, never ``Infinity`` (issue 43)."""
    import json
    from types import SimpleNamespace

    import torch

    from probehook.frontend.response_fields import ChoiceFields
    from probehook.saes import SAEFeatures

    got = SAEFeatures(
        torch.tensor([[7, 3], [400, 2], [1, 2]]),
        torch.tensor([[2.5, 1.25], [float("inf"), 0.5], [1.0, float("nan")]]),
        torch.tensor([2, 5, 2]),
    )
    completion = SimpleNamespace(
        index=0,
        sae_features={"res": got},
        probe_scores={"p": torch.tensor([0.5, float("inf")])},
        capture_error=None,
    )
    output = SimpleNamespace(prefill_sae_features={}, processor_errors={})
    plain, compact = ChoiceFields(), ChoiceFields(compact=True)
    for fields in (plain, compact):
        fields.add(0, output, completion)
    lists = plain.take(0)
    text = json.dumps(lists, allow_nan=False)  # raises on inf or NaN
    assert "Infinity" not in text and "NaN" not in text
    features = lists["sae_features"]["res"]
    assert features["values"] == [[2.5, 1.25], [None, 0.5], [1.0, None]]
    assert features["non_finite"] == [1, 2]
    assert lists["probe_scores"]["p"] == [0.5, None]
    assert compact.take(0)["sae_features"]["res"]["non_finite"] == [1, 2]


def test_a_registered_readout_gets_its_flags_with_no_edit_in_probehook() -> None:
    """The toy readout (tests/toy_readout.py) registered: ``--norms NAME=SPEC`` and
    ``--norms-top-k K`` exist, generated from its engine options as the lenses' are, and
    become its engine arguments; an option flag without instances exits naming the fix."""
    from toy_readout import RowNorm

    from probehook.adapter.server.serve import add_capture_args
    from probehook.outputs import OUTPUT_PROCESSORS

    list(OUTPUT_PROCESSORS)  # the entry points, loaded before the registration
    registered = "row_norms" not in OUTPUT_PROCESSORS
    if registered:
        OUTPUT_PROCESSORS.register(RowNorm)
    try:
        parser = argparse.ArgumentParser()
        add_capture_args(parser)
        args = parser.parse_args(["--norms", "n3=3", "--norms", "n1=1", "--norms-top-k", "1"])
        kwargs = capture_kwargs(args)
        assert kwargs["norms"] == {"n3": "3", "n1": "1"} and kwargs["norms_top_k"] == 1
        assert "norms" not in capture_kwargs(parser.parse_args([]))
        with pytest.raises(SystemExit, match="--norms-top-k needs --norms NAME=SPEC"):
            capture_kwargs(parser.parse_args(["--norms-top-k", "1"]))
        with pytest.raises(SystemExit):  # argparse: the dtype's choices
            parser.parse_args(["--lens", "l=logit", "--lens-dtype", "int8"])
        lens = capture_kwargs(parser.parse_args(["--lens", "l=logit", "--lens-layers", "1,2"]))
        assert lens["lenses"] == {"l": "logit"} and lens["lens_layers"] == [1, 2]
        # a readout whose instances' flag takes one value (attention's layers, not NAME=SPEC)
        attention = capture_kwargs(parser.parse_args(["--attention-layers", "0,3",
                                                      "--attention-top-k", "4",
                                                      "--attention-min-p", "0.005"]))  # fmt: skip
        assert attention["attention_layers"] == [0, 3] and attention["attention_top_k"] == 4
        assert attention["attention_min_p"] == 0.005
        with pytest.raises(SystemExit, match="--attention-top-k needs --attention-layers"):
            capture_kwargs(parser.parse_args(["--attention-top-k", "4"]))
    finally:
        if registered:
            OUTPUT_PROCESSORS.unregister(RowNorm.name)


def test_the_top_k_encoding_flag_and_its_older_name() -> None:
    """``--top-k-encoding`` names what the flag switches (every top-k readout's served form,
    review: ``--sae-encoding`` switched lenses too); the older name still works."""
    from probehook.adapter.server.serve import add_capture_args

    parser = argparse.ArgumentParser()
    add_capture_args(parser)
    assert parser.parse_args([]).sae_encoding == "lists"
    for flag in ("--top-k-encoding", "--sae-encoding"):
        assert parser.parse_args([flag, "base64"]).sae_encoding == "base64"
    with pytest.raises(SystemExit):
        parser.parse_args(["--top-k-encoding", "hex"])
