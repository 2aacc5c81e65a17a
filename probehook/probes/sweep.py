"""``sweep``: one probe per layer on the same labels and split, to find where a signal lives."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm.auto import tqdm

from probehook.errors import MissingExtraError, ProbeError
from probehook.probes.linear import LinearProbe
from probehook.probes.rows import Labels, LabelSource
from probehook.probes.train import fit_probe

if TYPE_CHECKING:
    from probehook.store import ActivationStore


@dataclass(frozen=True)
class SweepRow:
    """Held-out metrics of one layer's probe (None where they do not apply)."""

    layer: int
    accuracy: float | None
    roc_auc: float | None
    r2: float | None
    n_train: int
    n_test: int


@dataclass
class SweepResult:
    """Per-layer rows (in layer order) and probes of :func:`sweep`."""

    rows: list[SweepRow]
    probes: dict[int, LinearProbe] = field(repr=False)

    @property
    def regression(self) -> bool:
        return any(p.kind == "regression" for p in self.probes.values())

    @property
    def best(self) -> LinearProbe:
        """The probe with the highest held-out accuracy (r2 for regression); ties: lowest
        layer."""
        key = "r2" if self.regression else "accuracy"
        scored = [r for r in self.rows if getattr(r, key) is not None]
        if not scored:
            raise ProbeError(f"no layer has a held-out {key}.")
        best = max(scored, key=lambda r: getattr(r, key))  # max keeps the first of ties
        return self.probes[best.layer]

    def __str__(self) -> str:
        metrics = ["r2"] if self.regression else ["accuracy", "roc_auc"]
        header = ["layer", *metrics, "n_train", "n_test", ""]
        best = self.best.layer if self.rows else None
        table = [header]
        for r in self.rows:
            values = [_cell(getattr(r, m)) for m in metrics]
            mark = "best" if r.layer == best else ""
            table.append([str(r.layer), *values, str(r.n_train), str(r.n_test), mark])
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
        return "\n".join(line.rstrip() for line in lines)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write a PNG of the held-out metrics by layer; returns ``path``. Needs matplotlib."""
        try:
            from matplotlib.figure import Figure
        except ImportError as e:
            raise MissingExtraError(
                "SweepResult.plot needs matplotlib: pip install 'probehook[plot]'"
            ) from e
        # A bare Figure, not pyplot: no global state, no GUI backend, safe in threads.
        fig = Figure(figsize=(6, 3.5))
        ax = fig.add_subplot()
        layers = [r.layer for r in self.rows]
        metrics = ["r2"] if self.regression else ["accuracy", "roc_auc"]
        for metric in metrics:
            values = [getattr(r, metric) for r in self.rows]
            if any(v is not None for v in values):
                points = [float("nan") if v is None else v for v in values]
                ax.plot(layers, points, "o-", label=metric)
        ax.set_xlabel("layer")
        ax.set_ylabel("held-out score")
        ax.set_xticks(layers)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
        return path


def sweep(
    store: ActivationStore | str | os.PathLike[str],
    layers: Literal["all"] | Iterable[int] = "all",
    *,
    labels: Labels,
    token: str = "last",
    phase: str = "prefill",
    estimator: Any = None,
    test_size: float | int = 0.2,
    seed: int = 0,
    standardize: bool = True,
    progress: bool = True,
) -> SweepResult:
    """Fit ``LinearProbe.fit(store, layer, labels, ...)`` for each of ``layers`` (``"all"``: every
    layer of the store). The same seed splits the same requests on every layer."""
    from probehook.store import ActivationStore

    if not isinstance(store, ActivationStore):
        with ActivationStore.open(store) as opened:  # its shard files are closed afterwards
            return sweep(
                opened,
                layers,
                labels=labels,
                token=token,
                phase=phase,
                estimator=estimator,
                test_size=test_size,
                seed=seed,
                standardize=standardize,
                progress=progress,
            )
    if isinstance(layers, str) and layers != "all":
        raise ProbeError(f"layers={layers!r}; pass 'all' or a list of layer numbers.")
    chosen = store.layers if layers == "all" else list(layers)
    if not chosen:
        raise ProbeError(f"no layers to sweep; {store.root} has layers {store.layers}.")
    absent = [layer for layer in chosen if layer not in store.layers]
    if absent:
        raise ProbeError(
            f"layer(s) {absent} are not in {store.root}; its layers are {store.layers}."
        )
    source = LabelSource(labels)  # a callable is called once per request, not once per layer
    probes: dict[int, LinearProbe] = {}
    rows: list[SweepRow] = []
    for layer in tqdm(sorted(chosen), desc="probe sweep", unit="layer", disable=not progress):
        probe = fit_probe(
            store,
            layer,
            source,
            token=token,
            phase=phase,
            estimator=estimator,
            test_size=test_size,
            seed=seed,
            standardize=standardize,
            progress=False,
        )
        probes[layer] = probe
        m = probe.metrics
        rows.append(
            SweepRow(
                layer=layer,
                accuracy=m.get("accuracy"),
                roc_auc=m.get("roc_auc"),
                r2=m.get("r2"),
                n_train=m["n_train"],
                n_test=m["n_test"],
            )
        )
    return SweepResult(rows, probes)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
