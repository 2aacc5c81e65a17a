"""The viewer's page from data someone else wrote (review D2, D4, D5): probe names, SAE names,
labels and token texts that are HTML or script never reach the page as markup, from a saved
responses file and from a stored request alike; a capture-only output and a completion with
no tokens view. No engine: the page is built from the data each source holds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<!--<script>",
    "</script><script>alert(2)</script>",
    '"><svg onload=alert(3)>',
]


class Tokenizer:
    """Token ``t``'s text is hostile string ``t % 4`` (with its id, so texts differ)."""

    def decode(self, ids: list[int]) -> str:
        return f"{HOSTILE[ids[0] % len(HOSTILE)]}#{ids[0]}"


def _response(tokens: list[int]) -> dict[str, Any]:
    n = len(tokens)
    scores = {name: [0.5] * n for name in HOSTILE}  # two or more probes: the probe grid
    return {
        "id": "cmpl-1",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "prompt_token_ids": [0, 1, 2],
                "token_ids": tokens,
                "finish_reason": "length",
                "probehook": {
                    "prefill_probe_scores": {name: [0.25] * 3 for name in HOSTILE},
                    "probe_scores": scores,
                    "sae_features": {
                        HOSTILE[0]: {
                            "indices": [[5, 1]] * n,
                            "values": [[2.0, 1.0]] * n,
                            "l0": [2] * n,
                        }
                    },
                    # attention per head, its chosen heads and spans named by the file
                    "attention": {
                        "3": {
                            "positions": [[[2, 0]]] * n,
                            "probs": [[[0.75, 0.25]]] * n,
                            "entropy": [[0.5]] * n,
                            "span_mass": [[[0.25]]] * n,
                            "labels": {"heads": [HOSTILE[1]], "spans": [HOSTILE[2]]},
                        }
                    },
                },
            }
        ],
    }


def _assert_inert(page: str) -> None:
    """No hostile string appears as markup anywhere on the page: only escaped."""
    for markup in ("<img src=x", "<!--", "<script>alert", "<svg onload"):
        assert markup not in page, f"{markup!r} reached the page as markup"
    # The inline JSON holds no '<' at all (an HTML parser reads none of it as a tag).
    for payload in re.findall(r'class="ph-data">(.*?)</script>', page, flags=re.S):
        assert "<" not in payload and ">" not in payload


def test_a_responses_files_hostile_names_labels_and_tokens_stay_text(tmp_path) -> None:
    from probehook import view
    from probehook.viewer.served import read_responses

    path = tmp_path / "responses.jsonl"
    path.write_text(json.dumps(_response([3, 4, 5, 6])) + "\n", encoding="utf-8")
    outputs = list(read_responses(path))
    labels = {HOSTILE[0]: {5: HOSTILE[1], 1: HOSTILE[2]}}
    shown = view(outputs, Tokenizer(), labels=labels)
    data = shown.requests[0]
    assert any(grid["name"] == "probes: score by token" for grid in data["grids"])
    assert data["tokens"][0] == f"{HOSTILE[0]}#0"  # the data keeps the text as it is
    assert any(t["name"] == f"attention 3 h{HOSTILE[1]}" for t in data["top_k"])
    page = shown.html()
    _assert_inert(page)
    # The page still carries every name, escaped, and its JSON reads back to the data.
    payload = re.search(r'class="ph-data">(.*?)</script>', page, flags=re.S)
    assert payload is not None and json.loads(payload.group(1)) == json.loads(json.dumps(data))
    saved = shown.save(tmp_path / "page.html").read_text(encoding="utf-8")
    _assert_inert(saved)


@dataclass
class Stored:
    """A stored request's surface as the viewer reads it (``StoredRequest``'s names)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    probe_scores: dict[str, torch.Tensor]
    prefill_probe_scores: dict[str, torch.Tensor]
    store_id: str = HOSTILE[3]
    finish_reason: str | None = HOSTILE[2]
    steering: dict[str, Any] = field(default_factory=dict)
    sae_features: dict[str, Any] = field(default_factory=dict)
    prefill_sae_features: dict[str, Any] = field(default_factory=dict)

    def top_k(self, source: str, phase: str = "decode") -> dict[str, Any]:
        return {}


def test_a_stored_requests_hostile_names_and_marks_stay_text() -> None:
    from probehook import view
    from probehook.outputs.top_k import TopKRows

    rows = TopKRows(torch.tensor([[7, -1]] * 3), torch.tensor([[1.5, 0.0]] * 3), torch.ones(3))
    stored = Stored(
        [0, 1],
        [2, 3, 4],
        {name: torch.full((3,), 0.75) for name in HOSTILE},
        {name: torch.full((2,), 0.25) for name in HOSTILE},
        steering={
            "vectors": {HOSTILE[1]: 2.0},
            "start": 2,
            "clamp": {HOSTILE[0]: {"7": 0.0}},
            "ops": {HOSTILE[1]: HOSTILE[2]},
        },  # a stored record's op words are text too
        sae_features={HOSTILE[3]: rows},
    )
    shown = view(stored, Tokenizer(), labels={HOSTILE[3]: {7: HOSTILE[0]}})
    assert shown.requests[0]["title"] == f"request {HOSTILE[3]}"
    _assert_inert(shown.html())


def test_a_capture_only_output_views_its_prompt_rows() -> None:
    """``LLM.capture`` outputs have no completion (``outputs`` is None): the prompt shows with
    its rows (review D4: ``TypeError``)."""
    from probehook import view

    @dataclass
    class Captured:
        request_id: str
        prompt_token_ids: list[int]
        outputs: Any = None
        prefill_probe_scores: dict[str, torch.Tensor] = field(default_factory=dict)

    out = Captured("0", [0, 1, 2], prefill_probe_scores={"p": torch.tensor([0.1, 0.2, 0.9])})
    data = view(out).requests[0]
    assert data["ids"] == [0, 1, 2] and data["n_prompt"] == 3
    probe = next(s for s in data["series"] if s["name"] == "probe p")
    assert probe["values"] == pytest.approx([0.1, 0.2, 0.9])
    assert data["marks"]["finish_reason"] is None


def test_a_completion_with_no_tokens_reads_back_and_views(tmp_path) -> None:
    """Zero rows are served as empty columns, in JSON and base64 alike; they read back as zero
    rows (review D5: ``RuntimeError`` from a reshape)."""
    from probehook import view
    from probehook.outputs.top_k import TopKRows, compact_top_k, json_top_k
    from probehook.viewer.served import read_responses

    empty = TopKRows.empty(4)
    for form in (json_top_k(empty), compact_top_k({"s": empty})["s"]):
        back = TopKRows.from_columns(form)
        assert len(back) == 0 and back.indices.shape[0] == 0
    with pytest.raises(ValueError, match="not 3 rows of one width"):
        TopKRows.from_columns({"indices": [1, 2, 3, 4], "values": [1.0] * 4, "l0": [1, 1, 1]})
    body = _response([])
    body["choices"][0]["probehook"]["sae_features"] = {"s": json_top_k(empty)}
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps(body) + "\n", encoding="utf-8")
    data = view(list(read_responses(path))).requests[0]
    assert data["ids"] == [0, 1, 2]


def test_labels_name_the_entries_of_any_top_k_readout() -> None:
    """Labels are by instance name for every top-k readout, as for an SAE's features: a lens
    instance's labelled token is named in its block and gets a series of its own."""
    from probehook import view
    from probehook.outputs.lens import LensRows

    @dataclass
    class Completion:
        token_ids: list[int]
        lens: dict[str, Any]
        finish_reason: str | None = None

    @dataclass
    class Output:
        request_id: str
        prompt_token_ids: list[int]
        outputs: list[Completion]

    rows = LensRows(torch.tensor([[5, 2], [2, 5]]), torch.tensor([[-0.1, -2.0], [-0.3, -1.0]]),
                    torch.tensor([-0.1, -0.3]))  # fmt: skip
    out = Output("0", [0, 1], [Completion([7, 8], {"j": {3: rows}})])
    data = view(out, labels={"j@3": {5: "five"}}).requests[0]
    block = next(b for b in data["top_k"] if b["name"] == "lens j@3")
    assert block["labels"] == {"5": "five"}
    labelled = next(s for s in data["series"] if s["name"] == "lens j@3 #5 five")
    got = [None if v is None else round(v, 5) for v in labelled["values"]]
    assert got == [None, -0.1, -1.0, None]  # decode row i at position 1 + i
