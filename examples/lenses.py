"""What the tiny model would say at every layer, read inside the engine: the logit lens and a
J-lens fitted here on the bundled tiny model, on the prompt's last token and on every
generated token, with the log-prob each layer gives the token that actually came next.

python examples/lenses.py [-v]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from probehook.logs import quiet_vllm

QUIET = quiet_vllm()  # vLLM's warnings and loading bars stay out unless run with -v


def main() -> None:
    from probehook import LLM, JacobianLens, SamplingParams, tiny_model_path

    model = tiny_model_path()
    # A J-lens of the tiny model: the average Jacobian of its last layer's output with respect
    # to each layer's, over a few arithmetic prompts (seconds on a CPU).
    prompts = [f"{a}+{b}={a + b}. {b}+{a}={a + b}. {a}+{a}={2 * a}." for a in range(10, 40, 7)
               for b in (3, 21)]  # fmt: skip
    j_path = Path(tempfile.mkdtemp(prefix="probehook-lenses-")) / "j_lens.pt"
    j = JacobianLens.fit(model, prompts, skip_first_positions=2, progress=False, path=j_path)
    print(f"fitted {j} on {j.n_prompts} prompts")
    layers = [0, 1, 2, 3]
    llm = LLM(
        model,
        lenses={"logit": "logit", "j": j},
        lens_layers=layers,
        lens_top_k=3,
        include_prefill=True,
        **QUIET,
    )
    with llm:
        out = llm.generate(["12+34="], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[
            0
        ]
        tokenizer = llm.get_tokenizer()
        text = out.outputs[0].text
        answer = tokenizer.decode([out.outputs[0].token_ids[0]])
        print(f"text {text!r}; the first token {answer!r} under each lens, by layer:")
        for name in ("logit", "j"):
            for layer in layers:
                reading = out.prefill_lens[name][layer]  # prompt rows: the last one says next
                top = [tokenizer.decode([t]) for t in reading.token_ids[-1].tolist()]
                target = float(reading.target_logprob[-1])
                print(f"  {name:5} layer {layer}: top {top}  log p({answer!r}) = {target:.2f}")
        per_token = out.outputs[0].lens["logit"][3]
        print(f"generated tokens' log-probs at the last layer: {per_token.target_logprob}")
        # A lens monitor: stop where the J-lens at layer 2 already gives "." log-prob > -1
        # (thresholds above -log(lens_top_k + 1) are exact).
        dot = tokenizer.convert_tokens_to_ids(".")
        watch = {"lens": "j", "layer": 2, "token": dot, "threshold": -1.0, "action": "stop"}
        params = SamplingParams(max_tokens=8, temperature=0,
                                extra_args={"probehook": {"monitors": [watch]}})  # fmt: skip
        stopped = llm.generate(["12+34="], params, use_tqdm=False)[0].outputs[0]
        print(f"with a stop monitor on '.' at layer 2: {stopped.text!r}, {stopped.stop_reason}")


if __name__ == "__main__":
    main()
