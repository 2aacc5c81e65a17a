"""SAE clamping as an entry of the write table: ``LLM(saes=..., sae_clamping=True)`` installs a
clamp term after each SAE's layer (``probehook.worker.clamp_op``), and a request's
``{"clamp": {"NAME": {"FEATURE": VALUE}}}`` holds those features at those values on every token
of it. Registered as a third party's intervention would be (the ``probehook.output_processors``
entry point). No vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probehook.capture_config import as_int
from probehook.core.monitors import finite_number
from probehook.core.request_options import is_list, show
from probehook.errors import CaptureConfigError
from probehook.outputs.intervention import EngineFacts, Intervention
from probehook.saes.sae import SAEError

SAE_SOURCE = "sae"
MAX_CLAMPED = 16
"""Features one request may clamp per SAE (the worker's clamp table width)."""


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


def clamp_terms(value: Any, what: str) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """``{instance: {feature: value}}`` checked; returned as sorted pairs. A feature is an int
    or a string of ASCII digits (as JSON keys are; ``"²"`` or ``"٣"`` are not feature ids),
    named once per SAE (``"5"`` and ``"05"`` are one feature: refused, not summed); values
    are finite numbers; at most :data:`MAX_CLAMPED` features per SAE. The pair form the wire
    carries, ``{instance: [[feature, value], ...]}``, is read alike."""
    example = '{"res3": {"123": 0.0}}'
    if not isinstance(value, Mapping) or not value:
        raise CaptureConfigError(
            f"{what}={show(value)} is not valid: pass a non-empty dict of SAE names to "
            f"{{feature: value}}, such as {example}."
        )
    out = []
    for name, held in value.items():
        if not isinstance(name, str) or not name:
            raise CaptureConfigError(f"{what}: {show(name)} is not an SAE name; e.g. {example}.")
        items = _clamp_items(held)
        if items is None or not items:
            raise CaptureConfigError(
                f"{what}[{name!r}]={show(held)} is not valid: pass {{feature: value}}, "
                f"such as {example}."
            )
        if len(items) > MAX_CLAMPED:
            raise CaptureConfigError(
                f"{what}[{name!r}] clamps {len(items)} features; at most {MAX_CLAMPED} per SAE."
            )
        terms: dict[int, float] = {}
        keys: dict[int, Any] = {}
        for feature, target in items:
            index = _feature_index(feature)
            if index is None:
                raise CaptureConfigError(
                    f"{what}[{name!r}]: {show(feature)} is not a feature index (an int >= 0, "
                    f"or a string of ASCII digits); e.g. {example}."
                )
            if index in terms:
                raise CaptureConfigError(
                    f"{what}[{name!r}]: keys {keys[index]!r} and {feature!r} both name feature "
                    f"{index}; give each feature once, with the one value to hold it at."
                )
            terms[index] = finite_number(
                target,
                f"{what}[{name!r}][{feature!r}]",
                f"hold a feature at a value, e.g. {example}",
            )
            keys[index] = feature
        out.append((name, tuple(sorted(terms.items()))))
    return tuple(sorted(out))


def _clamp_items(held: Any) -> list[tuple[Any, Any]] | None:
    """The ``(feature, value)`` items of one SAE's clamp, a dict or a list of pairs (every
    pair kept, so a feature given twice is seen); None for anything else."""
    if isinstance(held, Mapping):
        return list(held.items())
    if not is_list(held):
        return None
    items = []
    for pair in held:
        if not is_list(pair) or len(pair) != 2:
            return None
        items.append((pair[0], pair[1]))
    return items


def _feature_index(feature: Any) -> int | None:
    """A clamp key as a feature index: a non-negative int (numpy's too) or a string of ASCII
    decimal digits; else None."""
    if isinstance(feature, str):
        return int(feature) if feature.isascii() and feature.isdigit() else None
    index = as_int(feature)
    return index if index is not None and index >= 0 else None
