"""Bracketed measurements of the readout benchmarks (lenses.py, attention.py): each
configuration's run between two plain vLLM runs, its ratio to their geometric mean, medians
over rounds, each against its floor ``1 / (1 + f)``, and the report's tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

BASELINE = "vLLM compiled"


def run_once(
    llm: object,
    prompts: list[dict],
    max_tokens: int,
    options: dict | None,
    came_back: Callable[[object], bool],
    picking: str,
) -> float:
    """Tokens per second: generated ones (decode), or prompt ones when ``max_tokens`` is 1.
    Where ``options`` do not turn the readout off (``picking`` False), ``came_back`` of the
    first output must hold (the readout's values are there)."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0,
        detokenize=False,
        extra_args={"probehook": options} if options is not None else None,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if options is not None and options.get(picking) is not False:
        assert came_back(outs[0]), f"no {picking} readings came back"
    if max_tokens == 1:
        return sum(len(o.prompt_token_ids) for o in outs) / elapsed
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_prompts(
    prompts: Callable[[int], list[dict]],
    length: int,
    max_tokens: int,
    came_back: Callable[[object], bool],
    picking: str,
    llm: object,
    options: dict | None,
) -> float:
    """:func:`run_once` on fresh prompts of ``length`` tokens."""
    return run_once(llm, prompts(length), max_tokens, options, came_back, picking)


def bracketed_rounds(
    phase: str,
    rounds: int,
    measure: Callable[[object, dict | None], float],
    base: object,
    configs: Mapping[str, tuple[object, dict | None]],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` interleaved rounds: the baseline engine ``base``, then each configuration's
    engine and request options (``configs``) followed by the baseline again, each run's tokens
    per second from ``measure(engine, options)``. Returns every sample (the baseline's under
    :data:`BASELINE`) and each configuration's bracketed ratios."""
    bracketed: dict[str, list[float]] = {name: [] for name in configs}
    samples: dict[str, list[float]] = {BASELINE: [], **{name: [] for name in configs}}
    for round_index in range(rounds):
        before = measure(base, None)
        samples[BASELINE].append(before)
        for name, (engine, options) in configs.items():
            value = measure(engine, options)
            after = measure(base, None)
            samples[name].append(value)
            samples[BASELINE].append(after)
            bracketed[name].append(value / (before * after) ** 0.5)
            before = after
        print(
            f"{phase} round {round_index + 1}/{rounds}: "
            + ", ".join(f"{n}: {s[-1]:.0f} tok/s" for n, s in samples.items()),
            flush=True,
        )
    return samples, bracketed


def phase_rows(
    samples: Mapping[str, list[float]],
    bracketed: Mapping[str, list[float]],
    work: Mapping[str, float],
) -> list[dict]:
    """The report's rows of one phase: the baseline's, then each configuration's median
    tokens per second, median bracketed ratio and its ratio to the floor ``1 / (1 + f)``
    (``work[name]``: its ``f``)."""
    rows = [
        {"config": BASELINE, "median_tok_s": round(statistics.median(samples[BASELINE]), 1),
         "median_bracketed_ratio": 1.0, "floor": 1.0}
    ]  # fmt: skip
    for name, ratios in bracketed.items():
        f, ratio = work[name], statistics.median(ratios)
        rows.append(
            {
                "config": name,
                "median_tok_s": round(statistics.median(samples[name]), 1),
                "median_bracketed_ratio": round(ratio, 3),
                "bracketed_ratios": [round(r, 3) for r in ratios],
                "f": round(f, 4),
                "floor": round(1 / (1 + f), 3),
                "ratio_over_floor": round(ratio * (1 + f), 3),
            }
        )
    return rows


def table_lines(phases: Mapping[str, list[dict]]) -> list[str]:
    """Each phase's rows as a markdown table (decode: generated tokens/s; prefill: prompt)."""
    lines: list[str] = []
    for phase, rows in phases.items():
        unit = "generated" if phase == "decode" else "prompt"
        lines += [
            "",
            f"{phase} ({unit} tokens/s):",
            "",
            "| config | median tok/s | median bracketed ratio | f | floor | ratio / floor |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['config']} | {r['median_tok_s']} | {r['median_bracketed_ratio']} | "
                f"{r.get('f', '')} | {r['floor']} | {r.get('ratio_over_floor', '')} |"
            )
    return lines
