"""Train the SAE that ships in ``probehook/assets/tiny-arith-sae-l3``: a TopK SAE (512
features, k = 8) on layer 3 of the bundled tiny model, with SAELens's own trainer, on a
probehook export.

1. A capture-only probehook engine reads true and false statements about the training pairs
   (``"a+b=c."``; the held-out pairs are left out) into an activation store, layer 3, every
   prompt token.
2. ``export_saelens`` writes SAELens's cached-activations folder from the store.
3. SAELens's ``ActivationsStore`` feeds its ``SAETrainer``; the trained SAE is saved with its
   own ``save_inference_model`` (``cfg.json`` + ``sae_weights.safetensors``: what
   ``probehook.SAE.load`` reads) with the hook name ``blocks.3.hook_resid_post``.
4. A report (``training_report.json``): the data, the settings, the fraction of variance the
   SAE explains and its mean l0 on held-out statements.

Reproducible (seeded), a few minutes on 2 CPU cores::

    .venv/bin/python scripts/train_tiny_sae.py
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYER = 3
D_SAE = 512
K = 8
CONTEXT = 8
OUT = Path(__file__).resolve().parent.parent / "probehook" / "assets" / "tiny-arith-sae-l3"


def statements(pairs: list[tuple[int, int]], seed: int) -> list[str]:
    from probehook.tasks.arithmetic import make_statement

    rng = random.Random(seed)
    out = []
    for a, b in pairs:
        out += [make_statement(a, b, True), make_statement(a, b, False, rng)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--evaluate", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.evaluate is not None:
        evaluate(args.evaluate, args.out)
        return
    torch.manual_seed(0)
    started = time.time()

    from sae_lens import ActivationsStore, SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.sae import SAEMetadata

    from probehook import LLM, tiny_model_path
    from probehook.logs import quiet_vllm
    from probehook.store import ActivationStore
    from probehook.store.export import export_saelens
    from probehook.tasks.arithmetic import split_pairs

    train_pairs, heldout = split_pairs(seed=0)
    work = Path(tempfile.mkdtemp(prefix="probehook-sae-"))
    texts = statements(train_pairs, seed=1)
    llm = LLM(
        tiny_model_path(), layers=[LAYER], capture_only=True, store=work / "store", **quiet_vllm()
    )
    with llm:
        llm.capture(texts)  # durable when it returns
        store = ActivationStore.open(work / "store")  # the training statements only
        export = export_saelens(store, work / "export", layer=LAYER, context_size=CONTEXT)
        tokens = sum(len(r.prompt_token_ids) for r in store.requests)
        held = llm.capture(statements(heldout, seed=2))  # rows returned, never trained on
    hook = f"blocks.{LAYER}.hook_resid_post"
    total = args.epochs * (tokens // CONTEXT) * CONTEXT
    data = ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=hook,
        hook_head_index=None,
        context_size=CONTEXT,
        d_in=store.hidden_size,
        n_batches_in_buffer=128,  # SAELens mixes n_batches x context_size rows
        total_training_tokens=total,
        store_batch_size_prompts=32,
        train_batch_size_tokens=512,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(export),
    )
    config = TopKTrainingSAEConfig(
        d_in=store.hidden_size, d_sae=D_SAE, k=K, metadata=SAEMetadata(hook_name=hook)
    )
    trainer = SAETrainer(
        cfg=SAETrainerConfig(
            total_training_samples=total,
            train_batch_size_samples=512,
            lr=1e-3,
            lr_end=1e-4,
            lr_warm_up_steps=20,
            n_batches_for_norm_estimate=4,
        ),
        sae=TopKTrainingSAE(config),
        data_provider=data,
    )
    trained = trainer.fit()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    trained.save_inference_model(args.out)

    # Held-out statements: what the SAE reads there, in a fresh process (torch ops in a
    # process that ran a vLLM CPU engine inherit its thread pinning and crawl).
    from safetensors.torch import save_file

    rows = torch.cat([o.prefill_hidden_states[LAYER] for o in held])
    save_file({"rows": rows.contiguous()}, str(work / "heldout.safetensors"))
    facts = {
        "model": "tiny-arith",
        "layer": LAYER,
        "hook_name": hook,
        "architecture": "topk",
        "d_sae": D_SAE,
        "k": K,
        "training_statements": len(texts),
        "training_tokens_per_epoch": tokens,
        "epochs": args.epochs,
        "context_size": CONTEXT,
        "heldout_statements": len(held),
        "training_seconds": round(time.time() - started, 1),
    }
    (work / "facts.json").write_text(json.dumps(facts))
    subprocess.run([sys.executable, __file__, "--evaluate", str(work), "--out", str(args.out)],
                   check=True)  # fmt: skip
    shutil.rmtree(work)


def evaluate(work: Path, out: Path) -> None:
    """What the saved SAE reads on the held-out rows (probehook's own reader and encode):
    the fraction of variance its reconstruction explains and its mean l0."""
    from safetensors.torch import load_file

    from probehook import SAE

    sae = SAE.load(out)
    rows = load_file(str(work / "heldout.safetensors"))["rows"]
    features = sae.top_k(rows, K)
    reconstruction = features.dense(sae.d_sae) @ sae.W_dec + sae.weights.b_dec
    explained = 1 - ((rows - reconstruction).var(0).sum() / rows.var(0).sum()).item()
    report = {
        **json.loads((work / "facts.json").read_text()),
        "heldout_tokens": int(rows.shape[0]),
        "heldout_explained_variance": round(explained, 4),
        "heldout_mean_l0": round(float(features.l0.float().mean()), 3),
        "features_on_heldout": int(features.indices[features.indices >= 0].unique().numel()),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
