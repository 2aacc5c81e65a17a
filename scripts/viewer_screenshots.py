"""Redraw the viewer's screenshots in docs/images/ on the bundled tiny model, in Debian's
Chromium (the browser the tests use): the notebook view of a statement (tokens coloured by the
logit lens's target log-prob at the last layer, the panel of a token, the lens's layer x token
grid), a steered and clamped request's marks, and the live page beside ``probehook serve
--ui`` with a streamed reply and a flag monitor. About two minutes on a 2-core CPU::

    .venv/bin/python scripts/viewer_screenshots.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
sys.path.insert(0, str(ROOT / "tests"))  # the tests' browser launcher

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LABELS = {"l3": {}}  # filled with the statement's strongest feature


def offline_views(work: Path) -> list[tuple[str, Path, str]]:
    """The notebook view and the steered one, saved as pages: (image name, page, token to
    point at)."""
    from probehook import (
        LLM,
        SAE,
        SamplingParams,
        SteeringVector,
        tiny_model_path,
        tiny_sae_path,
        view,
    )

    sae = SAE.load(tiny_sae_path())
    llm = LLM(str(tiny_model_path()), saes={"l3": sae}, sae_top_k=5, sae_clamping=True,
              lenses={"logit": "logit"}, lens_layers=[0, 1, 2, 3], lens_top_k=3,
              include_prefill=True, steering={"away": SteeringVector.from_sae(sae, {0: 4.0})},
              enforce_eager=True, max_model_len=64, use_tqdm_on_load=False)  # fmt: skip
    try:
        tokenizer = llm.get_tokenizer()
        statement = "23+45=71."  # false: the model answers "!"
        plain = llm.generate([statement], SamplingParams(max_tokens=3, temperature=0),
                             use_tqdm=False)[0]  # fmt: skip
        strongest = int(plain.prefill_sae_features["l3"].indices[-1, 0])
        LABELS["l3"][strongest] = "strongest at the final '.'"
        steer = {"steer": {"away": 1.0}, "steer_phase": "decode",
                 "clamp": {"l3": {str(strongest): 0.0}}}  # fmt: skip
        steered = llm.generate(
            ["12+34="],
            SamplingParams(max_tokens=6, temperature=0, extra_args={"probehook": steer}),
            use_tqdm=False,
        )[0]
    finally:
        llm.shutdown()
    shown = view(plain, tokenizer, labels=LABELS)
    pages = [("viewer.png", shown.save(work / "plain.html"), str(len(plain.prompt_token_ids) - 1))]
    marked = view(steered, tokenizer)
    n = len(steered.prompt_token_ids)
    pages.append(("viewer-steered.png", marked.save(work / "steered.html"), str(n + 1)))
    return pages


def shoot(browser: object, url: str, hover: str, image: str, select: str | None = None) -> None:
    from browser import open_page

    page, errors, off = open_page(browser, url, url.split("/probehook")[0] if "://127" in url
                                  else url)  # fmt: skip
    if select:
        page.select_option("select.ph-series", label=select)
    page.hover(f".ph-token[data-i='{hover}']")
    page.screenshot(path=str(IMAGES / image), full_page=True)
    assert not errors and not off, (errors, off)
    print("wrote", IMAGES / image)


def live(browser: object, work: Path) -> None:
    from browser import open_page

    from probehook import tiny_model_path, tiny_sae_path
    from probehook.testing import ServerProcess

    argv = [str(tiny_model_path()), "--lens", "logit=logit", "--lens-layers", "0,1,2,3",
            "--lens-top-k", "3", "--sae", f"l3={tiny_sae_path()}", "--sae-top-k", "5",
            "--ui", "--enforce-eager", "--max-model-len", "64",
            "--chat-template", str(work / "chat.jinja")]  # fmt: skip
    (work / "chat.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    server = ServerProcess(argv, log=work / "server.log").wait()
    try:
        root = server.base_url.removesuffix("/v1")
        page, errors, off = open_page(browser, f"{root}/probehook/ui", root)
        page.wait_for_selector(".ph-live[data-ph-ready='1']")
        page.fill("#ph-message", "12+34=")
        page.fill("#ph-max", "8")
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(str(tiny_model_path())).eos_token_id
        flag = {"lens": "logit", "layer": 3, "token": eos, "threshold": -1.0}
        page.fill("#ph-extra", json.dumps({"monitors": [flag]}))
        page.fill("#ph-labels", json.dumps(LABELS))
        page.click("#ph-send")
        page.wait_for_selector(".ph-live[data-ph-done='1']", timeout=60_000)
        page.select_option("select.ph-series", label="lens logit@3 target")
        page.hover(".ph-token[data-i='3']")
        page.screenshot(path=str(IMAGES / "viewer-live.png"), full_page=True)
        assert not errors and not off, (errors, off)
        print("wrote", IMAGES / "viewer-live.png")
    finally:
        server.stop()


def main() -> None:
    from browser import chromium

    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pages = offline_views(work)
        with chromium() as browser:
            for image, path, hover in pages:
                shoot(browser, path.as_uri(), hover, image, "lens logit@3 target")
            live(browser, work)


if __name__ == "__main__":
    main()
