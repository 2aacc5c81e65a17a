"""Capture prefill and decode residual streams, with per-request options and n > 1.

python examples/capture_hidden_states.py [MODEL_DIR] [-v]
"""

from __future__ import annotations

import os
import sys

from probehook.logs import quiet_vllm

# vLLM's warnings and loading bars stay out of the result unless run with -v.
QUIET = quiet_vllm()


def main(model: str | os.PathLike[str]) -> None:
    from probehook import LLM

    llm = LLM(model, layers=[0, -1], include_prefill=True, max_model_len=64, **QUIET)
    with llm:  # shuts the engine's processes down cleanly at the end
        run(llm)


def run(llm) -> None:  # noqa: ANN001 - probehook.LLM
    from probehook import SamplingParams

    last = llm.capture_config.layers[-1]

    everything = SamplingParams(max_tokens=6, temperature=0)
    # This request only wants the last layer's final decode row.
    narrow = SamplingParams(
        max_tokens=6,
        temperature=0,
        extra_args={
            "probehook": {"layers": [last], "include_prefill": False, "last_decode_token": True}
        },
    )
    two_samples = SamplingParams(max_tokens=6, temperature=1.0, n=2)
    outs = llm.generate(
        ["12+34=", "7+8=", "40+2="], [everything, narrow, two_samples], use_tqdm=False
    )

    for out in outs:
        print(f"\n{out.prompt!r}")
        for layer, rows in out.prefill_hidden_states.items():
            print(f"  prefill layer {layer}: {tuple(rows.shape)}")
        for completion in out.outputs:
            shapes = {layer: tuple(rows.shape) for layer, rows in completion.hidden_states.items()}
            print(f"  completion {completion.index} {completion.text!r}: {shapes}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "-v"]
    if args:
        main(args[0])
    else:
        from probehook import tiny_model_path

        main(tiny_model_path())
