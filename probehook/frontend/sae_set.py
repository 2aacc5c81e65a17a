"""The front end's view of an engine's SAEs: checked at construction (hidden size, layer,
k), the settings the loader reads them from, each request's ``saes`` / ``sae_top_k`` checked
before it reaches the engine, and the worker's packed rows turned into
:class:`~probehook.saes.SAEFeatures`. No vLLM imports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from probehook.core.monitors import FeatureMonitor
from probehook.core.request_options import RequestOptions
from probehook.errors import CaptureConfigError
from probehook.frontend.named import load_named, select_names
from probehook.outputs.top_k import check_packed_indices
from probehook.saes import SAE, SAEError, SAEFeatures
from probehook.saes.sae import check_top_k

DEFAULT_TOP_K = 32
ENCODER_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RequestSAEs:
    """The SAEs one request reads, the features it keeps per token, and the feature
    monitors that watch it."""

    names: tuple[str, ...]
    k: int
    monitors: tuple[FeatureMonitor, ...] = ()

    @property
    def stops(self) -> bool:
        return any(m.action == "stop" for m in self.monitors)


class SAESet:
    """An engine's SAEs by name and its top-k (the most features a request may keep)."""

    def __init__(
        self,
        saes: Mapping[str, SAE],
        top_k: int,
        monitors: Sequence[FeatureMonitor] = (),
        *,
        num_layers: int,
        hidden_size: int,
        clamping: bool = False,
        dtype: str | None = None,
    ) -> None:
        self.saes = dict(saes)
        self.clamping = bool(clamping)
        """Requests may clamp features (a clamp op on each SAE's layer)."""
        if dtype not in ENCODER_DTYPES:
            raise SAEError(
                f"sae_dtype={dtype!r} is not an encoder dtype; choose one of {ENCODER_DTYPES} "
                "(None: each SAE's own)."
            )
        self.dtype = dtype
        """The encoder GEMM's dtype in the worker (None: each SAE's own)."""
        self.k = check_top_k(top_k, "sae_top_k")
        self.monitors = tuple(self._check_monitor(m) for m in monitors)
        for name, sae in self.saes.items():
            sae.check_model(hidden_size, num_layers, name)
            check_packed_indices(sae.d_sae, f"SAE {name!r}")
            if sae.path is None:
                raise SAEError(
                    f"SAE {name!r} has no folder: the engine's workers read SAEs from disk. "
                    "Load it with SAE.load(folder)."
                )
        self.layers = tuple(sorted({sae.layer for sae in self.saes.values()}))

    def _check_monitor(self, monitor: FeatureMonitor) -> FeatureMonitor:
        sae = self.saes.get(monitor.sae)
        if sae is None:
            raise SAEError(
                f"FeatureMonitor names SAE {monitor.sae!r}, which this engine does not have; "
                f"its SAEs are {sorted(self.saes)}."
            )
        if monitor.feature >= sae.d_sae:
            raise SAEError(
                f"FeatureMonitor feature={monitor.feature} is out of range: SAE "
                f"{monitor.sae!r} has {sae.d_sae} features (0..{sae.d_sae - 1})."
            )
        return monitor

    def check_clamp(self, terms: Any) -> Any:
        """A request's ``clamp`` (parsed by :func:`~probehook.core.request_options.clamp_terms`)
        against this engine's SAEs."""
        if not self.clamping:
            raise SAEError(
                "This request sets clamp, but the engine was built without sae_clamping=True "
                "(the clamp op is part of the compiled model); build it with sae_clamping=True."
            )
        for name, held in terms:
            sae = self.saes.get(name)
            if sae is None:
                raise SAEError(
                    f"clamp names SAE {name!r}, which this engine does not have; its SAEs are "
                    f"{sorted(self.saes)}."
                )
            wide = [f for f, _ in held if f >= sae.d_sae]
            if wide:
                raise SAEError(
                    f"clamp[{name!r}] names feature(s) {wide}, out of range: the SAE has "
                    f"{sae.d_sae} features."
                )
        return terms

    def clamp_salt(self, terms: Any) -> str:
        """The prefix-cache salt of a clamp: equal for equal clamps of the same SAEs."""
        digest = hashlib.sha256()
        for name, held in terms:
            digest.update(f"{self.saes[name].fingerprint}:{held!r};".encode())
        return "clamp-" + digest.hexdigest()[:32]

    def clamp_settings(self) -> list[list[Any]]:
        """The clamp ops the loader installs: ``[[name, layer, fingerprint], ...]`` (in the
        compile-cache key: a graph traced with one SAE's clamp is never replayed for
        another's)."""
        if not self.clamping:
            return []
        return [[name, sae.layer, sae.fingerprint] for name, sae in self.saes.items()]

    def slot(self, name: str) -> int:
        """The SAE's index in the worker's bank (the loader keeps this order)."""
        return list(self.saes).index(name)

    def loader_settings(self) -> dict[str, Any]:
        """What the workers' model loader reads the SAEs from (folders, not weights)."""
        return {
            "saes": {n: {"path": s.path, "layer": s.layer} for n, s in self.saes.items()},
            "k": self.k,
            "dtype": self.dtype,
        }

    def describe(self) -> dict[str, dict[str, Any]]:
        """What a store's run records of each SAE: which one (fingerprint, folder), what its
        features mean (layer, d_sae, architecture, settings) and the engine's k."""
        return {
            name: {
                "fingerprint": sae.fingerprint,
                "path": sae.path,
                "hook_name": sae.hook_name,
                "layer": sae.layer,
                "d_in": sae.d_in,
                "d_sae": sae.d_sae,
                "architecture": sae.architecture,
                "k": self.k,
                "settings": {**sae.settings, "engine_dtype": self.dtype},
            }
            for name, sae in self.saes.items()
        }

    def for_request(self, options: RequestOptions) -> RequestSAEs:
        """A request's ``saes`` (None or True: all; False or []: none; names) and
        ``sae_top_k`` (up to the engine's), checked."""
        names = select_names(options.saes, list(self.saes), "saes", "SAE", SAEError)
        k = self.k if options.sae_top_k is None else options.sae_top_k
        if k > self.k:
            raise SAEError(
                f"Per-request sae_top_k={k} is over the engine's sae_top_k={self.k}; ask for "
                f"at most {self.k}, or build the engine with a larger sae_top_k."
            )
        if options.monitors is None:
            monitors = tuple(m for m in self.monitors if m.sae in names)
        else:  # the request's own replace the engine's
            monitors = tuple(
                self._check_monitor(m) for m in options.monitors if isinstance(m, FeatureMonitor)
            )
            off = sorted({m.sae for m in monitors} - set(names))
            if off:
                raise SAEError(
                    f"This request's feature monitors watch SAE(s) {off}, which the request "
                    f"does not read (saes={list(names)}); add them to its saes."
                )
        return RequestSAEs(names, k, monitors)

    def features(self, packed: torch.Tensor, request: RequestSAEs) -> dict[str, SAEFeatures]:
        """``[len(request.names), n, 2K + 1]`` packed rows -> one :class:`SAEFeatures` per
        SAE, cut to the request's k."""
        return {
            name: SAEFeatures.unpack(rows, request.k)
            for name, rows in zip(request.names, packed, strict=True)
        }

    def empty(self, request: RequestSAEs) -> dict[str, SAEFeatures]:
        return {name: SAEFeatures.empty(request.k) for name in request.names}


def load_saes(saes: Any) -> dict[str, SAE]:
    """``saes=`` as given to an engine: a dict name -> SAE (or its folder), or a list of SAEs
    with names."""
    # A folder is read for its config and shapes only: the workers read the weights.
    loaded = load_named(saes, "saes", SAE, partial(SAE.load, weights=False), "SAE")
    for name in loaded:
        if ":" in name:  # a store keeps other readouts' instances as "<source>:<name>"
            raise CaptureConfigError(
                f"saes: the name {name!r} holds ':', which a store keeps for other readouts' "
                f"instances (\"lens:j@4\"); pass a name without ':', e.g. "
                f"{name.replace(':', '_')!r}."
            )
    return loaded
