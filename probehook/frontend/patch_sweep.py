"""``LLM.patch_sweep``: activation patching over layers and positions, in the engine.

A sweep runs the clean prompt once, keeping its rows at the sweep's site of every swept layer
in the worker's source bank (``probehook.worker.patch_op``: on the device, inside the memory
vLLM profiled), then the corrupt prompt once alone (its metric) and once per cell, each cell
with one kept row put back in place of the corrupt run's at one (layer, position):
``h <- (1 - alpha) h + alpha h_clean``. The cells and an in-batch copy of the corrupt run go to
the engine as one batch. The metric comes from the logits of the last prompt row, from the
full row in the worker (vLLM's ``logprob_token_ids``: the log-softmax of the whole vocabulary
at the answer and the foil), never from top-k log-probs.

Each cell is its own request with its own prefix-cache salt (the write table salts a request
by its terms, which hold the sweep's nonce and the cell): it never reads the corrupt prompt's
cached blocks (the patch would be skipped there) and never publishes its patched blocks. So
every cell recomputes its whole prompt; recomputing only from the patched position on is the
next step.

No vLLM imports: the engine is the caller's ``generate``.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probehook.errors import CaptureConfigError
from probehook.outputs.patching import instance_name

HOOKS = {"resid_pre": "resid_pre", "resid_post": "resid_post", "pre_attn": "resid_pre",
         "post_block": "resid_post"}  # fmt: skip
"""The sites a sweep patches: TransformerLens's names, and the RhizoNymph fork's for them."""
METRICS = ("logit_diff", "logprob", "recovered")


@dataclass
class PatchSweep:
    """A sweep's result. ``grid[i, j]``: the metric with the clean row of ``layers[i]`` at
    ``positions[j]`` patched in (NaN at a skipped position); ``clean`` / ``corrupt``: the
    metric of the clean and corrupt runs unpatched (for ``"recovered"`` their logit
    differences); ``noise_floor``: how far the corrupt run's metric moves between running
    alone and inside the sweep's batch (batch-shape numerics: differences below it are
    noise)."""

    grid: np.ndarray
    clean: float
    corrupt: float
    noise_floor: float
    layers: list[int]
    positions: list[int]
    skipped: list[int]
    """Corrupt positions with no clean counterpart (between the common prefix and suffix)."""
    alignment: dict[int, int]
    """Each patched corrupt position's clean position."""
    hook: str
    metric: str
    alpha: float
    tokens: list[str] = field(default_factory=list)
    """The corrupt prompt's tokens, as text (the plot's axis)."""
    recomputed_tokens: int = 0
    """Prompt tokens each cell recomputes (all of them: see the module's notes)."""
    grids: np.ndarray | None = None
    """With many pairs: each pair's grid, ``[pairs, layers, positions]``; ``grid`` is their
    mean."""
    ci: np.ndarray | None = None
    """With many pairs: a bootstrap 95% interval of the mean, ``[2, layers, positions]``
    (lower, upper; seeded)."""
    corruption: dict[str, Any] | None = None
    """Corruption by noise: its ``span``, ``scale``, ``seed`` and the embeddings' ``std``."""

    @property
    def argmax(self) -> tuple[int, int]:
        """``(layer, position)`` of the largest cell."""
        i, j = np.unravel_index(np.nanargmax(self.grid), self.grid.shape)
        return self.layers[int(i)], self.positions[int(j)]

    def to_dict(self) -> dict[str, Any]:
        """The served response's fields (the RhizoNymph fork's names)."""
        grid = [[None if math.isnan(v) else float(v) for v in row] for row in self.grid.tolist()]
        return {"grid": grid, "clean": self.clean, "corrupt": self.corrupt,
                "noise_floor": self.noise_floor, "layers": self.layers,
                "positions": self.positions, "skipped": self.skipped,
                "alignment": [[k, v] for k, v in sorted(self.alignment.items())],
                "argmax": list(self.argmax), "hook": self.hook, "metric": self.metric,
                "alpha": self.alpha, **self._pairs()}  # fmt: skip

    def _pairs(self) -> dict[str, Any]:
        if self.grids is None:
            return {}

        def rows(array: np.ndarray) -> list:
            return np.where(np.isnan(array), None, array).tolist()

        return {"grids": rows(self.grids.astype(object)), "ci": rows(self.ci.astype(object))}

    def plot(self, ax: Any = None) -> Any:
        """The layers x positions heatmap, token strings on the position axis (matplotlib)."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(
                figsize=(max(4, 0.5 * len(self.positions)), 0.4 * len(self.layers) + 1.5)
            )
        bound = float(np.nanmax(np.abs(self.grid)))
        image = ax.imshow(self.grid, aspect="auto", cmap="RdBu_r", origin="lower",
                          vmin=-bound, vmax=bound)  # fmt: skip
        ax.set_yticks(range(len(self.layers)), [str(layer) for layer in self.layers])
        labels = [self.tokens[p] if p < len(self.tokens) else str(p) for p in self.positions]
        ax.set_xticks(range(len(self.positions)), [repr(t)[1:-1] for t in labels], rotation=90)
        ax.set_ylabel(f"layer ({self.hook})")
        ax.figure.colorbar(image, ax=ax, label=self.metric)
        return ax


Request = tuple[list[int], dict[str, Any], list[int]]
"""A sweep's request: the prompt's token ids, its probehook options and the token ids whose
log-probs it reads (the answer and the foil)."""


class SweepPlan:
    """A sweep checked and laid out: its requests in order (:meth:`clean_request`,
    :meth:`corrupt_request`, then :meth:`cell_requests`, the corrupt run inside their batch
    first) and how their outputs make the :class:`PatchSweep`. Drivers: :func:`patch_sweep`
    (offline) and ``AsyncLLM.patch_sweep`` (cells as they finish)."""

    def __init__(
        self,
        writes: Mapping[str, Any],
        tokenize: Callable[..., list[int]],
        decode: Callable[[int], str],
        *,
        prompt: str | Sequence[int],
        clean_prompt: str | Sequence[int] | None = None,
        answer_token: str | None = None,
        foil_token: str | None = None,
        answer_token_id: int | None = None,
        foil_token_id: int | None = None,
        layers: str | Sequence[int] | Mapping[str, int] = "all",
        positions: str | Sequence[int] = "all_prompt",
        hook: str = "resid_pre",
        metric: str = "logit_diff",
        alpha: float = 1.0,
        corruption: Mapping[str, Any] | None = None,
        first_row: int = 1,
    ) -> None:
        """``first_row``: the first row of the source bank this pair's clean run keeps into
        (pairs of one sweep keep side by side)."""
        entry = writes.get("patch")
        if entry is None or not entry.instances:
            raise CaptureConfigError(
                "patch_sweep needs an engine built with patching=True (probehook serve "
                "--patching): it installs the patch op at every layer's input and output."
            )
        self.site = _hook(hook)
        if metric not in METRICS:
            raise CaptureConfigError(f"metric={metric!r} is not one of {list(METRICS)}.")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise CaptureConfigError(
                f"alpha={alpha!r} must be a number in [0, 1] (1: the clean row)."
            )
        self.metric, self.alpha = metric, float(alpha)
        instances = entry.instances
        num_layers = 1 + max(int(s["layer"]) for s in instances.values())
        rows = int(next(iter(instances.values()))["rows"])
        self.corrupt = _ids(prompt, tokenize, "prompt")
        self.noise = _noise(corruption, clean_prompt, len(self.corrupt))
        if self.noise is None and clean_prompt is None:
            raise CaptureConfigError(
                "give clean_prompt (the run whose rows are patched in) or corruption={'noise': "
                "{'span': [start, end], 'scale': 3.0, 'seed': 0}} (the prompt is then the clean "
                "run and its noised copy the corrupt one)."
            )
        self.clean = self.corrupt if self.noise is not None else _ids(clean_prompt, tokenize,
                                                                       "clean_prompt")  # fmt: skip
        self.answer = _token(answer_token, answer_token_id, "answer", tokenize)
        self.foil = _token(foil_token, foil_token_id, "foil", tokenize)
        self.scored = [self.answer, self.foil]
        self.layers = _layers(layers, num_layers)
        self.alignment, _ = align(self.corrupt, self.clean)
        self.positions = _positions(positions, len(self.corrupt))
        self.cells = [p for p in self.positions if p in self.alignment]
        self.skipped = [p for p in self.positions if p not in self.alignment]
        self.rows_kept = len(self.layers) * len(self.clean)
        if self.noise is not None:  # its rows after the kept ones
            self.noise["first"] = first_row + self.rows_kept
            self.rows_kept += self.noise["span"][1] - self.noise["span"][0]
        if first_row - 1 + self.rows_kept > rows:
            raise CaptureConfigError(
                f"this sweep keeps {len(self.layers)} layers x {len(self.clean)} clean tokens = "
                f"{self.rows_kept} rows{' (after its earlier pairs)' if first_row > 1 else ''}, "
                f"but the engine's patching bank holds {rows} (patching=True: 256 MiB of "
                "float32 rows); sweep fewer layers, shorter prompts or fewer pairs, or build "
                "the LLM with patching=MiB."
            )
        self.nonce = uuid.uuid4().hex
        self.base = {layer: first_row + i * len(self.clean) for i, layer in enumerate(self.layers)}
        self.tokens = [decode(t) for t in self.corrupt]
        self.ends: tuple[tuple[float, float], tuple[float, float]] | None = None

    def clean_request(self) -> Request:
        """The clean run, keeping its rows at the site of every swept layer."""
        keep = {instance_name(self.site, layer): {"keep": self.base[layer], "run": self.nonce}
                for layer in self.layers}  # fmt: skip
        return self.clean, _options({"patch": keep}), self.scored

    def corrupt_request(self) -> Request:
        return self.corrupt, _options(self._corrupted({})), self.scored

    def _corrupted(self, terms: dict[str, Any]) -> dict[str, Any]:
        """A corrupt request's patch terms with the noise added at layer 0's input (before a
        cell there: the cell puts the clean row back over the noised one)."""
        if self.noise is None:
            return {"patch": terms} if terms else {}
        start, end = self.noise["span"]
        adds = [[p, self.noise["first"] + p - start] for p in range(start, end)]
        site = instance_name("resid_pre", 0)
        own = dict(terms.get(site, {"run": self.nonce}))
        own["adds"] = adds
        return {"patch": {**terms, site: own}}

    def cell_requests(self) -> list[Request]:
        """The corrupt run (inside the batch), then a cell per (layer, position), layer by
        layer."""
        out = [self.corrupt_request()]
        for layer in self.layers:
            for position in self.cells:
                cell = [position, self.base[layer] + self.alignment[position], self.alpha]
                terms = {instance_name(self.site, layer): {"cells": [cell], "run": self.nonce}}
                out.append((self.corrupt, _options(self._corrupted(terms)), self.scored))
        return out

    def cell_of(self, k: int) -> tuple[int, int]:
        """``(layer, position)`` of :meth:`cell_requests`' request ``k + 1``."""
        layer_index, position = divmod(k, len(self.cells))
        return self.layers[layer_index], self.cells[position]

    def set_ends(self, clean_out: Any, corrupt_out: Any) -> None:
        """The clean and corrupt runs' metrics (before the cells)."""
        self.ends = (self.metrics_of(clean_out), self.metrics_of(corrupt_out))

    def metrics_of(self, out: Any) -> tuple[float, float]:
        """``(logit_diff, logprob)`` of an output's first token's scored log-probs."""
        logprobs = out.outputs[0].logprobs[0]
        a, f = logprobs[self.answer].logprob, logprobs[self.foil].logprob
        return float(a - f), float(a)

    def value(self, out: Any) -> float:
        """A cell's metric."""
        ld, lp = self.metrics_of(out)
        (clean_ld, _), (corrupt_ld, _) = self.ends
        return _value(self.metric, ld, lp, clean_ld, corrupt_ld)

    def result(self, outs: Sequence[Any]) -> PatchSweep:
        """The sweep from :meth:`cell_requests`' outputs, in order."""
        (clean_ld, clean_lp), (corrupt_ld, corrupt_lp) = self.ends
        batch_ld, batch_lp = self.metrics_of(outs[0])
        grid = np.full((len(self.layers), len(self.positions)), np.nan, dtype=np.float32)
        column = {p: j for j, p in enumerate(self.positions)}
        rows = {layer: i for i, layer in enumerate(self.layers)}
        for k, out in enumerate(outs[1:]):
            layer, position = self.cell_of(k)
            grid[rows[layer], column[position]] = self.value(out)
        by_logprob = self.metric == "logprob"
        clean, corrupt, batch = (clean_lp, corrupt_lp, batch_lp) if by_logprob else \
            (clean_ld, corrupt_ld, batch_ld)  # fmt: skip
        return PatchSweep(
            grid=grid, clean=clean, corrupt=corrupt, noise_floor=abs(batch - corrupt),
            layers=self.layers, positions=self.positions, skipped=self.skipped,
            alignment={p: self.alignment[p] for p in self.cells}, hook=self.site,
            metric=self.metric, alpha=self.alpha, tokens=self.tokens,
            recomputed_tokens=len(self.corrupt),
            corruption=None if self.noise is None else {
                "span": list(self.noise["span"]), "scale": self.noise["scale"],
                "seed": self.noise["seed"], "std": self.noise.get("std")},
        )  # fmt: skip


class PairedSweep:
    """One sweep over one or many (corrupt, clean) pairs: a :class:`SweepPlan` per pair, the
    pairs' clean runs kept side by side in the bank, every pair's cells in one batch. With
    many pairs the corrupt prompts must have one length (the grid's positions are shared),
    ``grid`` is the mean over pairs, ``grids`` each pair's and ``ci`` a seeded bootstrap 95%
    interval of the mean per cell."""

    def __init__(
        self,
        writes: Mapping[str, Any],
        tokenize: Callable[..., list[int]],
        decode: Callable[[int], str],
        *,
        prompt: Any,
        clean_prompt: Any = None,
        answer_token: Any = None,
        foil_token: Any = None,
        answer_token_id: Any = None,
        foil_token_id: Any = None,
        bootstrap_seed: int = 0,
        **common: Any,
    ) -> None:
        pairs = _is_many(prompt)
        if clean_prompt is None:  # corruption by noise: each prompt is its own clean run
            clean_prompt = [None] * len(prompt) if pairs else None
        if pairs != _is_many(clean_prompt, none=True) or (
            pairs and len(prompt) != len(clean_prompt)
        ):
            raise CaptureConfigError(
                "prompt and clean_prompt must both be one prompt or both lists of one length "
                "(one clean prompt per corrupt one)."
            )
        prompts, cleans = (
            (list(prompt), list(clean_prompt)) if pairs else ([prompt], [clean_prompt])
        )
        if not prompts:
            raise CaptureConfigError("prompt is an empty list of pairs.")
        count = len(prompts)
        tokens = {"answer_token": answer_token, "foil_token": foil_token,
                  "answer_token_id": answer_token_id, "foil_token_id": foil_token_id}  # fmt: skip
        self.plans: list[SweepPlan] = []
        first = 1
        for i in range(count):
            own = {k: (v[i] if _is_list_of(v, count) else v) for k, v in tokens.items()}
            plan = SweepPlan(writes, tokenize, decode, prompt=prompts[i], clean_prompt=cleans[i],
                             first_row=first, **own, **common)  # fmt: skip
            first += plan.rows_kept
            self.plans.append(plan)
        lengths = sorted({len(plan.corrupt) for plan in self.plans})
        if len(lengths) > 1:
            raise CaptureConfigError(
                f"the corrupt prompts have {lengths} tokens; a sweep over pairs needs one length "
                "(its grid's positions are shared): pad them to one template."
            )
        self.pairs = pairs
        self.seed = bootstrap_seed
        self._cells = [plan.cell_requests() for plan in self.plans]

    def clean_requests(self) -> list[Request]:
        return [plan.clean_request() for plan in self.plans]

    def corrupt_requests(self) -> list[Request]:
        return [plan.corrupt_request() for plan in self.plans]

    def cell_requests(self) -> list[Request]:
        """Every pair's :meth:`SweepPlan.cell_requests`, one after the other."""
        return [request for cells in self._cells for request in cells]

    def locate(self, k: int) -> tuple[int, int]:
        """``(pair, index in its cell requests)`` of request ``k``."""
        for pair, cells in enumerate(self._cells):
            if k < len(cells):
                return pair, k
            k -= len(cells)
        raise IndexError(k)

    def set_ends(self, clean_outs: Sequence[Any], corrupt_outs: Sequence[Any]) -> None:
        for plan, clean, corrupt in zip(self.plans, clean_outs, corrupt_outs, strict=True):
            plan.set_ends(clean, corrupt)

    def result(self, outs: Sequence[Any]) -> PatchSweep:
        sweeps, at = [], 0
        for plan, cells in zip(self.plans, self._cells, strict=True):
            sweeps.append(plan.result(outs[at : at + len(cells)]))
            at += len(cells)
        if not self.pairs:
            return sweeps[0]
        first = sweeps[0]
        grids = np.stack([sweep.grid for sweep in sweeps])
        mean = lambda values: float(np.mean(values))  # noqa: E731
        return dataclasses.replace(
            first, grid=np.nanmean(grids, axis=0).astype(np.float32), grids=grids,
            ci=bootstrap_ci(grids, self.seed), clean=mean([s.clean for s in sweeps]),
            corrupt=mean([s.corrupt for s in sweeps]),
            noise_floor=max(s.noise_floor for s in sweeps),
            skipped=sorted({p for s in sweeps for p in s.skipped}),
        )  # fmt: skip


BOOTSTRAP_SAMPLES = 1000


def bootstrap_ci(grids: np.ndarray, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES) -> np.ndarray:
    """A percentile bootstrap 95% interval of the mean over pairs, per cell: float32 ``[2,
    layers, positions]`` (lower, upper), resampling pairs with ``numpy``'s generator at
    ``seed``."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(grids), size=(samples, len(grids)))
    means = np.nanmean(grids[picks], axis=1)  # [samples, layers, positions]
    return np.nanpercentile(means, [2.5, 97.5], axis=0).astype(np.float32)


def _is_many(prompt: Any, none: bool = False) -> bool:
    """A list of prompts (texts, or lists of token ids; ``none``: Nones too), not one."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return all(isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, str))
               or (none and p is None) for p in prompt) and not all(
        isinstance(p, int) for p in prompt)  # fmt: skip


def _is_list_of(value: Any, count: int) -> bool:
    return isinstance(value, list | tuple) and len(value) == count


NOISE_KEYS = ("span", "scale", "seed")


def _noise(corruption: Any, clean_prompt: Any, length: int) -> dict[str, Any] | None:
    """``corruption={"noise": {"span": [start, end], "scale": 3.0, "seed": 0}}`` checked."""
    if corruption is None:
        return None
    example = "corruption={'noise': {'span': [1, 4], 'scale': 3.0, 'seed': 0}}"
    noise = corruption.get("noise") if isinstance(corruption, Mapping) else None
    if (
        not isinstance(noise, Mapping)
        or set(corruption) != {"noise"}
        or set(noise) - set(NOISE_KEYS)
    ):
        raise CaptureConfigError(f"corruption={corruption!r:.80} is not valid; e.g. {example}.")
    span = noise.get("span")
    if not (isinstance(span, Sequence) and len(span) == 2 and all(isinstance(x, int) for x in span)
            and 0 <= span[0] < span[1] <= length):  # fmt: skip
        raise CaptureConfigError(
            f"corruption noise span={span!r} must be [start, end) inside the prompt's "
            f"{length} positions, start < end."
        )
    scale, seed = noise.get("scale", 3.0), noise.get("seed", 0)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise CaptureConfigError(f"corruption noise scale={scale!r} must be a positive number.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CaptureConfigError(f"corruption noise seed={seed!r} must be an int.")
    if clean_prompt is not None:
        raise CaptureConfigError(
            "corruption by noise runs the prompt itself as the clean run: drop clean_prompt."
        )
    return {"span": (int(span[0]), int(span[1])), "scale": float(scale), "seed": seed}


def noise_rows(seed: int, count: int, hidden: int, scale: float, std: float) -> np.ndarray:
    """float32 ``[count, hidden]``: ``scale * std`` times standard normal draws of a CPU
    ``torch.Generator`` seeded with ``seed`` (the same on every machine and rank)."""
    import torch

    draws = torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed))
    return (draws * (scale * std)).numpy().astype(np.float32)


def embedding_std(stats: Sequence[tuple[int, float, float, int]]) -> float:
    """The standard deviation of the input embedding matrix from each rank's ``(entries, sum,
    sum of squares, hidden)`` (``probehook_embedding_stats``: ranks hold vocabulary
    shards)."""
    n = sum(s[0] for s in stats)
    mean = sum(s[1] for s in stats) / n
    return math.sqrt(max(sum(s[2] for s in stats) / n - mean * mean, 0.0))


def patch_sweep(
    generate: Callable[[list[Request], bool], list[Any]],
    tokenize: Callable[..., list[int]],
    decode: Callable[[int], str],
    writes: Mapping[str, Any],
    write_noise: Callable[[SweepPlan], None] | None = None,
    **kwargs: Any,
) -> PatchSweep:
    """Patch the clean run's rows into the corrupt one at each (layer, position); see
    :class:`PatchSweep`, :class:`SweepPlan` and :class:`PairedSweep` (the keywords).
    ``generate(requests, progress)`` runs one request per :data:`Request` with one greedy
    token and the log-probs of its token ids (vLLM's ``logprob_token_ids``), with a progress
    bar where ``progress`` (the cells' batch); ``writes``: the engine's
    write-table entries by request option; ``write_noise(plan)``: puts a plan's noise rows in
    the workers' banks (corruption by noise)."""
    sweep = PairedSweep(writes, tokenize, decode, **kwargs)
    for plan in sweep.plans:
        if plan.noise is not None:
            if write_noise is None:
                raise CaptureConfigError("this engine cannot write noise rows")
            write_noise(plan)
    clean_outs = generate(sweep.clean_requests(), False)
    corrupt_outs = generate(sweep.corrupt_requests(), False)  # away from the cells' batch
    sweep.set_ends(clean_outs, corrupt_outs)
    return sweep.result(generate(sweep.cell_requests(), True))


def _options(extra: dict[str, Any]) -> dict[str, Any]:
    """A sweep request's probehook options: capture nothing, write ``extra``."""
    return {"layers": [], "probes": False, **extra}


def _value(metric: str, ld: float, lp: float, clean_ld: float, corrupt_ld: float) -> float:
    if metric == "logit_diff":
        return ld
    if metric == "logprob":
        return lp
    span = clean_ld - corrupt_ld
    return (ld - corrupt_ld) / span if span else math.nan


def align(corrupt: Sequence[int], clean: Sequence[int]) -> tuple[dict[int, int], list[int]]:
    """Each corrupt position's clean position, on the prompts' common prefix and suffix (the
    whole prompt when the lengths agree); the corrupt positions between them, skipped."""
    if len(corrupt) == len(clean):
        return {p: p for p in range(len(corrupt))}, []
    prefix = 0
    while prefix < min(len(corrupt), len(clean)) and corrupt[prefix] == clean[prefix]:
        prefix += 1
    suffix = 0
    most = min(len(corrupt), len(clean)) - prefix
    while suffix < most and corrupt[-1 - suffix] == clean[-1 - suffix]:
        suffix += 1
    mapping = {p: p for p in range(prefix)}
    mapping.update({len(corrupt) - 1 - s: len(clean) - 1 - s for s in range(suffix)})
    return mapping, [p for p in range(len(corrupt)) if p not in mapping]


def _hook(hook: Any) -> str:
    if hook not in HOOKS:
        raise CaptureConfigError(f"hook={hook!r} is not one of {list(HOOKS)}.")
    return HOOKS[hook]


def _ids(prompt: Any, tokenize: Callable[[str], list[int]], what: str) -> list[int]:
    if isinstance(prompt, str):
        ids = list(tokenize(prompt))
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise CaptureConfigError(f"{what}={prompt!r:.60} must be text or a list of token ids.")
    if not ids:
        raise CaptureConfigError(f"{what} is empty.")
    return ids


def _token(text: str | None, token_id: int | None, what: str, tokenize: Any) -> int:
    if (text is None) == (token_id is None):
        raise CaptureConfigError(
            f"give one of {what}_token (text of one token) or {what}_token_id, not "
            f"{'both' if text is not None else 'neither'}."
        )
    if token_id is not None:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise CaptureConfigError(f"{what}_token_id={token_id!r} must be a token id.")
        return token_id
    ids = list(tokenize(text, add_special_tokens=False))
    if len(ids) != 1:
        raise CaptureConfigError(
            f"{what}_token={text!r} is not one token: it tokenizes as {ids}; pass one token's "
            f"text or {what}_token_id=."
        )
    return ids[0]


def _layers(layers: Any, num_layers: int) -> list[int]:
    if layers == "all":
        return list(range(num_layers))
    if isinstance(layers, Mapping) and "start" in layers:  # the fork's {start, stop, step}
        layers = list(range(int(layers["start"]), int(layers.get("stop", num_layers)),
                            int(layers.get("step", 1))))  # fmt: skip
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        raise CaptureConfigError(f"layers={layers!r} must be 'all' or a non-empty list of layers.")
    bad = [
        x
        for x in layers
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < num_layers
    ]
    if bad:
        raise CaptureConfigError(
            f"layers {bad} are out of range: the model has layers 0..{num_layers - 1}."
        )
    return sorted(set(layers))


def _positions(positions: Any, length: int) -> list[int]:
    if positions == "all_prompt":
        return list(range(length))
    if isinstance(positions, str) or not isinstance(positions, Sequence) or not positions:
        raise CaptureConfigError(
            f"positions={positions!r} must be 'all_prompt' or a non-empty list of positions."
        )
    bad = [
        p for p in positions if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < length
    ]
    if bad:
        raise CaptureConfigError(
            f"positions {bad} are out of range: the corrupt prompt has positions 0..{length - 1}."
        )
    return sorted(set(positions))
