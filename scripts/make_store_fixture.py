"""Write the small store ``tests/data/store-2026-11-29`` (and its ``expected.safetensors``)
with the store format of 2026-11-29, before the readout table's port: hidden rows, probe
scores, SAE features, a lens and the test-only toy readout, prompt and decode rows, two runs.
``tests/test_store_fixture.py`` reads it back bit-equal to what this script read right after
writing it: stores written before a change of the store code must read unchanged.

Run once, from the repository root, when a new fixture is wanted (never in the suite):
``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python scripts/make_store_fixture.py`` (the
engine in this process, where the toy readout is registered).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "store-2026-11-29"
PROMPTS = ["12+34=", "7+8=15. 3+"]


def expected_tensors(store: object) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every value the store holds of each request, keyed ``<store id>/<what>``."""
    out: dict[str, torch.Tensor] = {}
    ids = []
    for request in store.requests:  # type: ignore[attr-defined]
        sid = request.store_id
        ids.append(sid)
        for phase, rows in (("prefill", request.prefill_hidden_states),
                            ("decode", request.hidden_states)):  # fmt: skip
            for layer, tensor in rows.items():
                out[f"{sid}/hidden/{phase}/{layer}"] = tensor.contiguous()
        for phase, scores in (("prefill", request.prefill_probe_scores),
                              ("decode", request.probe_scores)):  # fmt: skip
            for name, tensor in scores.items():
                out[f"{sid}/scores/{phase}/{name}"] = tensor.contiguous()
        for source in ("sae", "lens", "norm"):
            for phase in ("prefill", "decode"):
                for name, rows in request.top_k(source, phase).items():
                    for column in ("indices", "values", "l0"):
                        key = f"{sid}/{source}/{phase}/{name}/{column}"
                        out[key] = getattr(rows, column).contiguous()
    return out, ids


def main() -> None:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise SystemExit("run with VLLM_ENABLE_V1_MULTIPROCESSING=0 (module docstring)")
    sys.path.insert(0, str(ROOT / "tests"))
    from toy_readout import RowNorm

    from probehook import LLM, SAE, LinearProbe, SamplingParams, tiny_model_path, tiny_sae_path
    from probehook.outputs import OUTPUT_PROCESSORS
    from probehook.store import ActivationStore

    list(OUTPUT_PROCESSORS)
    OUTPUT_PROCESSORS.register(RowNorm)
    if OUTPUT_PROCESSORS.names().count("row_norms") != 1:
        raise SystemExit("the toy readout did not register")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    store_path = OUT / "store"
    weight = torch.randn(1, 128, generator=torch.Generator().manual_seed(0)) / 128**0.5
    probe = LinearProbe(weight, torch.zeros(1), layer=1, kind="binary", name="p")
    for run in range(2):  # two runs: two run records, two shards at least
        llm = LLM(
            str(tiny_model_path()), layers=[1, 3], include_prefill=True, probes={"p": probe},
            saes={"s": SAE.load(tiny_sae_path())}, sae_top_k=4, lenses={"l": "logit"},
            lens_layers=[3], lens_top_k=3, norms={"n3": 3}, store=store_path,
            enforce_eager=True, max_model_len=64, dtype="float32", seed=run,
        )  # fmt: skip
        try:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            llm.shutdown()
    store = ActivationStore.open(store_path)
    tensors, ids = expected_tensors(store)
    save_file(tensors, str(OUT / "expected.safetensors"))
    (OUT / "expected.json").write_text(json.dumps({"store_ids": ids}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({size / 1024:.0f} KiB, {len(ids)} requests, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
