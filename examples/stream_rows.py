"""Stream tokens with their residual-stream rows (and probe scores) from probehook.AsyncLLM.

python examples/stream_rows.py [MODEL_DIR] [PROBE_PATH]

Each streamed output carries the rows of the tokens it holds: row i belongs to token i and
arrives in the same yield. Pass a probe saved with LinearProbe.save (the demo trains some) to
see its score per token too.
"""

from __future__ import annotations

import asyncio
import sys

from probehook.logs import quiet_vllm

# vLLM's warnings and loading bars stay out of the result unless run with -v.
QUIET = quiet_vllm()


async def main(model: str, probe: str | None) -> None:
    from vllm.sampling_params import RequestOutputKind

    from probehook import AsyncLLM, SamplingParams

    probes = {"probe": probe} if probe else None
    params = SamplingParams(max_tokens=8, temperature=0, output_kind=RequestOutputKind.DELTA)
    # enforce_eager: start-up in seconds on a CPU; leave it out for vLLM's compiled mode.
    engine = AsyncLLM(
        model, layers=[-1], probes=probes, max_model_len=64, enforce_eager=True, **QUIET
    )
    async with engine:
        last = engine.capture_config.layers[-1]
        for prompt in ("12+7=", "3+4="):
            print(f"prompt {prompt!r}: token, layer {last} row norm" + (", score" if probe else ""))
            # DELTA: each output holds only its new tokens, and the rows of exactly those.
            async for out in engine.generate(prompt, params):
                completion = out.outputs[0]
                rows = completion.hidden_states[last]
                assert rows.shape[0] == len(completion.token_ids)
                for i, token in enumerate(completion.token_ids):
                    line = f"  {token:>4} {float(rows[i].float().norm()):8.3f}"
                    if probe:
                        line += f" {float(completion.probe_scores['probe'][i]):6.3f}"
                    print(line)
            print(f"  finish_reason={completion.finish_reason}")


if __name__ == "__main__":
    from probehook import tiny_model_path

    args = [a for a in sys.argv[1:] if a != "-v"]
    model = args[0] if args else str(tiny_model_path())
    asyncio.run(main(model, args[1] if len(args) > 1 else None))
