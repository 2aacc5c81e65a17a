"""The live page (``probehook serve --ui``) in Chromium against a stand-in server: Playwright
answers its routes with what ``probehook serve`` sends (its description, a streamed chat
completion), so the page's reading of the forms a real server is not started for here is
tested: the compact base64 columns (``--sae-encoding base64``), a multi-class and a regression
probe, a negative SAE activation, and an API key (``--api-key``). The real server's live page
is tested in tests/test_server.py. No engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

ORIGIN = "http://probehook.test"
KEY = "sekrit"
TOKENS = ["A", "B", "C"]
IDS = [11, 12, 13]
BINARY = [0.25, 0.5, 0.75]
REGRESSION = [-3.0, 1.5, 6.0]  # outside [0, 1]: painted as values, signed
CLASSES = [[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]
SAE_VALUES = [[4.0, -2.0], [-5.0, 1.0], [3.0, 0.5]]  # an abstopk SAE: negatives
LENS_TARGET = [-0.5, -1.5, -0.1]

DESCRIPTION = {
    "probes": {"p": {}, "reg": {}, "mc": {}},
    "saes": ["s"],
    "steering": {"vectors": {}},
    "readouts": {  # as the server describes its readouts (SAE features among them)
        "saes": {
            "options": ["saes", "sae_top_k"], "names": ["s"], "layers": [1], "k": 2,
            "name": "sae", "attribute": "sae_features", "columns": ["indices", "values", "l0"],
            "served": {"s": ["s"]}, "tokens": False, "series": None, "flags": "feature_flags",
        },
        "lens": {
            "options": ["lenses", "lens_layers"], "names": ["j"], "layers": [3], "k": 2,
            "name": "lens", "attribute": "lens",
            "columns": ["token_ids", "logprobs", "target_logprob"],
            "served": {"j@3": ["j", "3"]}, "tokens": True,
            "series": ["target", "logprob"], "flags": "lens_flags",
        },
        "attention_layers": {
            "options": ["attention", "attention_top_k", "attention_layers", "attention_heads",
                        "attention_spans"], "names": ["attention"], "layers": [3], "k": 2,
            "name": "attention", "attribute": "attention",
            "columns": ["positions", "probs", "entropy"], "served": {"3": ["3"]},
            "tokens": False, "positions": True, "series": ["entropy", "activation"],
            "flags": None,
        },
    },
}  # fmt: skip
N_PROMPT = 4
"""The prompt's tokens (each chunk's usage): the reply's position 0 is key position 3."""
ATTENDED = [[(3, 0.75), (0, 0.25)], [(4, 0.5), (3, 0.5)], [(5, 0.9), (4, 0.1)]]
"""Each reply row's two most attended keys (absolute positions) and their probabilities, of
query head 1, the one head the request asked for."""


def _chunks(compact: bool) -> list[dict[str, Any]]:
    """A streamed chat completion of three tokens, one a chunk, as the server sends it."""
    from probehook.outputs.attention import AttentionRows
    from probehook.outputs.lens import LensRows
    from probehook.outputs.top_k import TopKRows, compact_top_k, json_top_k

    def form(rows: Any) -> dict[str, Any]:
        return compact_top_k({"": rows})[""] if compact else json_top_k(rows)

    chunks = []
    for i, (text, token) in enumerate(zip(TOKENS, IDS, strict=True)):
        sae = TopKRows(
            torch.tensor([[7 + i, 20]]), torch.tensor([SAE_VALUES[i]]), torch.tensor([2])
        )
        lens = LensRows(
            torch.tensor([[token, 5]]),
            torch.tensor([[LENS_TARGET[i], -3.0]]),
            torch.tensor([LENS_TARGET[i]]),
        )
        attention = AttentionRows.of_columns({
            "positions": torch.tensor([[[p for p, _ in ATTENDED[i]]]]),
            "probs": torch.tensor([[[w for _, w in ATTENDED[i]]]]),
            "entropy": torch.tensor([[0.5]]), "span_mass": torch.tensor([[[0.25]]])},
            labels={"heads": [1], "spans": ["s"]})  # fmt: skip
        readings = {
            "probe_scores": {"p": [BINARY[i]], "reg": [REGRESSION[i]], "mc": [CLASSES[i]]},
            "sae_features": {"s": form(sae)},
            "lens": {"j": {"3": {**form(lens), "tokens": [[text, "x"]]}}},
            "attention": {"3": form(attention)},
        }
        choice = {"index": 0, "delta": {"content": text}, "token_ids": [token],
                  "logprobs": {"content": [{"token": text, "logprob": -0.1}]},
                  "finish_reason": "length" if i == len(TOKENS) - 1 else None,
                  "probehook": readings}  # fmt: skip
        chunks.append({"id": "chat-1", "choices": [choice],
                       "usage": {"prompt_tokens": N_PROMPT}})  # fmt: skip
    return chunks


def _serve(page: Any, compact: bool, key: str | None = None) -> list[dict[str, str]]:
    """Answer the page's routes as ``probehook serve --ui`` would; returns the headers of
    every request that reached /v1."""
    from probehook.viewer.live import live_page

    seen: list[dict[str, str]] = []
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in _chunks(compact)) + "data: [DONE]\n\n"

    def route(request_route: Any) -> None:
        request = request_route.request
        path = request.url.removeprefix(ORIGIN)
        if path == "/probehook/ui":
            request_route.fulfill(status=200, content_type="text/html", body=live_page())
            return
        if not path.startswith("/v1/"):
            request_route.abort()
            return
        seen.append(dict(request.headers))
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            request_route.fulfill(status=401, content_type="application/json",
                                  body=json.dumps({"error": "Unauthorized"}))  # fmt: skip
            return
        answers: dict[str, Callable[[], tuple[str, str]]] = {
            "/v1/probehook": lambda: ("application/json", json.dumps(DESCRIPTION)),
            "/v1/models": lambda: ("application/json", json.dumps({"data": [{"id": "tiny"}]})),
            "/v1/chat/completions": lambda: ("text/event-stream", stream),
        }
        content_type, body = answers[path]()
        request_route.fulfill(status=200, content_type=content_type, body=body)

    page.route("**/*", route)
    return seen


def _colour(values: list[float], scale: str, p: int) -> str:
    from probehook.viewer.page import level, series_scale, series_top, shade

    series = {"scale": scale, "values": values}
    t = level(values[p], series_scale(series), series_top(series))
    assert t is not None
    return shade(t)


def _send(page: Any, labels: dict[str, Any] | None = None) -> Any:
    page.wait_for_selector(".ph-live[data-ph-ready='1']")
    page.fill("#ph-message", "hello")
    page.fill("#ph-labels", json.dumps(labels or {}))
    page.evaluate(
        """() => { window.counts = []; new MutationObserver(() => window.counts.push(
            document.querySelectorAll('#ph-reply .ph-token').length))
            .observe(document.getElementById('ph-reply'), {childList: true}); }"""
    )
    page.click("#ph-send")
    page.wait_for_selector(".ph-live[data-ph-done='1']")
    # The stand-in sends the whole reply in one body: still painted a chunk at a time.
    counts = page.evaluate("window.counts")
    assert counts == list(range(1, len(TOKENS) + 2)), counts
    return page.locator("#ph-reply .ph-token")


@pytest.mark.parametrize("compact", [False, True], ids=["json", "base64"])
def test_the_live_page_reads_both_column_forms_and_paints_scores_on_their_scale(
    compact: bool,
) -> None:
    """JSON lists and base64 arrays paint the same (review: the page stopped after one token
    on base64, ``ids.forEach is not a function``); a multi-class probe is one series per class
    (review D8: class 0 under the probe's name); a regression probe's values and a negative
    activation are painted on a signed scale, not clamped to [0, 1] (D8). Attention per head
    (issue 51) in either form: its head named by the served labels, and the pointed token's
    attention shading the reply."""
    from browser import chromium

    from probehook.viewer.page import shade

    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        _serve(page, compact)
        page.goto(f"{ORIGIN}/probehook/ui")
        spans = _send(page, {"s": {"20": "twenty"}, "j@3": {"12": "B's id"}})
        assert spans.all_inner_texts()[1:] == TOKENS  # position 0: the prompt's last token
        options = page.locator("select.ph-series option").all_inner_texts()
        assert {"probe mc[0]", "probe mc[1]", "probe mc[2]", "probe reg"} <= set(options)
        # labelled entries of any top-k readout: a series each (0 where not among the kept)
        assert {"sae s #20 twenty", "lens j@3 #12 B's id"} <= set(options)
        assert "probe mc" not in options
        cases = {
            "lens j@3 #12 B's id": ([0.0, LENS_TARGET[1], 0.0], "activation"),
            "probe p": (BINARY, "score"),
            "probe reg": (REGRESSION, "score"),
            "probe mc[1]": ([c[1] for c in CLASSES], "score"),
            "lens j@3 target": (LENS_TARGET, "logprob"),
        }
        for name, (values, scale) in cases.items():
            page.select_option("select.ph-series", label=name)
            for p in range(len(TOKENS)):
                got = spans.nth(p).evaluate("e => getComputedStyle(e).backgroundColor")
                assert got == _colour(values, scale, p), (name, p)
        assert _colour(REGRESSION, "score", 0).startswith("rgb(2")  # red: below zero
        # the top-k rows, decoded from either form; a negative activation kept as it is
        spans.nth(1).hover()
        assert (
            page.inner_text(".ph-top-k[data-name='sae s']")
            == "sae s: #8 -5.0000, #20 (twenty) 1.0000"
        )
        assert page.inner_text(".ph-top-k[data-name='lens j@3']").startswith('lens j@3: "B"')
        # attention, of the one head asked (named by the served labels): pointing at a token
        # shades each token by its probability there (key positions mapped to the reply's)
        assert page.inner_text(".ph-top-k[data-name='attention 3 h1']").startswith(
            "attention 3 h1: #4 0.5000, #3 0.5000"
        )
        page.select_option(
            "select.ph-series", label="attention 3 h1: attention of the pointed token"
        )
        for pointed in (1, 2):
            spans.nth(pointed).hover()
            weights = {p - (N_PROMPT - 1): w for p, w in ATTENDED[pointed]}
            for q in range(len(TOKENS) + 1):
                got = spans.nth(q).evaluate("e => getComputedStyle(e).backgroundColor")
                want = shade(weights[q]) if q in weights else "rgba(0, 0, 0, 0)"
                assert got == want, (pointed, q)
        assert errors == []


def test_the_live_page_asks_for_the_api_key_and_sends_it() -> None:
    """``probehook serve --ui --api-key K``: the page is served unguarded, its /v1 requests
    are refused without the key (review D13: the page hung with no word). It says so, takes
    the key, and sends it with every request after."""
    from browser import chromium

    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        seen = _serve(page, compact=False, key=KEY)
        page.goto(f"{ORIGIN}/probehook/ui")
        page.wait_for_function(
            "document.getElementById('ph-status').textContent.includes('API key')"
        )
        assert page.is_visible("#ph-key")
        page.fill("#ph-key", "wrong")
        page.dispatch_event("#ph-key", "change")
        page.wait_for_function(
            "document.getElementById('ph-status').textContent.includes('refused this API key')"
        )
        page.fill("#ph-key", KEY)
        page.dispatch_event("#ph-key", "change")
        spans = _send(page)
        assert spans.all_inner_texts()[1:] == TOKENS
        chat = [h for h in seen if h.get("content-type") == "application/json"]
        assert chat and all(h.get("authorization") == f"Bearer {KEY}" for h in chat)
        assert errors == []


def test_the_live_page_knows_steering_s_own_keys() -> None:
    """live.js tells steering's own keys of a completion's ``steering`` from write-table
    entries by a list of its own: it must be the front end's (an ``ops`` key read as an
    entry would be marked as one)."""
    import json
    import re
    from pathlib import Path

    from probehook.outputs.intervention import STEERING_KEYS

    script = (Path(__file__).parents[1] / "probehook/viewer/static/live.js").read_text()
    listed = re.search(r"var STEERING_KEYS = (\[[^\]]*\]);", script)
    assert listed is not None and tuple(json.loads(listed.group(1))) == STEERING_KEYS
