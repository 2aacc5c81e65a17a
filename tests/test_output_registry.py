"""probehook.outputs: the output-processor registry, and the paths that go through it."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from probehook.frontend.fill import clear_outputs
from probehook.frontend.response_fields import ChoiceFields, decode_array
from probehook.outputs import (
    OUTPUT_PROCESSORS,
    OutputProcessor,
    OutputProcessorError,
    OutputProcessorRegistry,
)
from probehook.outputs.captures import BUILTIN


class TokenNorms(OutputProcessor):
    """A third party's processor: one number per token, joined across stream pieces."""

    name = "token_norms"
    completion_attributes = ("token_norms",)

    def empty(self) -> list:
        return []

    def merge(self, pieces: list[list[float]]) -> list[float]:
        return [x for piece in pieces for x in piece]

    def to_response(self, value: list[float]) -> list[float]:
        return [round(x, 2) for x in value]


def fresh(*processors: Any) -> OutputProcessorRegistry:
    registry = OutputProcessorRegistry(entry_point_group=None)
    for processor in processors:
        registry.register(processor)
    return registry


def test_builtin_processors_are_registered() -> None:
    names = OUTPUT_PROCESSORS.names()
    assert names[:3] == ["hidden_states", "probe_scores", "probe_flags"]
    # SAE features come through the entry point, as a third party's readout would, with the
    # flags of their monitors (derived) beside them.
    assert {"sae_features", "feature_flags", "lens", "lens_flags"} <= set(names)
    assert names.index("feature_flags") == names.index("sae_features") + 1
    assert OUTPUT_PROCESSORS["sae_features"].completion_attributes == ("sae_features",)
    assert OUTPUT_PROCESSORS["probe_scores"].request_attributes == ("prefill_probe_scores",)


def test_register_by_instance_or_as_a_class_decorator() -> None:
    registry = fresh()
    assert registry.register(TokenNorms()) is not None and "token_norms" in registry

    other = fresh()

    @other.register
    class Logits(OutputProcessor):
        name = "logits"
        completion_attributes = ("logits",)

    assert isinstance(other["logits"], Logits)


def test_bad_registrations_are_clear_errors() -> None:
    registry = fresh(TokenNorms)
    with pytest.raises(OutputProcessorError, match="'token_norms' is already registered"):
        registry.register(TokenNorms)

    class Clash(OutputProcessor):
        name = "clash"
        completion_attributes = ("token_norms",)

    with pytest.raises(OutputProcessorError, match=r"already owned by \['token_norms'\]"):
        registry.register(Clash)

    class Nameless(OutputProcessor):
        pass

    with pytest.raises(OutputProcessorError, match="has no name"):
        registry.register(Nameless)
    with pytest.raises(OutputProcessorError, match="not an output processor"):
        registry.register(object())


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(OutputProcessorError, match=r"'images'; known: \[.*'hidden_states'"):
        OUTPUT_PROCESSORS["images"]


def test_attach_to_a_model_class() -> None:
    registry = fresh(TokenNorms)

    @registry.for_model("token_norms")
    class TinyModel:
        pass

    @registry.for_model("segmentation")
    class Unregistered:
        pass

    assert isinstance(registry.for_model_class(TinyModel), TokenNorms)
    assert registry.for_model_class(object) is None
    with pytest.raises(OutputProcessorError, match="'segmentation'; known: \\['token_norms'\\]"):
        registry.for_model_class(Unregistered)


def test_entry_points_register_on_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "probehook.output_processors"
    good = EntryPoint("norms", "test_output_registry:TokenNorms", group)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [good])
    registry = OutputProcessorRegistry(entry_point_group=group)
    assert "token_norms" in registry.names()

    broken = EntryPoint("broken", "no_such_module_anywhere:make", group)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [broken])
    with pytest.raises(OutputProcessorError, match="'broken' .* failed to load"):
        OutputProcessorRegistry(entry_point_group=group).names()


def outputs(**completion: Any) -> tuple[Any, Any]:
    c = SimpleNamespace(index=0, **completion)
    return SimpleNamespace(outputs=[c]), c


def test_a_registered_processor_reaches_server_responses_and_streams_join() -> None:
    registry = fresh(*BUILTIN, TokenNorms)
    fields = ChoiceFields(registry)
    for lo in (0, 2):  # two stream outputs before the chunk that carries them
        output, c = outputs(
            hidden_states={3: torch.arange(lo, lo + 2.0).repeat(4, 1).T},
            probe_scores={"truth": torch.tensor([0.5, 0.25]) + lo},
            token_norms=[1.234 + lo, 2.0],
        )
        output.prefill_hidden_states = {3: torch.ones(5, 4)} if lo == 0 else {}
        fields.add(0, output, c)
    field = fields.take(0)
    assert field is not None and fields.take(0) is None
    assert field["token_norms"] == [1.23, 2.0, 3.23, 2.0]
    assert field["probe_scores"] == {"truth": [0.5, 0.25, 2.5, 2.25]}
    assert decode_array(field["hidden_states"]["3"])[:, 0].tolist() == [0, 1, 2, 3]
    assert decode_array(field["prefill_hidden_states"]["3"]).shape == (5, 4)


def test_a_failed_fill_is_named_in_server_fields() -> None:
    from probehook.frontend.response_fields import PooledFields

    registry = fresh(*BUILTIN, TokenNorms)
    output, c = outputs(token_norms=[1.0])
    output.processor_errors = {"other": "output processor 'other' failed on request r: boom"}
    fields = ChoiceFields(registry)
    fields.add(0, output, c)
    field = fields.take(0)
    assert field == {"token_norms": [1.0], "processor_errors": output.processor_errors}
    pooled = SimpleNamespace(processor_errors=output.processor_errors)
    assert PooledFields(registry).of(pooled) == {"processor_errors": output.processor_errors}


def test_every_output_gets_every_processors_attributes_empty() -> None:
    output, c = outputs(token_ids=[1])
    clear_outputs(output)
    for processor in OUTPUT_PROCESSORS:
        for attribute in processor.request_attributes:
            assert getattr(output, attribute) == processor.empty()
        for attribute in processor.completion_attributes:
            assert getattr(c, attribute) == processor.empty()


def test_capture_sources_map_to_their_processors() -> None:
    from probehook.frontend.fill import attributes_of
    from probehook.outputs import OUTPUT_PROCESSORS, OutputProcessorError

    # The capture paths (offline attach, streams, pooling) name no attribute themselves.
    assert attributes_of("hidden") == ("prefill_hidden_states", "hidden_states")
    assert attributes_of("scores") == ("prefill_probe_scores", "probe_scores")
    assert OUTPUT_PROCESSORS.for_source("scores").name == "probe_scores"
    with pytest.raises(OutputProcessorError, match="capture source 'logits'"):
        OUTPUT_PROCESSORS.for_source("logits")


class _TokenNorms(OutputProcessor):
    """docs/outputs.md's worked example: the norm of each generated token's row at the
    deepest captured layer, derived from what capture attached."""

    name = "token_norms"
    completion_attributes = ("token_norms",)

    def empty(self) -> list[float]:
        return []

    def fill(self, output: Any) -> None:
        for completion in output.outputs:
            rows = completion.hidden_states
            if rows:
                completion.token_norms = rows[max(rows)].float().norm(dim=-1).tolist()

    def merge(self, pieces: list[list[float]]) -> list[float]:
        return [x for piece in pieces for x in piece]


class _Broken(OutputProcessor):
    name = "broken"
    request_attributes = ("broken_value",)

    def fill(self, output: Any) -> None:
        if output.prompt == "3+4=":
            raise RuntimeError("no luck")
        output.broken_value = {"ok": True}


@pytest.mark.engine
def test_registered_processors_fill_every_output(eager_llm: Any) -> None:
    from probehook import SamplingParams
    from probehook.outputs import OUTPUT_PROCESSORS

    OUTPUT_PROCESSORS.register(_TokenNorms)
    OUTPUT_PROCESSORS.register(_Broken)
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        first, second = eager_llm.generate(["12+7=", "3+4="], params, use_tqdm=False)
    finally:
        OUTPUT_PROCESSORS.unregister("token_norms")
        OUTPUT_PROCESSORS.unregister("broken")
    completion = first.outputs[0]
    want = completion.hidden_states[2].float().norm(dim=-1).tolist()
    assert completion.token_norms == pytest.approx(want) and len(want) == 4
    # A processor that raises is named with the request; the others and the rows are intact.
    assert first.broken_value == {"ok": True} and first.processor_errors == {}
    assert second.broken_value == {}
    message = second.processor_errors["broken"]
    assert f"'broken' failed on request {second.request_id}:" in message and "no luck" in message
    assert second.outputs[0].token_norms and second.outputs[0].hidden_states[2].shape[0] == 4
    with pytest.raises(OutputProcessorError, match="known"):
        OUTPUT_PROCESSORS.unregister("token_norms")
