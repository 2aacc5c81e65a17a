"""SAE features of every generated token, from inside the engine: the bundled SAE of the tiny
model (TopK, 512 features, layer 3), a flag monitor on one feature, the features in a store,
and a clamp that removes a feature.

python examples/sae_features.py [-v]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from probehook.logs import quiet_vllm

QUIET = quiet_vllm()  # vLLM's warnings and loading bars stay out unless run with -v


def main() -> None:
    from probehook import LLM, SAE, SamplingParams, tiny_model_path, tiny_sae_path
    from probehook.store import ActivationStore

    sae = SAE.load(tiny_sae_path())
    print(f"{sae}: reads layer {sae.layer}, top {sae.k} features of {sae.d_sae}")
    store = Path(tempfile.mkdtemp(prefix="probehook-saes-")) / "features"
    llm = LLM(
        tiny_model_path(),
        saes={"l3": sae},
        sae_top_k=4,
        sae_clamping=True,
        include_prefill=True,
        store=store,
        **QUIET,
    )
    greedy = {"max_tokens": 4, "temperature": 0}
    with llm:
        out = llm.generate(["12+34="], SamplingParams(**greedy))[0]
        features = out.outputs[0].sae_features["l3"]
        print(f"text {out.outputs[0].text!r}; features of layer {sae.layer} per generated token:")
        for i in range(len(features)):
            indices, values = features[i]
            pairs = zip(indices.tolist(), values.tolist(), strict=True)
            shown = ", ".join(f"{f}:{v:.2f}" for f, v in pairs)
            print(f"  token {i}: l0 {int(features.l0[i])}  top [{shown}]")
        feature = int(features.indices[0, 0])  # the strongest feature of the first token
        flagged = llm.generate(
            ["12+34="],
            SamplingParams(
                **greedy,
                extra_args={
                    "probehook": {"monitors": [{"sae": "l3", "feature": feature, "threshold": 0.0}]}
                },
            ),  # fmt: skip
        )[0]
        print(f"feature {feature} on at generated tokens {flagged.outputs[0].feature_flags}")
        clamped = llm.generate(
            ["12+34="],
            SamplingParams(**greedy, extra_args={"probehook": {"clamp": {"l3": {feature: 0.0}}}}),
        )[0]
        print(f"clamped to 0: text {clamped.outputs[0].text!r} (was {out.outputs[0].text!r})")
    stored = ActivationStore.open(store)[out.store_id]
    print(f"stored {out.store_id}: {len(stored.sae_features['l3'])} tokens of features, no rows")


if __name__ == "__main__":
    main()
