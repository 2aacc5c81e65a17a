"""Activation patching as one entry of the write table: ``LLM(patching=True)`` (``probehook
serve --patching``) installs a ``"patch"`` term and a ``keep`` op at every layer's input
(``resid_pre``) and output (``resid_post``), and a source bank of float32 rows in the worker.
``llm.patch_sweep`` (``probehook.frontend.patch_sweep``) drives it: one request keeps the clean
run's rows in the bank (``{"keep": first_row}`` at every site), then one request per cell puts
one kept row back (``{"cell": [position, row, alpha]}`` at one site). A request that patches
nothing is untouched (its tokens' index stays 0).

The request option ``patch`` is the sweep's own: its terms name bank rows, which only the
sweep allocates, so users call ``patch_sweep`` rather than send it. No vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from probehook.errors import CaptureConfigError
from probehook.outputs.intervention import SITES, EngineFacts, Intervention

DEFAULT_BANK_MB = 256
"""The source bank's size with ``patching=True``: float32 rows of the hidden size."""


def bank_rows(megabytes: float, hidden_size: int) -> int:
    """How many float32 rows of ``hidden_size`` fit in ``megabytes``."""
    return int(megabytes * 2**20) // (4 * hidden_size)


def instance_name(site: str, layer: int) -> str:
    return f"{site}@{layer}"


class Patching(Intervention):
    """Activation patching's write term (``patching=True``, or the source bank's size in MiB)
    and its request option ``patch``; a completion's ``steering["patch"]`` names the cell."""

    name = "patching"
    engine_option = "patching"
    request_option = "patch"
    kind = "patch"
    worker_writer = "probehook.worker.patch_op:patch_writers"
    cli_switch = True
    cli_help = (
        "install activation patching at every layer's input and output (llm.patch_sweep), "
        f"with a {DEFAULT_BANK_MB} MiB bank of kept rows"
    )

    def instances(self, value: Any, engine: EngineFacts) -> dict[str, dict[str, Any]]:
        """Every site of every layer (``patching=True``, or a bank of ``value`` MiB)."""
        if value is False or value is None:
            return {}
        if value is True:
            megabytes = DEFAULT_BANK_MB
        elif isinstance(value, int | float) and not isinstance(value, bool) and value > 0 \
                and math.isfinite(value):  # fmt: skip
            megabytes = float(value)
        else:
            raise CaptureConfigError(
                f"patching={value!r} is not valid: pass True (a {DEFAULT_BANK_MB} MiB bank of "
                "kept rows) or the bank's size in MiB."
            )
        rows = bank_rows(megabytes, engine.hidden_size)
        if rows < 1:
            raise CaptureConfigError(
                f"patching={value!r} MiB holds no row of {engine.hidden_size}."
            )
        return {
            instance_name(site, layer): {"layer": layer, "site": site, "rows": rows}
            for layer in range(engine.num_layers)
            for site in SITES
        }

    def check_terms(self, value: Any, instances: Mapping[str, Mapping[str, Any]]) -> dict:
        """``{instance: {"cell": [position, row, alpha], "run": nonce}}`` or ``{instance:
        {"keep": row, "run": nonce}}``, as the sweep writes them."""
        if not isinstance(value, Mapping) or not value:
            raise CaptureConfigError(f"patch={value!r:.80} is not valid (patch_sweep writes it).")
        rows = int(next(iter(instances.values()))["rows"]) if instances else 0
        out = {}
        for name, terms in value.items():
            if name not in instances:
                raise CaptureConfigError(
                    f"patch names site {name!r}, which this engine does not patch (its sites: "
                    f"{sorted(instances)[:4]}...)."
                )
            if not isinstance(terms, Mapping) or set(terms) - {"cells", "adds", "keep", "run"}:
                raise CaptureConfigError(f"patch[{name!r}]={terms!r:.80} is not valid.")
            run = str(terms.get("run", ""))
            if isinstance(terms.get("keep"), int) and 1 <= terms["keep"] <= rows:
                out[name] = {"keep": int(terms["keep"]), "run": run}
                continue
            cells, adds = terms.get("cells", []), terms.get("adds", [])
            if not (_triples(cells, rows) and _pairs(adds, rows)) or not (cells or adds):
                raise CaptureConfigError(f"patch[{name!r}]={terms!r:.80} is not valid.")
            out[name] = {"cells": [[p, r, float(a)] for p, r, a in cells],
                         "adds": [[p, r] for p, r in adds], "run": run}  # fmt: skip
        return out

    def applied(self, terms: Mapping[str, Any]) -> Any:
        """``{site: {"patched": [[position, alpha], ...], "noised": [positions]}}``, or
        ``{"kept": [sites]}`` of a kept run."""
        if all("keep" in t for t in terms.values()):
            return {"kept": sorted(terms)}
        return {
            site: {"patched": [[p, a] for p, _, a in t.get("cells", [])],
                   "noised": [p for p, _ in t.get("adds", [])]}
            for site, t in terms.items() if "keep" not in t
        }  # fmt: skip

    def mark(self, applied: Any) -> str:
        if "kept" in applied:
            return f"kept for patching at {len(applied['kept'])} sites"
        parts = []
        for site, what in applied.items():
            parts += [f"patched {site} at position {p} (alpha {a:g})" for p, a in what["patched"]]
            if what["noised"]:
                parts.append(f"noised {site} at positions {what['noised']}")
        return "; ".join(parts)


def _triples(cells: Any, rows: int) -> bool:
    """``[[position, row, alpha], ...]`` with rows in the bank and alphas in [0, 1]."""
    return isinstance(cells, list | tuple) and all(
        isinstance(c, list | tuple) and len(c) == 3 and _index(c[0], 0) and _index(c[1], 1, rows)
        and isinstance(c[2], int | float) and 0.0 <= float(c[2]) <= 1.0
        for c in cells
    )  # fmt: skip


def _pairs(adds: Any, rows: int) -> bool:
    return isinstance(adds, list | tuple) and all(
        isinstance(a, list | tuple) and len(a) == 2 and _index(a[0], 0) and _index(a[1], 1, rows)
        for a in adds
    )


def _index(value: Any, low: int, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))  # fmt: skip
