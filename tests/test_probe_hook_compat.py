"""Users of vllm-probe-hook can switch by changing the import.

``EXAMPLE`` is the first example of vllm-probe-hook's README, verbatim except for the import
line and the lines that name an 8B model on a GPU (``SUBSTITUTIONS``): this machine runs the
bundled 4-layer tiny model on a CPU.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

EXAMPLE = """
from vllm_probe_hook import LLM, SamplingParams  # SamplingParams is re-exported from vllm

llm = LLM(
    model="meta-llama/Meta-Llama-3.1-8B-Instruct",
    layers=[15, 20],  # specify which layers to collect activations from
    max_model_len=4096,
    gpu_memory_utilization=0.7,
)
sampling_params = SamplingParams(n=1, temperature=0.7, top_p=0.95, max_tokens=512)
outputs = llm.generate(
    ["What is the capital of France?", "What is 2 to the power of 12?"],
    sampling_params,
)

for output in outputs:
    # standard vLLM API is unchanged
    print(output.outputs[0].text)

    # hidden states are available as a dict mapping layer index to a torch.Tensor
    print(output.hidden_states[15].shape)  # e.g. torch.Size([num_output_tokens, model_dimension (d_model)])
    print(output.hidden_states[20].shape)
"""

SUBSTITUTIONS = {
    "from vllm_probe_hook import": "from probehook import",
    'model="meta-llama/Meta-Llama-3.1-8B-Instruct"': "model=tiny_model_path()",
    "layers=[15, 20]": "layers=[1, 3]",
    "hidden_states[15]": "hidden_states[1]",
    "hidden_states[20]": "hidden_states[3]",
    "max_model_len=4096": "max_model_len=64",
    "gpu_memory_utilization=0.7": "gpu_memory_utilization=0.1, enforce_eager=True",
    "max_tokens=512": "max_tokens=12",
    "What is the capital of France?": "12+34=",
    "What is 2 to the power of 12?": "7+8=",
}


def test_readme_example_runs_with_the_import_changed(capsys) -> None:
    from probehook import tiny_model_path

    code = EXAMPLE
    for old, new in SUBSTITUTIONS.items():
        assert old in code, old
        code = code.replace(old, new)
    namespace = {"tiny_model_path": tiny_model_path}
    exec(compile(code, "vllm_probe_hook_readme_example", "exec"), namespace)  # noqa: S102
    outputs, llm = namespace["outputs"], namespace["llm"]
    try:
        for output in outputs:
            n = len(output.outputs[0].token_ids)
            assert output.hidden_states[1].shape == (n, 128)
            # vllm-probe-hook's attribute names are read-only aliases of probehook's.
            assert output.hidden is output.hidden_states
            assert output.prefill_hidden is output.prefill_hidden_states
            assert output.outputs[0].hidden is output.outputs[0].hidden_states
            with pytest.raises(AttributeError):
                output.hidden = {}
        assert "torch.Size([" in capsys.readouterr().out
    finally:
        llm.shutdown()
