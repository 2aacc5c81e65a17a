"""SAE features as one entry of the readout table: each token's top-k features of every SAE a
request reads, an ordinary :class:`~probehook.outputs.top_k_readout.TopKReadout` registered
through the ``probehook.output_processors`` entry point, as a third party's readout would be.

What it declares is all the engine knows of SAEs: the engine options (``saes=``,
``sae_top_k=``, ``sae_dtype=``, and ``probehook serve``'s ``--sae`` flags generated from them),
the request options (``saes``, ``sae_top_k``), the monitor (:class:`FeatureMonitor`, flags on
``feature_flags``), the worker's bank (:func:`probehook.worker.sae_bank.sae_bank`) and what a
store records of each SAE. Clamping is an entry of the write table
(:mod:`probehook.saes.clamp`). No vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from probehook.core.monitors import FEATURE_STOP_PREFIX, TopKMonitor, top_k_monitor
from probehook.errors import CaptureConfigError
from probehook.outputs.top_k_readout import TopKReadout
from probehook.saes.files import SAEError
from probehook.saes.sae import SAE

SOURCE = "sae"
"""The readout's source: its key on the wire, in the worker and in a store's segments."""
DEFAULT_TOP_K = 32
ENCODER_DTYPES = (None, "float32", "bfloat16", "float16")


@top_k_monitor
@dataclass(frozen=True)
class FeatureMonitor(TopKMonitor):
    """Stop or flag generation when feature ``feature`` of SAE ``sae`` crosses ``threshold``.

    The watched value is the feature's activation where it is among the token's top features
    at the engine's ``sae_top_k`` (whatever k the request keeps: the worker and the front end
    read the same values), 0 where it is not. So ``direction="below"`` fires on every token
    where the feature is outside the engine's top-k, active below the cut or not. The same rule
    as :class:`~probehook.ProbeMonitor`, on the same rows (each decode row: the state that
    produces the next token): ``"stop"`` ends the completion at the first crossing (its
    ``stop_reason`` is ``"feature:<sae>:<feature>"``), ``"flag"`` lists every crossing row in
    ``CompletionOutput.feature_flags["<sae>:<feature>"]``.
    """

    sae: str
    feature: int
    threshold: float
    action: str = "flag"
    direction: str = "above"

    def __post_init__(self) -> None:
        if not isinstance(self.sae, str) or not self.sae:
            raise CaptureConfigError(f"FeatureMonitor sae={self.sae!r} must be an SAE name.")
        if isinstance(self.feature, bool) or not isinstance(self.feature, int | np.integer):
            raise CaptureConfigError(
                f"FeatureMonitor feature={self.feature!r} must be a feature index (an int)."
            )
        object.__setattr__(self, "feature", int(self.feature))
        if self.feature < 0:
            raise CaptureConfigError(f"FeatureMonitor feature={self.feature} is negative.")
        self._check_action(f"FeatureMonitor({self.sae!r}, {self.feature})")

    source: ClassVar[str] = SOURCE
    """The top-k rows it watches (the worker's SAE features)."""
    outside: ClassVar[float] = 0.0
    """Its value where the feature is not among the engine's top k."""
    marker: ClassVar[str] = "sae"
    required: ClassVar[tuple[str, ...]] = ("sae", "feature", "threshold")
    watches: ClassVar[str] = "SAE features"
    stop_prefix: ClassVar[str] = FEATURE_STOP_PREFIX

    @property
    def instance(self) -> str:
        """The SAE it watches (its slot in the worker's bank goes with it on the wire)."""
        return self.sae

    @property
    def entry(self) -> int:
        """The entry of the SAE's top-k rows it watches (as a lens monitor's token)."""
        return self.feature

    @property
    def key(self) -> str:
        """Its name in ``feature_flags``: ``"<sae>:<feature>"``."""
        return f"{self.sae}:{self.feature}"


class SAEReadout(TopKReadout):
    """The ``saes={name: SAE or folder}`` engine option (``sae_top_k=k``, ``sae_dtype``;
    ``sae_clamping`` is the write table's entry :class:`~probehook.saes.clamp.SAEClamp`)
    and the ``saes`` / ``sae_top_k`` request options; outputs'
    ``sae_features`` and ``prefill_sae_features``."""

    name = "sae_features"
    view_name = "sae"
    source = SOURCE
    request_attributes = ("prefill_sae_features",)
    completion_attributes = ("sae_features",)
    engine_option = "saes"
    request_option = "saes"
    extra_engine_options = ("sae_dtype",)
    default_k = DEFAULT_TOP_K
    max_k = 4096
    top_k_option = "sae_top_k"
    monitor = FeatureMonitor
    flags_attribute = "feature_flags"
    # Rank 0 reads every row; the others read only the rows a stop monitor watches (every
    # rank samples, so each forces the stop itself).
    ranks = "rank 0, and the stops elsewhere"
    worker_bank = "probehook.worker.sae_bank:sae_bank"
    stored_prefix = ""  # stores name SAE features by the SAE's own name (format 1 on)
    instance_error = SAEError
    instance_noun = "SAE"

    cli_flag = "sae"
    cli_help = {
        "saes": "an SAE folder (SAELens or sparsify) requests may ask features of "
        '("probehook": {"saes": ["NAME"]}); repeatable',
        "sae_top_k": f"the most SAE features a token returns (default {DEFAULT_TOP_K}; a request "
        "may ask fewer)",
        "sae_dtype": "the SAE encoder GEMM's dtype in the worker (default: each SAE's own)",
    }
    cli_choices = {"sae_dtype": tuple(d for d in ENCODER_DTYPES if d is not None)}

    def named_specs(self, value: Any) -> dict[str, Any]:
        """``saes=`` as given: a dict name -> SAE (or its folder), or a list of named SAEs;
        a folder is read for its config and shapes only (the workers read the weights)."""
        return load_saes(value)

    def instances(
        self,
        specs: Mapping[str, Any],
        extras: Mapping[str, Any],
        *,
        num_layers: int,
        hidden_size: int,
        model_name: str | None = None,
    ) -> dict[str, dict]:
        dtype = extras.get("sae_dtype")
        if dtype not in ENCODER_DTYPES:
            raise SAEError(
                f"sae_dtype={dtype!r} is not an encoder dtype; choose one of {ENCODER_DTYPES} "
                "(None: each SAE's own)."
            )
        out = {}
        for name, sae in load_saes(specs).items():
            sae.check_model(hidden_size, num_layers, name)
            if sae.path is None:
                raise SAEError(
                    f"SAE {name!r} has no folder: the engine's workers read SAEs from disk. "
                    "Load it with SAE.load(folder)."
                )
            out[name] = {
                "layer": sae.layer,
                "path": os.fspath(sae.path),
                "dtype": dtype,
                "fingerprint": sae.fingerprint,
                "hook_name": sae.hook_name,
                "d_in": sae.d_in,
                "d_sae": sae.d_sae,
                "architecture": sae.architecture,
                "settings": {**sae.settings, "engine_dtype": dtype},
            }
        return out

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        return int(settings["d_sae"])

    def worker_bytes(self, specs: Mapping[str, Any]) -> int:
        """What the SAEs will hold in each worker (their encoders)."""
        return sum(sae.nbytes for sae in load_saes(specs).values())

    def check_entry(self, monitor: Any, settings: Mapping[str, Any]) -> None:
        if monitor.feature >= int(settings["d_sae"]):
            raise SAEError(
                f"FeatureMonitor feature={monitor.feature} is out of range: SAE "
                f"{monitor.sae!r} has {settings['d_sae']} features (0..{settings['d_sae'] - 1})."
            )

    def describe_instance(self, name: str, settings: Mapping[str, Any], k: int) -> dict[str, Any]:
        """What a store's run records of an SAE: which one (fingerprint, folder), what its
        features mean (layer, d_sae, architecture, settings) and the engine's k."""
        return {
            "fingerprint": settings["fingerprint"],
            "path": settings["path"],
            "hook_name": settings["hook_name"],
            "layer": settings["layer"],
            "d_in": settings["d_in"],
            "d_sae": settings["d_sae"],
            "architecture": settings["architecture"],
            "k": k,
            "settings": settings["settings"],
        }


def load_saes(saes: Any) -> dict[str, SAE]:
    """``saes=`` as given to an engine: a dict name -> SAE (or its folder), or a list of SAEs
    with names."""
    from probehook.core.named import load_named

    loaded = load_named(saes, "saes", SAE, lambda path: SAE.load(path, weights=False), "SAE")
    for name in loaded:
        if ":" in name:  # a store keeps other readouts' instances as "<source>:<name>"
            raise CaptureConfigError(
                f"saes: the name {name!r} holds ':', which a store keeps for other readouts' "
                f"instances (\"lens:j@4\"); pass a name without ':', e.g. "
                f"{name.replace(':', '_')!r}."
            )
    return loaded
