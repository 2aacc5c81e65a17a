"""SAE clamping as an entry of the write table: ``LLM(saes=..., sae_clamping=True)`` installs a
clamp term after each SAE's layer (``probehook.worker.clamp_op``), and a request's
``{"clamp": {"NAME": {"FEATURE": VALUE}}}`` holds those features at those values on every token
of it. Registered as a third party's intervention would be (the ``probehook.output_processors``
entry point). No vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probehook.core.request_options import clamp_terms
from probehook.errors import CaptureConfigError
from probehook.outputs.intervention import EngineFacts, Intervention
from probehook.saes.sae import SAEError

SAE_SOURCE = "sae"


class SAEClamp(Intervention):
    """Holds SAE features at values: the ``sae_clamping`` engine option (with ``saes=``) and
    the ``clamp`` request option; what a completion held is its ``steering["clamp"]``."""

    name = "sae_clamp"
    engine_option = "sae_clamping"
    request_option = "clamp"
    kind = "clamp"
    worker_writer = "probehook.worker.clamp_op:clamp_writers"
    cli_switch = True
    cli_help = (
        'let requests hold SAE features at values ("probehook": {"clamp": {"NAME": {"FEATURE": '
        "VALUE}}}): a clamp op on each SAE's layer"
    )
    instance_error = SAEError

    def instances(self, value: Any, engine: EngineFacts) -> dict[str, dict[str, Any]]:
        """Each of the engine's SAEs, clamped after its layer (``sae_clamping=True``)."""
        if not isinstance(value, bool):
            raise CaptureConfigError(f"sae_clamping={value!r} is not valid: pass True or False.")
        if not value:
            return {}
        saes = engine.readouts.get(SAE_SOURCE)
        if saes is None:
            raise CaptureConfigError(
                "sae_clamping=True clamps the engine's SAEs, but it has none: pass "
                "saes={name: SAE or folder} too (or drop sae_clamping)."
            )
        return {
            name: {"layer": int(s["layer"]), "site": "resid_post", "source": SAE_SOURCE,
                   "fingerprint": str(s["fingerprint"]), "d_sae": int(s["d_sae"])}
            for name, s in saes.instances.items()
        }  # fmt: skip

    def check_terms(self, value: Any, instances: Mapping[str, Mapping[str, Any]]) -> dict:
        """``{sae: {feature: value}}`` checked (:func:`clamp_terms`) against the engine's SAEs;
        ``{sae: [[feature, value], ...]}``, features ascending."""
        terms = clamp_terms(value, "probehook option clamp")
        for name, held in terms:
            settings = instances.get(name)
            if settings is None:
                raise SAEError(
                    f"clamp names SAE {name!r}, which this engine does not have; its SAEs are "
                    f"{sorted(instances)}."
                )
            d_sae = int(settings["d_sae"])
            wide = [f for f, _ in held if f >= d_sae]
            if wide:
                raise SAEError(
                    f"clamp[{name!r}] names feature(s) {wide}, out of range: the SAE has "
                    f"{d_sae} features."
                )
        return {name: [[f, v] for f, v in held] for name, held in terms}

    def applied(self, terms: Mapping[str, Any]) -> dict[str, dict[str, float]]:
        """``{sae: {"feature": value}}``: the features held, on every token."""
        return {name: {str(f): v for f, v in held} for name, held in terms.items()}

    def mark(self, applied: Any) -> str:
        return "; ".join(
            f"clamped {sae} {', '.join(f'#{k}={v:g}' for k, v in held.items())} on every token"
            for sae, held in applied.items()
        )
