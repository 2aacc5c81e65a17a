"""Every output processor reads back what it wrote into a response (``from_response`` of
``to_response``, and of the compact form), and a saved response becomes the viewer's
outputs (no engine; the served round trip on a real server is in tests/test_server.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.lens import LensRows
from probehook.outputs.top_k import TopKRows
from probehook.viewer.served import ResponseFileError, outputs_from_response

ROWS = TopKRows(
    torch.tensor([[7, 3], [70000, -1]]),
    torch.tensor([[2.5, 1.0], [float("inf"), 0.0]]),
    torch.tensor([4, 1]),
)
LENS = LensRows(torch.tensor([[5, 9]]), torch.tensor([[-0.1, -2.5]]), torch.tensor([-float("inf")]))


def processor(name: str):
    return next(p for p in OUTPUT_PROCESSORS if p.name == name)


def same(a: TopKRows, b: TopKRows) -> None:
    assert type(a) is type(b)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.l0.nan_to_num(7), b.l0)
    finite = torch.isfinite(b.values)
    # a non-finite value stays non-finite: NaN from JSON's null, itself from base64
    assert torch.equal(a.values[finite], b.values[finite])
    assert not torch.isfinite(a.values[~finite]).any()


def test_each_processor_reads_back_its_response() -> None:
    scores = {"truth": torch.tensor([0.25, 0.5]), "kind": torch.tensor([[0.1, 0.9], [0.5, 0.5]])}
    back = processor("probe_scores").from_response(json.loads(json.dumps(
        processor("probe_scores").to_response(scores))))  # fmt: skip
    assert all(torch.equal(back[k], scores[k]) for k in scores)
    hidden = {3: torch.randn(2, 4), 0: torch.randn(1, 4).bfloat16()}
    back = processor("hidden_states").from_response(processor("hidden_states").to_response(hidden))
    assert torch.equal(back[3], hidden[3]) and torch.equal(back[0], hidden[0].float())
    saes = processor("sae_features")
    for form in (saes.to_response, saes.to_compact):
        same(saes.from_response(json.loads(json.dumps(form({"s": ROWS}))))["s"], ROWS)
    lens = processor("lens")
    for form in (lens.to_response, lens.to_compact):
        got = lens.from_response(json.loads(json.dumps(form({"j": {4: LENS}}))))
        assert list(got) == ["j"] and list(got["j"]) == [4]
        assert torch.equal(got["j"][4].indices, LENS.indices)
        assert not torch.isfinite(got["j"][4].target_logprob).any()
        assert torch.equal(got["j"][4].logprobs, LENS.logprobs)


def test_a_response_becomes_outputs_and_bad_ones_name_the_fix() -> None:
    body = {
        "id": "cmpl-1",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "prompt_token_ids": [1, 5, 6],
                "token_ids": [8, 2],
                "finish_reason": "stop",
                "stop_reason": "probe:truth",
                "probehook": {
                    "probe_scores": {"truth": [0.25, 0.75]},
                    "prefill_probe_scores": {"truth": [0.1, 0.2, 0.3]},
                    "probe_flags": {"truth": [1]},
                },
            }
        ],
    }
    (out,) = outputs_from_response(body)
    assert out.request_id == "cmpl-1-0" and out.prompt_token_ids == [1, 5, 6]
    completion = out.outputs[0]
    assert completion.token_ids == [8, 2] and completion.stop_reason == "probe:truth"
    assert completion.probe_scores["truth"].tolist() == [0.25, 0.75]
    assert out.prefill_probe_scores["truth"].tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert completion.probe_flags == {"truth": [1]}
    assert getattr(completion, "sae_features", None) is None
    del body["choices"][0]["token_ids"]
    with pytest.raises(ResponseFileError, match='no token ids: send the request with "return'):
        outputs_from_response(body)
    with pytest.raises(ResponseFileError, match="has no choices"):
        outputs_from_response({"object": "error"})


def test_every_non_finite_number_a_served_form_writes_as_null_is_named() -> None:
    """A non-finite scalar (a lens's target log-prob: NaN on a capture-only last row, -inf
    where the target is impossible) is named in ``non_finite`` as non-finite values are
    (review D12: only the values were checked), in the JSON and the base64 form alike."""
    from probehook.outputs.top_k import compact_top_k, json_top_k

    rows = LensRows(
        torch.tensor([[5, 9], [1, 2], [3, 4]]),
        torch.tensor([[-0.1, -2.5], [-0.2, float("nan")], [-0.3, -1.0]]),
        torch.tensor([-1.0, -2.0, float("nan")]),
    )
    served = json_top_k(rows)
    assert served["non_finite"] == [1, 2]
    assert served["target_logprob"][2] is None
    assert compact_top_k({"l": rows})["l"]["non_finite"] == [1, 2]
    assert "non_finite" not in json_top_k(rows.rows(0, 1))
    assert json_top_k(ROWS)["non_finite"] == [1]  # an integer scalar: values alone


def test_indices_travel_exactly_past_2_24_and_too_wide_ones_are_refused() -> None:
    """The worker packs indices as int32 bits (the column schema's index column), so odd
    indices past 2**24 (a 32M-feature SAE's; float32 rounded them: review D9) arrive exactly,
    through unpacking, a stream's decoder and the stop processor's read; a readout instance
    whose indices may pass int32 is refused at construction, naming it."""
    from toy_readout import RowNorm

    from probehook.core.monitors import top_k_value
    from probehook.errors import CaptureConfigError
    from probehook.frontend.readout_set import ReadoutSet
    from probehook.outputs.top_k import PACKED_INDEX_LIMIT, TopKDecoder, check_packed_indices
    from probehook.outputs.top_k_readout import pack

    odd = [2**24 + 1, PACKED_INDEX_LIMIT, 3]
    assert float(torch.tensor(odd[0], dtype=torch.float32)) != odd[0]  # float32 would round
    packed = pack(torch.tensor([odd, [5, -1, -1]]), torch.tensor([[3.0, 2.0, 1.0]] * 2),
                  torch.tensor([3.0, 1.0]))  # fmt: skip
    assert TopKRows.unpack(packed, 3).indices.tolist() == [odd, [5, -1, -1]]
    assert TopKDecoder().decode(packed[None], 0)[0].indices.tolist() == [odd, [5, -1, -1]]
    assert top_k_value(packed[0].numpy(), odd[0], 0.0) == 3.0
    assert top_k_value(packed[0].numpy(), odd[0] - 1, 0.0) == 0.0
    check_packed_indices(2**25, "SAE 'big'")  # a 32M-feature SAE: fine now

    class Wide(RowNorm):
        def index_bound(self, settings: Any) -> int:
            return PACKED_INDEX_LIMIT + 1

    ReadoutSet(RowNorm(), {"n": 1}, None, num_layers=4, hidden_size=8)
    with pytest.raises(CaptureConfigError, match=r"row_norms 'n' has 2,147,483,648 entries"):
        ReadoutSet(Wide(), {"n": 1}, None, num_layers=4, hidden_size=8)
