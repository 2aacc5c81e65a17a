"""`make demo`: generate with the bundled tiny model and capture its residual stream.

Runs offline with no arguments: the model ships inside the package.
"""

from __future__ import annotations

import os
import tempfile

# vLLM's CPU backend sizes its KV cache from this (GiB); its default claims most of RAM.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM logs pages of INFO/WARNING lines around a short result; keep its errors only.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

PROMPTS = ["12+34=", "7+8=", "56+78=", "99+1="]


def main() -> None:
    from probehook import LLM, SamplingParams, tiny_model_path

    model = tiny_model_path()
    print(f"Loading the bundled tiny model from {model}")
    store_dir = os.path.join(tempfile.mkdtemp(prefix="probehook-demo-"), "store")
    with LLM(model, layers="all", include_prefill=True, max_model_len=64, store=store_dir) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print()
    for out in outputs:
        print(f"{out.prompt!r:>10} -> {out.outputs[0].text!r}")
        for layer in sorted(out.hidden_states):
            print(
                f"{'':12} layer {layer}: prefill {tuple(out.prefill_hidden_states[layer].shape)}"
                f"  decode {tuple(out.hidden_states[layer].shape)}"
                f"  |last row| = {out.hidden_states[layer][-1].norm():.2f}"
            )
    from probehook.store import ActivationStore

    info = ActivationStore.open(store_dir).info()
    print(f"\nCaptures written to the store at {store_dir}")
    print(
        f"  {info['requests']} requests, {info['rows']} rows, {info['bytes']} bytes "
        f"in {info['shards']} shard(s); reopen with ActivationStore.open(path)"
    )


if __name__ == "__main__":
    main()
