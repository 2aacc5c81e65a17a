"""The per-token viewer (``probehook.view``): its data from a real engine's output (tokens,
scores, top-k entries and marks where the rows' positions put them), the page's promises
(self-contained, small), and the page in a real browser: Debian's Chromium driven by
Playwright (tokens painted in order with their scores' colours, the panel of the token under
the pointer, the score selector, no request off the machine, no script error)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.engine

PROMPT = "12+34="
LABELS = {"s": {174: "a feature with a name"}}


@pytest.fixture(scope="module")
def engine_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model with a probe, an SAE (clamping on), a steering vector and the logit lens
    on two layers, prompt rows kept: one request with a lens flag monitor, one steered from
    its first generated token and clamped; and the tokenizer."""
    from probehook import (
        LLM,
        SAE,
        LinearProbe,
        SamplingParams,
        SteeringVector,
        tiny_model_path,
        tiny_sae_path,
    )

    weights = torch.randn(2, 1, 128, generator=torch.Generator().manual_seed(0)) / 128**0.5
    probes = {name: LinearProbe(weights[i], torch.zeros(1), layer=layer, kind="binary", name=name)
              for i, (name, layer) in enumerate((("p", 1), ("q", 3)))}  # fmt: skip
    push = SteeringVector({2: torch.randn(128, generator=torch.Generator().manual_seed(1))})
    llm = LLM(
        str(tiny_model_path()), probes=probes, saes={"s": SAE.load(tiny_sae_path())},
        sae_top_k=4, sae_clamping=True, lenses={"l": "logit"},
        steering={"push": push, "cap": push.with_op("cap", max=1.0)},
        lens_layers=[1, 3], include_prefill=True, enforce_eager=True, max_model_len=64,
        dtype="float32", seed=0, store=tmp_path_factory.mktemp("viewer") / "store",
    )  # fmt: skip
    try:
        watch = {"lens": "l", "layer": 3, "token": 10, "threshold": -1.0}  # "6"
        steer = {"steer": {"push": 2.0, "cap": 1.0}, "steer_phase": "decode",
                 "clamp": {"s": {"7": 0.0}}}  # fmt: skip
        params = [
            SamplingParams(max_tokens=5, temperature=0, extra_args={"probehook": options})
            for options in ({"monitors": [watch]}, steer)
        ]
        out, steered = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    out.store_root = llm.store.root
    return {"out": out, "steered": steered, "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def viewed(engine_outputs: dict[str, Any]) -> Any:
    from probehook import view

    out, tokenizer = engine_outputs["out"], engine_outputs["tokenizer"]
    return out, view(out, tokenizer, labels=LABELS), tokenizer


def test_data_puts_every_reading_at_its_position(viewed) -> None:
    """Prefill row p paints token p; decode row i paints position n_prompt - 1 + i (the
    token the row was computed on); the last generated token has no row."""
    out, shown, tokenizer = viewed
    data = shown.requests[0]
    completion = out.outputs[0]
    ids = list(out.prompt_token_ids) + list(completion.token_ids)
    n = len(out.prompt_token_ids)
    assert data["ids"] == ids and data["n_prompt"] == n
    assert data["tokens"] == [tokenizer.decode([t]) for t in ids]
    probe = next(s for s in data["series"] if s["name"] == "probe p")["values"]
    assert probe[:n] == pytest.approx(out.prefill_probe_scores["p"].tolist())
    assert probe[n - 1 : -1] == pytest.approx(completion.probe_scores["p"].tolist())
    assert probe[-1] is None
    target = next(s for s in data["series"] if s["name"] == "lens l@3 target")["values"]
    assert target[n:-1] == pytest.approx(completion.lens["l"][3].target_logprob[1:].tolist())
    lens = next(t for t in data["top_k"] if t["name"] == "lens l@3")
    reading = completion.lens["l"][3]
    assert [i for i, _ in lens["rows"][n]] == reading.token_ids[1].tolist()
    assert lens["texts"][str(reading.token_ids[1, 0].item())] == tokenizer.decode(
        [reading.token_ids[1, 0].item()]
    )
    sae = next(t for t in data["top_k"] if t["name"] == "sae s")
    features = completion.sae_features["s"]
    assert [i for i, _ in sae["rows"][n]] == features.indices[1][features.indices[1] >= 0].tolist()
    assert sae["labels"] == {"174": "a feature with a name"}
    flagged = completion.lens_flags["l@3:10"]
    assert data["marks"]["flags"] == {"lens l@3:10": [n - 1 + r for r in flagged]} and flagged
    grid = data["grids"][0]
    assert grid["layers"] == [1, 3] and grid["values"][1] == target
    probes = data["grids"][1]  # a probe grid: one row per probe
    assert probes["layers"] == ["p", "q"] and probes["values"][0] == probe


def test_steering_and_clamping_are_marked(engine_outputs, browser, tmp_path) -> None:
    """A steered and clamped request's view: the steered rows' tokens underlined (from the
    first steered position), the vectors with their ops (a cap here) and the held features in
    the marks line and in the panel of a steered token, none of it on an unsteered token; its
    stored record alike."""
    from probehook import ActivationStore, view

    steered = engine_outputs["steered"]
    shown = view(steered, engine_outputs["tokenizer"])
    marks = shown.requests[0]["marks"]
    n = len(steered.prompt_token_ids)
    assert marks["steered"] == {
        "from": n,
        "vectors": {"push": 2.0, "cap": 1.0},
        "ops": {"cap": "cap(max=1)"},
    }
    assert marks["writes"] == {"clamp": "clamped s #7=0 on every token"}  # the entry's words
    stored = ActivationStore.open(engine_outputs["out"].store_root)[steered.store_id]
    assert stored.steering["clamp"] == {"s": {"7": 0.0}}  # the store keeps what was held
    assert view(stored, engine_outputs["tokenizer"]).requests[0]["marks"] == marks
    page, errors, _ = _open(browser, shown.save(tmp_path / "steered.html"))
    classes = page.locator(".ph-token").evaluate_all("es => es.map(e => e.className)")
    assert ["ph-steered" in c for c in classes] == [p >= n for p in range(len(classes))]
    line = page.inner_text(".ph-marks")
    assert "steered by push x2, cap cap(max=1) x1 from position " + str(n) in line
    assert "clamped s #7=0 on every token" in line
    page.hover(f".ph-token[data-i='{n}']")
    panel = page.inner_text(".ph-panel")
    assert (
        "steered\tpush x2, cap cap(max=1) x1" in panel
        and "clamp\tclamped s #7=0 on every token" in panel
    )
    page.hover(f".ph-token[data-i='{n - 1}']")
    assert "steered" not in page.inner_text(".ph-panel")
    assert errors == []


def test_a_stored_request_views_alike_and_the_cli_writes_its_page(viewed, tmp_path) -> None:
    """The store keeps what the view shows of a request (its tokens, scores and top-k rows;
    flags are not stored); ``probehook view STORE --id ID -o page.html`` writes its page with
    the tokenizer of the model the store recorded."""
    from probehook import ActivationStore, view
    from probehook.cli import main

    out, shown, tokenizer = viewed
    stored = ActivationStore.open(out.store_root)[out.store_id]
    again = view(stored, tokenizer, labels=LABELS).requests[0]
    live = shown.requests[0]
    for key in ("tokens", "ids", "n_prompt", "series", "top_k", "grids"):
        assert again[key] == live[key], key
    page = tmp_path / "page.html"
    main(["view", str(out.store_root), "--id", out.store_id, "-o", str(page)])
    text = page.read_text()
    assert 'class="ph-token ph-output" data-i="7"' in text and ">46<" not in text
    with pytest.raises(SystemExit, match="No request with store id 'nope'"):
        main(["view", str(out.store_root), "--id", "nope", "-o", str(page)])


def test_the_page_is_self_contained_small_and_exports_to_circuitsvis(viewed, tmp_path) -> None:
    from probehook.viewer import View

    _, shown, _ = viewed
    page = shown.save(tmp_path / "run.html").read_text()
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert page.count("<script>") == 1  # the one inline script (besides the JSON data)
    exported = shown.colored_tokens("probe p")
    assert exported["tokens"] == shown.requests[0]["tokens"]
    assert len(exported["values"]) == len(exported["tokens"]) and exported["values"][-1] == 0.0
    with pytest.raises(ValueError, match="no series 'nope'"):
        shown.colored_tokens("nope")
    # 500 tokens with a probe, two lens layers and an SAE at k 8: a few hundred KB
    data = dict(shown.requests[0])
    data["tokens"] = ["tok"] * 500
    data["ids"] = list(range(500))
    data["series"] = [{**s, "values": [0.123456789] * 500} for s in data["series"]]
    data["top_k"] = [{**t, "rows": [[[12345, -1.23456789]] * 8] * 500} for t in data["top_k"]]
    data["grids"] = []
    assert len(View([data]).html().encode()) < 400_000


@pytest.fixture(scope="module")
def browser() -> Any:
    from browser import chromium

    with chromium() as launched:
        yield launched


def _open(browser: Any, path: Path) -> tuple[Any, list[str], list[str]]:
    from browser import open_page

    return open_page(browser, path.as_uri(), path.as_uri())


def _expected_colour(series: dict[str, Any], p: int) -> str | None:
    from probehook.viewer.page import level, series_scale, series_top, shade

    t = level(series["values"][p], series_scale(series), series_top(series))
    return None if t is None else shade(t)


def test_the_browser_paints_each_token_in_order_with_its_scores_colour(
    viewed, browser, tmp_path
) -> None:
    from PIL import Image

    _, shown, _ = viewed
    data = shown.requests[0]
    page, errors, off_machine = _open(browser, shown.save(tmp_path / "run.html"))
    spans = page.locator(".ph-token")
    assert spans.all_inner_texts() == data["tokens"]
    for name in ("probe p", "lens l@3 target"):  # the first series, then one picked
        index = next(i for i, s in enumerate(data["series"]) if s["name"] == name)
        page.select_option("select.ph-series", str(index))
        series = data["series"][index]
        for p in range(len(data["tokens"])):
            span = spans.nth(p)
            want = _expected_colour(series, p)
            got = span.evaluate("e => getComputedStyle(e).backgroundColor")
            assert got == (want or "rgba(0, 0, 0, 0)"), (name, p)
            if want is None:
                continue
            # the painted pixels: the span's most common colour is its background
            shot = tmp_path / f"{p}.png"
            span.screenshot(path=str(shot))
            colours = Image.open(shot).convert("RGB").getcolors(4096)
            painted = max(colours)[1]
            rgb = tuple(int(x) for x in want[4:-1].split(", "))
            assert all(abs(a - b) <= 2 for a, b in zip(painted, rgb, strict=True)), (name, p)
    assert errors == [] and off_machine == []


def test_the_panel_shows_the_token_under_the_pointer_and_nothing_stale(
    viewed, browser, tmp_path
) -> None:
    out, shown, tokenizer = viewed
    data = shown.requests[0]
    n = data["n_prompt"]
    page, errors, _ = _open(browser, shown.save(tmp_path / "run.html"))
    reading = out.outputs[0].lens["l"][3]
    features = out.outputs[0].sae_features["s"]
    page.hover(f".ph-token[data-i='{n}']")  # the first output token: decode row 1
    panel = page.inner_text(".ph-panel")
    assert f"position {n}, output" in panel
    lens_line = page.inner_text(".ph-top-k[data-name='lens l@3']")
    top = [tokenizer.decode([t]) for t in reading.token_ids[1].tolist()]
    assert lens_line.startswith("lens l@3: " + ", ".join(f'"{t}"' for t in [top[0]]))
    sae_line = page.inner_text(".ph-top-k[data-name='sae s']")
    first = int(features.indices[1, 0])
    assert sae_line.startswith(f"sae s: #{first}")
    if first == 174:
        assert "(a feature with a name)" in sae_line
    assert "flagged\tlens l@3:10" in panel or "lens l@3:10" in panel
    page.hover(".ph-token[data-i='1']")  # a prompt token: no decode row, no flag
    panel = page.inner_text(".ph-panel")
    assert "position 1, prompt" in panel and f"position {n}" not in panel
    assert "flagged" not in panel
    prompt_row = out.prefill_sae_features["s"].indices[1, 0].item()
    assert page.inner_text(".ph-top-k[data-name='sae s']").startswith(f"sae s: #{prompt_row}")
    assert errors == []


def test_notebook_html_renders_alike(viewed, browser, tmp_path) -> None:
    """``_repr_html_`` is the fragment a notebook shows: the same tokens and colours."""
    _, shown, _ = viewed
    path = tmp_path / "cell.html"
    path.write_text(f"<html><body>{shown._repr_html_()}</body></html>")
    page, errors, off_machine = _open(browser, path)
    data = shown.requests[0]
    assert page.locator(".ph-token").all_inner_texts() == data["tokens"]
    first = data["series"][0]
    got = page.locator(".ph-token").nth(0).evaluate("e => getComputedStyle(e).backgroundColor")
    assert got == _expected_colour(first, 0)
    assert errors == [] and off_machine == [] and not math.isnan(len(data["tokens"]))
