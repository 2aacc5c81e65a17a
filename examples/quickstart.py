"""The README's first example, as a script: capture, store, read back.

python examples/quickstart.py [-v]

No memory setting is needed: on CPU, probehook sizes vLLM's KV cache from the model when you
set neither ``gpu_memory_utilization`` nor ``VLLM_CPU_KVCACHE_SPACE`` (vLLM's own default would
reserve 92% of all memory and fail on a machine that is doing something else).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from probehook.logs import quiet_vllm

# vLLM's warnings and loading bars stay out of the result unless run with -v.
QUIET = quiet_vllm()


def main() -> None:
    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.store import ActivationStore

    store = Path(tempfile.mkdtemp(prefix="probehook-quickstart-")) / "exp1"
    path = tiny_model_path()
    llm = LLM(model=path, layers=[1, 3], include_prefill=True, store=store, **QUIET)
    with llm:
        out = llm.generate(["12+34="], SamplingParams(max_tokens=4, temperature=0))[0]
    print(f"text {out.outputs[0].text!r}")
    for layer in (1, 3):
        print(
            f"layer {layer}: prefill rows {tuple(out.prefill_hidden_states[layer].shape)}, "
            f"decode rows {tuple(out.hidden_states[layer].shape)}"
        )
    stored = ActivationStore.open(store)[out.store_id]
    print(f"stored {out.store_id}: layer 3 rows {tuple(stored.hidden_states[3].shape)}")


if __name__ == "__main__":
    main()
