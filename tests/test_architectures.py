"""Every architecture probehook claims, on a real engine, against HF on every layer.

One tiny random-weight checkpoint per architecture (hidden 128, 2 heads of 64, 2 layers); one
eager engine each with ``layers="all", include_prefill=True``, 2 prompts, 4 greedy tokens; every
layer's prefill and decode rows compared with HF ``hidden_states[L + 1]`` on the same fp32
weights. Plus the Transformers backend (``model_impl="transformers"``) on a dense and an MoE
model, and one compiled Transformers-backend engine.

Speed: 18 engine starts at the usual cost (about 22 s each here: a process spawn, a vLLM
import and the engine core's start per engine) would add about 6-7 minutes to the suite. So
all engines run one after another in ONE subprocess with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(the engine core inside that process): about 2-4 s per eager start there (the KV cache size
makes no measurable difference), 25-40 s for the compiled one, about 100-160 s for the whole
file on 2 cores. The subprocess only generates and saves rows; HF runs here, because vLLM's
Transformers backend decorates HF's model classes in the process that loads them, which
breaks plain HF models in that same process. The subprocess starts at the session's first test
and runs beside the rest of the suite (tests/conftest.py, ``background``); the tests that
check its rows run after the rest.

Run as a script, this file is that subprocess: ``python test_architectures.py SPEC OUT``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_layout import IN_PROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["1+2=", "12+34=56. 7+"]
MAX_TOKENS = 4
# (case id, checkpoint arch, extra engine kwargs). MoE cases come first: with several engines
# in one process vLLM creates its expert-parallel group only when the process's first engine
# is an MoE model ("expert parallel group is not initialized" otherwise).
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("mixtral", "mixtral", {}),
    ("qwen3_moe", "qwen3_moe", {}),
    ("mixtral-transformers", "mixtral", {"model_impl": "transformers"}),
    ("llama", "llama", {}),
    ("mistral", "mistral", {}),
    ("qwen2", "qwen2", {}),
    ("qwen3", "qwen3", {}),
    ("gpt2", "gpt2", {}),
    ("opt", "opt", {}),
    ("gemma", "gemma", {}),
    ("gemma2", "gemma2", {}),
    ("gemma3", "gemma3", {}),
    ("phi3", "phi3", {}),
    ("granite", "granite", {}),
    ("olmo2", "olmo2", {}),  # Transformers backend in vLLM 0.32
    ("gpt_neox", "gpt_neox", {}),  # Transformers backend in vLLM 0.32
    ("llama-transformers", "llama", {"model_impl": "transformers"}),
    # compiled (vLLM's default): the batch-dim flatten must trace into the graph
    ("gpt_neox-compiled", "gpt_neox", {"enforce_eager": False}),
]
# Attention per head (issue 51) of the families whose kernel terms differ, each on a checkpoint
# of its own: (case id, checkpoint arch, config overrides). The windows are shorter than the
# prompts, so keys before them are read as invisible; the soft-cap is small enough to bend the
# random model's logits.
ATTENTION_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen2-attention", "qwen2", {}),  # grouped-query heads: 2 query heads on 1 KV head
    ("mistral-attention", "mistral", {"sliding_window": 4}),  # a window on every layer
    # a logit soft-cap, a window on alternate layers
    ("gemma2-attention", "gemma2", {"sliding_window": 4, "attn_logit_softcapping": 1.0}),
    ("gemma3-attention", "gemma3", {"sliding_window": 4}),  # QK norm, windows by pattern, GQA
]
ATTENTION_SPAN = (0, 3)
GQA = {"mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma3", "olmo2"}
ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    max_num_seqs=4,
    gpu_memory_utilization=0.1,
    seed=0,
    enforce_eager=True,
)


# --- the subprocess --------------------------------------------------------------------------


def _run_engines(spec_path: str, out_dir: str) -> None:
    """Start each case's engine in turn, generate, save its rows (or its error) and timings."""
    import torch

    from probehook import LLM, SamplingParams

    out = Path(out_dir)
    timings: dict[str, dict[str, float]] = {}
    for case in json.loads(Path(spec_path).read_text()):
        started = time.perf_counter()
        llm = None
        try:
            attention = case.get("attention", False)
            reads = {"attention_layers": "all", "attention_top_k": 4} if attention else {}
            llm = LLM(
                case["dir"],
                layers="all",
                include_prefill=True,
                **{**ENGINE_KWARGS, **case["kwargs"], **reads},
            )
            ready = time.perf_counter()
            options = {"attention_spans": {"s": list(ATTENTION_SPAN)}} if attention else {}
            outs = llm.generate(
                PROMPTS,
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                               extra_args={"probehook": options}),
            )  # fmt: skip
            rows = [
                dict(
                    prompt_token_ids=list(o.prompt_token_ids),
                    token_ids=list(o.outputs[0].token_ids),
                    prefill=dict(o.prefill_hidden_states),
                    decode=dict(o.outputs[0].hidden_states),
                    prefill_attention={k: dict(v.columns) for k, v in o.prefill_attention.items()},
                    attention={k: dict(v.columns) for k, v in o.outputs[0].attention.items()},
                )
                for o in outs
            ]
            torch.save(rows, out / f"{case['id']}.pt")
            timings[case["id"]] = {"start_s": ready - started}
        except Exception as error:  # noqa: BLE001 - recorded; the case's test fails with it
            (out / f"{case['id']}.error").write_text(f"{type(error).__name__}: {error}")
        finally:
            if llm is not None:
                llm.shutdown()
            timings.setdefault(case["id"], {})["total_s"] = time.perf_counter() - started
            (out / "timings.json").write_text(json.dumps(timings, indent=1))


if __name__ == "__main__":
    from engine_layout import inspect_models_in_process

    inspect_models_in_process()  # 15 model classes: no inspecting process each
    _run_engines(sys.argv[1], sys.argv[2])
    sys.exit(0)


# --- the tests -------------------------------------------------------------------------------


def start_in_background(
    pool: ThreadPoolExecutor, items: list[pytest.Item], tmp_path_factory: pytest.TempPathFactory
) -> Future[SimpleNamespace] | None:
    """Build the selected cases' checkpoints (here: seeding torch in a thread would change the
    random state of the test running meanwhile), then submit their engine subprocess to
    ``pool``. tests/conftest.py calls this at the session's start; None: no case selected."""
    from helpers import build_random_checkpoint

    # Only the engines of the cases this session runs (``-k gemma`` starts one engine).
    selected = {
        item.callspec.params["case"]
        for item in items
        if item.module is sys.modules[__name__]
        and getattr(item, "originalname", None) in ("test_matches_hf", "test_attention_matches_hf")
    }
    if not selected:
        return None
    base = tmp_path_factory.mktemp("archs")
    dirs: dict[str, Path] = {}
    for seed, arch in enumerate(sorted({arch for _, arch, _ in CASES})):
        dirs[arch] = build_random_checkpoint(
            base / arch,
            arch=arch,
            num_layers=2,
            # grouped-query attention where the architecture has it
            num_kv_heads=1 if arch in GQA else None,
            seed=10 + seed,
            spread_norms=True,
        )
    spec = [
        {"id": i, "dir": str(dirs[arch]), "kwargs": kw} for i, arch, kw in CASES if i in selected
    ]
    for seed, (case, arch, overrides) in enumerate(ATTENTION_CASES):
        if case in selected:
            dirs[case] = build_random_checkpoint(
                base / case, arch=arch, num_layers=2, num_kv_heads=1 if arch in GQA else None,
                seed=40 + seed, spread_norms=True, overrides=overrides,
            )  # fmt: skip
            spec.append({"id": case, "dir": str(dirs[case]), "kwargs": {}, "attention": True})
    (base / "spec.json").write_text(json.dumps(spec))
    out = base / "rows"
    out.mkdir()
    return pool.submit(_run_subprocess, base / "spec.json", out, dirs)


def _run_subprocess(spec: Path, out: Path, dirs: dict[str, Path]) -> SimpleNamespace:
    env = {**os.environ, **IN_PROCESS_ENV}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, str(spec), str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
    )
    wall = time.perf_counter() - started
    timings_file = out / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.exists() else {}
    starts = ", ".join(f"{k} {v.get('start_s', 0):.1f}" for k, v in timings.items())
    return SimpleNamespace(
        dirs=dirs,
        out=out,
        log=proc.stdout[-3000:] + proc.stderr[-3000:],
        rc=proc.returncode,
        summary=f"architecture engines: {wall:.0f} s in one subprocess; starts (s): {starts}",
    )


@pytest.fixture(scope="module")
def engine_runs(background: dict[str, Any]) -> SimpleNamespace:
    """The engine subprocess tests/conftest.py started (:func:`start_in_background`)."""
    runs = background[__name__].result()
    print(f"\n{runs.summary}")
    return runs


@pytest.mark.engine
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_hf(case: str, engine_runs: SimpleNamespace) -> None:
    import torch

    from probehook.testing import assert_matches_hf

    arch = next(a for i, a, _ in CASES if i == case)
    error = engine_runs.out / f"{case}.error"
    assert not error.exists(), error.read_text()
    rows_file = engine_runs.out / f"{case}.pt"
    assert rows_file.exists(), f"engine subprocess died (rc {engine_runs.rc}):\n{engine_runs.log}"
    model_dir = engine_runs.dirs[arch]
    worst = 0.0
    for saved in torch.load(rows_file):
        output = SimpleNamespace(
            prompt_token_ids=saved["prompt_token_ids"],
            prefill_hidden_states=saved["prefill"],
            outputs=[SimpleNamespace(token_ids=saved["token_ids"], hidden_states=saved["decode"])],
        )
        assert len(saved["token_ids"]) == MAX_TOKENS
        worst = max(worst, assert_matches_hf(model_dir, output, [0, 1]))
    print(f"{case}: max abs diff vs HF {worst:.2e}")


@pytest.mark.engine
@pytest.mark.parametrize("case", [c[0] for c in ATTENTION_CASES])
def test_attention_matches_hf(case: str, engine_runs: SimpleNamespace) -> None:
    """Every prompt and generated row's attention per head, every layer (top 4 keys, their
    probabilities, the entropy, a span's mass), equal to Hugging Face's eager
    ``output_attentions`` of the family: grouped-query heads, sliding windows shorter than the
    prompt (keys before the window have probability 0 in HF, and are never read), a logit
    soft-cap, QK norms."""
    import torch
    from test_attention_rows import assert_readings_match, readings_of
    from transformers import AutoModelForCausalLM

    error = engine_runs.out / f"{case}.error"
    assert not error.exists(), error.read_text()
    rows_file = engine_runs.out / f"{case}.pt"
    assert rows_file.exists(), f"engine subprocess died (rc {engine_runs.rc}):\n{engine_runs.log}"
    overrides = next(o for i, _, o in ATTENTION_CASES if i == case)
    hf = AutoModelForCausalLM.from_pretrained(engine_runs.dirs[case], dtype=torch.float32,
                                              attn_implementation="eager")  # fmt: skip
    windowed = 0
    for saved in torch.load(rows_file):
        ids = [*saved["prompt_token_ids"], *saved["token_ids"][:-1]]
        n = len(saved["prompt_token_ids"])
        with torch.no_grad():
            want = hf(torch.tensor([ids]), output_attentions=True).attentions
        assert sorted(saved["attention"]) == sorted(saved["prefill_attention"]) == [0, 1]
        for layer in (0, 1):
            probs = want[layer][0].transpose(0, 1)  # [rows, heads, keys]
            if "sliding_window" in overrides and (probs[-1, :, 0] == 0).all():
                windowed += 1  # the window hides the first key from the last row
            for got, expected in ((saved["prefill_attention"][layer], probs[:n]),
                                  (saved["attention"][layer], probs[n - 1 :])):  # fmt: skip
                assert_readings_match(readings_of(got), expected, [ATTENTION_SPAN])
    assert windowed or "sliding_window" not in overrides  # the case exercises its window


# --- the one list: code and docs agree -------------------------------------------------------


def _docs_table() -> dict[str, str]:
    """docs/capture.md's architecture table: architecture -> the test named in its row."""
    text = (ROOT / "docs" / "capture.md").read_text()
    section = text.split("## Architectures", 1)[1].split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            tests = re.findall(r"`([^`]+)`", cells[-1])
            table[cells[0].strip("`")] = tests[0] if tests else ""
    return table


def test_docs_table_is_the_tested_list() -> None:
    from probehook.adapter.worker.surgery import TESTED_ARCHITECTURES

    assert _docs_table() == {arch: test for arch, (_, test) in TESTED_ARCHITECTURES.items()}


def test_every_listed_test_exists() -> None:
    from probehook.adapter.worker.surgery import TESTED_ARCHITECTURES

    ids = {c[0] for c in CASES}
    for arch, (_, test) in TESTED_ARCHITECTURES.items():
        path, _, rest = test.partition("::")
        assert (ROOT / path).exists(), (arch, test)
        if rest:
            name, _, param = rest.partition("[")
            assert f"def {name}(" in (ROOT / path).read_text(), (arch, test)
            if param:
                assert param.rstrip("]") in ids, (arch, test)


def _model_config(
    architectures: list[str], backend_cls: str | None = None, model_cls: type | None = None
) -> SimpleNamespace:
    def resolve_model_cls(archs: list[str], model_config: object) -> tuple[type, str]:
        if model_cls is None:
            raise ValueError(f"Model architectures {archs} are not supported for now.")
        return model_cls, archs[0]

    return SimpleNamespace(
        architectures=architectures,
        using_transformers_backend=lambda: backend_cls is not None,
        _get_transformers_backend_cls=lambda: backend_cls,
        registry=SimpleNamespace(resolve_model_cls=resolve_model_cls),
    )


def test_refusal_names_the_list_and_the_declaration() -> None:
    from probehook.adapter.frontend.engine_config import check_architecture
    from probehook.adapter.worker.surgery import LAYER_PATH_ATTRIBUTE, TESTED_ARCHITECTURES
    from probehook.errors import UnsupportedModelError

    class MambaForCausalLM:  # a model class that declares nothing
        pass

    for model_cls in (None, MambaForCausalLM):
        with pytest.raises(UnsupportedModelError) as err:
            check_architecture(_model_config(["MambaForCausalLM"], model_cls=model_cls))
        message = str(err.value)
        assert "MambaForCausalLM" in message
        for arch in TESTED_ARCHITECTURES:
            assert arch in message
        assert f'{LAYER_PATH_ATTRIBUTE} = "path.to.layers"' in message
    check_architecture(_model_config(["Gemma3ForCausalLM"]))
    # anything vLLM runs through its Transformers backend as a causal LM is accepted ...
    check_architecture(_model_config(["Olmo3ForCausalLM"], "TransformersForCausalLM"))
    check_architecture(_model_config(["FlexOlmoForCausalLM"], "TransformersMoEForCausalLM"))
    # ... but not its untested multimodal or pooling classes
    with pytest.raises(UnsupportedModelError, match="TransformersEmbeddingModel"):
        check_architecture(_model_config(["BertModel"], "TransformersEmbeddingModel"))
    with pytest.raises(UnsupportedModelError, match="TransformersMultiModalForCausalLM"):
        check_architecture(
            _model_config(["Emu3ForConditionalGeneration"], "TransformersMultiModalForCausalLM")
        )


def test_a_model_class_declares_its_layer_path() -> None:
    """An untested architecture whose class says where its layers are is accepted at
    construction, and the loader taps the declared list (before any known path)."""
    from torch import nn

    from probehook.adapter.frontend.engine_config import check_architecture
    from probehook.adapter.worker.surgery import locate_layers
    from probehook.errors import UnsupportedModelError

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    class MyModel(nn.Module):
        probehook_layer_path = "backbone.blocks"

        def __init__(self) -> None:
            super().__init__()
            self.backbone = Backbone()
            self.model = SimpleNamespace(layers=nn.ModuleList([nn.Linear(4, 4)]))  # a decoy

    check_architecture(_model_config(["MyModel"], model_cls=MyModel))
    model = MyModel()
    path, layers = locate_layers(model)
    assert path == "backbone.blocks" and layers is model.backbone.blocks

    class Wrong(MyModel):
        probehook_layer_path = "backbone.missing"

    with pytest.raises(UnsupportedModelError, match="'backbone.missing', but that is not"):
        locate_layers(Wrong())

    class Undeclared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(4, 4)])

    assert locate_layers(Undeclared())[0] == "model.layers"  # the tested paths' fallback


def test_untested_backend_class_refused_before_start_up(engine_defaults: dict) -> None:
    """A real config: BERT through the Transformers backend resolves to its embedding class."""
    from probehook import LLM
    from probehook.errors import UnsupportedModelError
    from probehook.testing import minilm_path

    started = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="class TransformersEmbeddingModel"):
        LLM(str(minilm_path()), layers=[0], model_impl="transformers", **engine_defaults)
    assert time.perf_counter() - started < 60  # config resolution only, no engine
