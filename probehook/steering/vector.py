"""``SteeringVector``: one residual-stream direction per layer, made offline, saved as one file.

A steering vector holds a float32 ``[hidden]`` direction for each of one or more decoder layers
and the op the engine applies with it to the layer's output residual stream (``resid_post``):
``add`` (``h + scale * vector(layer)``, the default) or one of ``ablate``, ``cap``,
``orthogonal``, ``norm_scaled``, ``swap`` (:meth:`SteeringVector.with_op`,
:meth:`SteeringVector.swap`; the formulas are in ``probehook.core.steering_ops``). This module
only builds, checks and stores them (no vLLM here). Ways to make one:

* by hand: ``SteeringVector({12: tensor}, "name")``;
* from an activation store, by contrast (:meth:`SteeringVector.from_store`): the mean of the
  positive requests' rows minus the mean of the negative requests' rows at one layer;
* from a binary :class:`~probehook.probes.LinearProbe` (:meth:`SteeringVector.from_probe`).

:func:`mean_residual_norm` measures the typical norm of a layer's rows, to pick a scale.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import operator
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from probehook.core.steering_ops import OPS, SITE, describe_op
from probehook.errors import CaptureConfigError

if TYPE_CHECKING:
    from probehook.probes.linear import LinearProbe
    from probehook.probes.rows import Labels
    from probehook.store import ActivationStore

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode")
TOKENS = ("all", "last")
"""Rows ``from_store`` averages: every row of a request, or its last (one per completion)."""
BLOCK_BYTES = 32 << 20
"""Rows are read from a store this many bytes (as float32) at a time."""
NORM_WINDOWS = 16
"""``mean_residual_norm`` reads a large layer in this many evenly spaced contiguous windows."""
MAX_IDS_SHOWN = 5

ArrayLike = torch.Tensor | np.ndarray


class SteeringVector:
    """A ``[hidden]`` float32 direction for each of one or more layers.

    ``vectors`` maps a layer index (an ``int``, numpy integers too) to a 1-D tensor or array;
    every layer's vector must have the same length (the model's hidden size) and finite values.
    ``name`` labels it in reprs, files and logs. ``model_fingerprint`` is the fingerprint of the
    model it was made from (an activation store's ``meta["model_fingerprint"]``), checked by
    :meth:`check_model`. ``made_by`` says how it was made (JSON-serialisable). Bad input raises
    :class:`~probehook.errors.CaptureConfigError` naming the bad value.

    The object is immutable: :meth:`vector` and :attr:`vectors` return copies, and
    :meth:`scaled` / :meth:`with_name` return new vectors.
    """

    def __init__(
        self,
        vectors: Mapping[int, ArrayLike | Sequence[float]],
        name: str | None = None,
        *,
        model_fingerprint: str | None = None,
        made_by: dict[str, Any] | None = None,
        op: str = "add",
        op_params: Mapping[str, Any] | None = None,
        swap_to: Mapping[int, ArrayLike | Sequence[float]] | None = None,
    ) -> None:
        if not isinstance(vectors, Mapping):
            raise CaptureConfigError(
                f"vectors must be a dict from layer index to a [hidden] vector, got "
                f"{type(vectors).__name__}."
            )
        if not vectors:
            raise CaptureConfigError(
                "vectors is empty: a steering vector needs a [hidden] vector for at least one "
                "layer, e.g. SteeringVector({12: direction})."
            )
        if name is not None and not isinstance(name, str):
            raise CaptureConfigError(f"name must be a string or None, got {name!r}.")
        if name == "":
            raise CaptureConfigError("name is the empty string; give a name or leave it None.")
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise CaptureConfigError(
                f"model_fingerprint must be a string or None, got {model_fingerprint!r}."
            )
        checked: dict[int, torch.Tensor] = {}
        first: int | None = None
        for key, value in vectors.items():
            layer = _layer_index(key)
            if layer in checked:
                raise CaptureConfigError(f"layer {layer} is given twice (as {key!r}).")
            vec = _vector(layer, value)
            if first is not None and len(vec) != len(checked[first]):
                raise CaptureConfigError(
                    f"layer {layer}'s vector has {len(vec)} values but layer {first}'s has "
                    f"{len(checked[first])}: every layer's vector has the model's hidden size."
                )
            first = layer if first is None else first
            checked[layer] = vec
        self._vectors = dict(sorted(checked.items()))
        self._name = name
        self._model_fingerprint = model_fingerprint
        self._made_by = _json_copy("made_by", {} if made_by is None else made_by)
        self._digest: str | None = None
        self._op, self._op_params, self._to = _checked_op(
            op, op_params or {}, self._vectors, swap_to, self._label()
        )

    # -- fields -------------------------------------------------------------------------------

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers it steers, ascending."""
        return tuple(self._vectors)

    @property
    def hidden_size(self) -> int:
        return len(next(iter(self._vectors.values())))

    @property
    def model_fingerprint(self) -> str | None:
        return self._model_fingerprint

    @property
    def made_by(self) -> dict[str, Any]:
        """How it was made (a copy): ``method`` (``"mean_difference"``, ``"probe"``; absent for a
        hand-made vector) and that method's inputs; ``scale`` after :meth:`scaled`."""
        return json.loads(json.dumps(self._made_by))

    @property
    def op(self) -> str:
        """What the engine applies with it: one of :data:`~probehook.core.steering_ops.OPS`."""
        return self._op

    @property
    def op_params(self) -> dict[str, Any]:
        """The op's parameters (``cap``: ``min`` and ``max``, either may be None)."""
        return dict(self._op_params)

    @property
    def site(self) -> str:
        """Where it applies: ``"resid_post"``, the layer's output stream."""
        return SITE

    @property
    def swap_to(self) -> dict[int, torch.Tensor]:
        """A ``swap``'s ``to`` directions by layer (copies; empty for other ops); its ``from``
        directions are :attr:`vectors`."""
        return {layer: vec.clone() for layer, vec in (self._to or {}).items()}

    def vector(self, layer: int) -> torch.Tensor:
        """The float32 ``[hidden]`` vector of ``layer`` (a copy)."""
        key = _layer_index(layer)
        if key not in self._vectors:
            raise KeyError(
                f"steering vector {self._label()} has no layer {layer!r}; its layers are "
                f"{list(self.layers)}."
            )
        return self._vectors[key].clone()

    @property
    def vectors(self) -> dict[int, torch.Tensor]:
        """``{layer: float32 [hidden]}`` (copies), layers ascending."""
        return {layer: vec.clone() for layer, vec in self._vectors.items()}

    @property
    def digest(self) -> str:
        """Hex SHA-256 of the content: each layer's index and hidden size, then its vector as
        little-endian float32 bytes, layers ascending. The name, fingerprint and ``made_by`` are
        not part of it; the op, its parameters and a swap's ``to`` directions are (for every
        op but ``add``): equal digests mean the engine applies the same values."""
        if self._digest is None:
            h = hashlib.sha256(b"probehook-steering-v1\n")
            for layer, vec in self._vectors.items():
                h.update(f"{layer}:{len(vec)}\n".encode())
                h.update(vec.numpy().astype("<f4", copy=False).tobytes())
            if self._op != "add":  # an addition's digest is what it was before the other ops
                h.update(json.dumps([self._op, self._op_params], sort_keys=True).encode())
                for layer, vec in (self._to or {}).items():
                    h.update(f"to {layer}\n".encode())
                    h.update(vec.numpy().astype("<f4", copy=False).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def norm(self, layer: int) -> float:
        """The L2 norm of ``layer``'s vector."""
        return float(torch.linalg.vector_norm(self.vector(layer).double()))

    # -- new vectors --------------------------------------------------------------------------

    def scaled(self, factor: float) -> SteeringVector:
        """A copy with every layer's vector multiplied by ``factor`` (``made_by["scale"]``
        records the product of all factors applied)."""
        number = int | float | np.integer | np.floating
        if isinstance(factor, bool) or not isinstance(factor, number):
            raise CaptureConfigError(f"factor must be a number, got {factor!r}.")
        factor = float(factor)
        if not math.isfinite(factor):
            raise CaptureConfigError(f"factor={factor}; it must be finite.")
        made_by = dict(self._made_by)
        made_by["scale"] = float(made_by.get("scale", 1.0)) * factor
        vectors = {layer: (vec.double() * factor).float() for layer, vec in self._vectors.items()}
        return self._copy(vectors=vectors, made_by=made_by)

    def with_name(self, name: str | None) -> SteeringVector:
        """A copy named ``name``."""
        return self._copy(name=name)

    def with_op(
        self, op: str, *, min: float | None = None, max: float | None = None
    ) -> SteeringVector:  # noqa: A002
        """A copy the engine applies with ``op`` at each layer, ``u`` the vector's unit
        direction and ``s`` the request's scale:

        - ``"add"``: ``h + s v`` (the default);
        - ``"ablate"``: ``h - s (h.u) u`` (``s = 1`` removes the component along ``u``);
        - ``"cap"``: ``h + s (clamp(h.u, min, max) - h.u) u`` (``s = 1`` holds the projection
          inside ``[min, max]``; give ``min``, ``max`` or both);
        - ``"orthogonal"``: ``h + (s - 1)(h.u) u`` (``s = 0`` removes the component, ``s = 1``
          leaves ``h``);
        - ``"norm_scaled"``: ``h + s |h| u`` (the push grows with the row's norm).

        ``swap`` takes two directions: :meth:`swap`. Every op but ``add`` divides by the
        vector's norm, so a zero vector is refused."""
        if op == "swap":
            raise CaptureConfigError(
                f"with_op('swap') on steering vector {self._label()}: a swap moves one "
                "direction onto another; make it with SteeringVector.swap(from_=..., to=...)."
            )
        if self._op == "swap":
            raise CaptureConfigError(
                f"steering vector {self._label()} is a swap; take its directions "
                "(SteeringVector(v.vectors) and SteeringVector(v.swap_to)) to use another op."
            )
        params = {"min": min, "max": max} if op == "cap" else {}
        if op != "cap" and (min is not None or max is not None):
            raise CaptureConfigError(
                f"with_op({op!r}, min={min!r}, max={max!r}): only 'cap' takes min and max."
            )
        return self._copy(op=op, op_params=params)

    @classmethod
    def swap(
        cls, from_: SteeringVector, to: SteeringVector, name: str | None = None
    ) -> SteeringVector:
        """A vector that moves the component of each row along ``from_`` onto ``to``:
        ``h + s (h.u_from)(u_to - u_from)`` (``s = 1``: the ``from`` component becomes the
        same amount along ``to``). Both need the same layers and hidden size."""
        for what, vector in (("from_", from_), ("to", to)):
            if not isinstance(vector, SteeringVector):
                raise CaptureConfigError(
                    f"SteeringVector.swap: {what} is a {type(vector).__name__}; pass a "
                    "SteeringVector."
                )
        if from_.layers != to.layers or from_.hidden_size != to.hidden_size:
            raise CaptureConfigError(
                f"SteeringVector.swap: from_ has layers {list(from_.layers)} (hidden "
                f"{from_.hidden_size}) but to has layers {list(to.layers)} (hidden "
                f"{to.hidden_size}); both need the same layers and hidden size."
            )
        made_by = {"method": "swap", "from": from_.name, "to": to.name}
        return cls(from_.vectors, name or _swap_name(from_, to), made_by=made_by,
                   model_fingerprint=from_.model_fingerprint or to.model_fingerprint,
                   op="swap", swap_to=to.vectors)  # fmt: skip

    def _copy(self, **changes: Any) -> SteeringVector:
        fields = {"vectors": self._vectors, "name": self._name, "made_by": self._made_by,
                  "model_fingerprint": self._model_fingerprint, "op": self._op,
                  "op_params": self._op_params, "swap_to": self._to}  # fmt: skip
        fields.update(changes)
        return SteeringVector(**fields)

    # -- checks -------------------------------------------------------------------------------

    def check_model(self, num_layers: int, hidden_size: int, model_fingerprint: str | None) -> None:
        """Raise :class:`~probehook.errors.CaptureConfigError` if the model lacks one of the
        layers or has another hidden size; warn (and log) if both fingerprints are known and
        differ (same shapes, maybe another model)."""
        beyond = [layer for layer in self._vectors if layer >= num_layers]
        if beyond:
            raise CaptureConfigError(
                f"steering vector {self._label()} has layer {beyond[0]}, but the model has "
                f"{num_layers} decoder layers (0..{num_layers - 1}): it was made for another "
                "model."
            )
        if hidden_size != self.hidden_size:
            raise CaptureConfigError(
                f"steering vector {self._label()} has hidden size {self.hidden_size}, but the "
                f"model's hidden size is {hidden_size}: it was made for another model."
            )
        if (
            self._model_fingerprint is not None
            and model_fingerprint is not None
            and self._model_fingerprint != model_fingerprint
        ):
            message = (
                f"steering vector {self._label()} was made from a model with fingerprint "
                f"{self._model_fingerprint}, but this model's is {model_fingerprint}; its "
                "direction may mean nothing here."
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)

    # -- files --------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write one safetensors file: a tensor ``layer.<L>`` per layer, the rest as JSON under
        the metadata key ``probehook_steering``; atomic (a crash never leaves half a file).
        Returns the path."""
        from probehook.steering.file import save_vector

        return save_vector(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SteeringVector:
        """Read a file written by :meth:`save`. A missing file is a ``FileNotFoundError``; a
        damaged or foreign one a :class:`~probehook.errors.CaptureConfigError` naming it."""
        from probehook.steering.file import load_vector

        return load_vector(path)

    # -- making -------------------------------------------------------------------------------

    @classmethod
    def from_store(
        cls,
        store: ActivationStore | str | os.PathLike[str],
        layer: int,
        positive: Sequence[str] | None = None,
        negative: Sequence[str] | None = None,
        *,
        labels: Labels | None = None,
        positive_label: Any = True,
        negative_label: Any = False,
        phase: str = "decode",
        token: str = "all",
        name: str | None = None,
    ) -> SteeringVector:
        """Contrastive activation addition: the mean of the positive requests' rows at ``layer``
        minus the mean of the negative requests' rows (each mean over rows, float64).

        Say which requests are which either by store ids, ``positive=[...]`` and
        ``negative=[...]``, or by ``labels`` exactly as in ``LinearProbe.fit`` (a dict from store
        id to label, or a callable taking a ``StoredRequest``): requests labelled
        ``positive_label`` (default ``True``) are positive, ``negative_label`` (default
        ``False``) negative, any other label (``None`` too) is left out. A labels dict must have
        an entry for every request with rows there, as in ``LinearProbe.fit``.

        ``phase``: ``"decode"`` (generated tokens' rows) or ``"prefill"`` (prompt rows, if
        captured). ``token``: ``"all"`` (every row of a request) or ``"last"`` (its last row,
        one per completion for decode). Rows stream from the store; memory stays bounded.
        ``store`` is an ``ActivationStore`` or its path. ``made_by`` records the method, layer,
        phase, token, request and row counts and the store path; the vector carries the store's
        model fingerprint.
        """
        from probehook.store import ActivationStore

        if phase not in PHASES:
            raise CaptureConfigError(f"phase={phase!r}; valid phases are {PHASES}.")
        if token not in TOKENS:
            raise CaptureConfigError(
                f"token={token!r}; from_store averages rows with token in {TOKENS}."
            )
        layer_index = _layer_index(layer)
        classify = _classifier(positive, negative, labels, positive_label, negative_label)
        if not isinstance(store, ActivationStore):
            with ActivationStore.open(store) as opened:
                return cls.from_store(
                    opened,
                    layer_index,
                    positive,
                    negative,
                    labels=labels,
                    positive_label=positive_label,
                    negative_label=negative_label,
                    phase=phase,
                    token=token,
                    name=name,
                )
        sums, counts, requests = _class_sums(store, layer_index, phase, token, classify)
        pos_mean = sums[0] / counts[0]
        neg_mean = sums[1] / counts[1]
        made_by = {
            "method": "mean_difference",
            "layer": layer_index,
            "phase": phase,
            "token": token,
            "n_positive_requests": requests[0],
            "n_negative_requests": requests[1],
            "n_positive_rows": counts[0],
            "n_negative_rows": counts[1],
            "store": str(store.root),
        }
        if labels is not None:
            made_by["positive_label"] = _jsonable(positive_label)
            made_by["negative_label"] = _jsonable(negative_label)
        return cls(
            {layer_index: (pos_mean - neg_mean).float()},
            name,
            model_fingerprint=store.meta.get("model_fingerprint"),
            made_by=made_by,
        )

    @classmethod
    def from_lens(
        cls,
        lens: Any,
        layer: int,
        token: int | str,
        *,
        model: str | os.PathLike[str] | None = None,
        scale: float = 1.0,
        name: str | None = None,
    ) -> SteeringVector:
        """The lens's vector of ``token`` at ``layer`` (row ``token`` of ``W_U M``, ``M`` the
        lens's map there: the J-lens vector for a :class:`~probehook.JacobianLens`, the
        unembedding row for ``"logit"``), ``scale`` times, at ``layer``: adding it moves what
        the lens reads there toward ``token``. ``W_U`` is read from ``model``'s checkpoint
        folder (default: the model the lens records it was fitted on); ``token`` an id or a
        one-token string."""
        from probehook.lenses.artifacts import load_lens
        from probehook.lenses.vectors import lens_vectors

        lens = load_lens(lens)
        if model is None and not isinstance(lens, str):
            recorded = getattr(lens, "metadata", None) or getattr(lens, "config", {})
            model = recorded.get("model_name") or recorded.get("base_model_name_or_path")
        if model is None or not Path(model).is_dir():
            raise CaptureConfigError(
                f"SteeringVector.from_lens needs the model's checkpoint folder for its "
                f"unembedding: pass model=PATH (got {model!r})."
            )
        vector = lens_vectors(lens, int(layer), [token], model)[0] * float(scale)
        made_by = {
            "method": "lens",
            "lens": lens if isinstance(lens, str) else lens.kind,
            "lens_path": None if isinstance(lens, str) else lens.path,
            "layer": int(layer),
            "token": token,
            "scale": float(scale),
        }
        return cls({int(layer): vector}, name, made_by=made_by)

    @classmethod
    def from_sae(
        cls, sae: Any, features: Mapping[int, float], name: str | None = None
    ) -> SteeringVector:
        """``sum(scale * W_dec[f])`` over ``features`` (``{feature: scale}``) at the SAE's layer:
        adding it writes each feature's decoder direction into the residual stream, ``scale``
        times (a feature's own activation adds ``a * W_dec[f]`` in the SAE's reconstruction,
        so ``scale`` is in activation units). Steer with it as with any vector
        (``extra_args={"probehook": {"steer": {name: 1.0}}}``)."""
        from probehook.saes import SAE, SAEError

        if not isinstance(sae, SAE):
            raise CaptureConfigError(
                f"sae must be a probehook.SAE, got {type(sae).__name__}; load one with "
                "SAE.load(folder)."
            )
        if not isinstance(features, Mapping) or not features:
            raise CaptureConfigError(
                f"features={features!r} must be a non-empty dict {{feature index: scale}}."
            )
        sae.check_weights("SteeringVector.from_sae")
        assert sae.W_dec is not None
        total = torch.zeros(sae.d_in, dtype=torch.float64)
        for feature, scale in features.items():
            if isinstance(feature, bool) or not isinstance(feature, int | np.integer):
                raise SAEError(f"feature {feature!r} is not a feature index (an int).")
            if not 0 <= int(feature) < sae.d_sae:
                raise SAEError(
                    f"feature {feature} is out of range: the SAE has {sae.d_sae} features."
                )
            if isinstance(scale, bool) or not isinstance(scale, int | float | np.number):
                raise SAEError(f"the scale of feature {feature} is {scale!r}, not a number.")
            total += float(scale) * sae.W_dec[int(feature)].double()
        made_by = {
            "method": "sae",
            "sae_fingerprint": sae.fingerprint,
            "sae_path": sae.path,
            "layer": sae.layer,
            "features": {str(int(f)): float(v) for f, v in features.items()},
        }
        return cls({sae.layer: total.float()}, name, made_by=made_by)

    @classmethod
    def from_probe(
        cls, probe: LinearProbe, name: str | None = None, unit: bool = True
    ) -> SteeringVector:
        """The direction of a binary probe in the raw residual space, at the probe's layer.

        The probe's input normalisation is folded in: its logit is ``w·((x - mean)/std) + b``,
        so the raw direction is ``w / std`` (``probe.linear()``'s weight), and ``vector·x`` equals
        the logit minus a constant. It points toward the probe's positive label
        (``label_names[1]``). ``unit=True`` (the default) divides it by its L2 norm, so the
        vector has norm 1 and the engine's scale is the size of the step; ``unit=False`` keeps
        the probe's own length. ``name`` defaults to the probe's name. Multiclass and regression
        probes are refused.
        """
        from probehook.probes.linear import LinearProbe

        if not isinstance(probe, LinearProbe):
            raise CaptureConfigError(
                f"probe must be a LinearProbe, got {type(probe).__name__}; load one with "
                "LinearProbe.load(path)."
            )
        if probe.kind != "binary":
            raise CaptureConfigError(
                f"probe {probe.name or ''!s} is a {probe.kind} probe; only a binary probe has "
                "one direction (a multiclass probe has one per class: build a vector by hand "
                "from probe.linear()[0][k], or use from_store)."
            )
        weight = probe.linear()[0][0].double()
        norm = float(torch.linalg.vector_norm(weight))
        if unit:
            if norm == 0.0:
                raise CaptureConfigError(
                    f"probe {probe.name!r}'s weight is all zeros: it has no direction to normalise."
                )
            weight = weight / norm
        made_by = {
            "method": "probe",
            "probe_name": probe.name,
            "layer": probe.layer,
            "phase": probe.phase,
            "token": probe.token,
            "positive_label": None if probe.label_names is None else probe.label_names[1],
            "unit": bool(unit),
            "probe_norm": norm,
        }
        return cls(
            {probe.layer: weight.float()},
            probe.name if name is None else name,
            model_fingerprint=probe.model_fingerprint,
            made_by=made_by,
        )

    # -- display ------------------------------------------------------------------------------

    def _label(self) -> str:
        return repr(self._name) if self._name else f"(layers {list(self.layers)})"

    def __repr__(self) -> str:
        parts = [f"name={self._name!r}"] if self._name else []
        parts += [f"layers={list(self.layers)}", f"hidden={self.hidden_size}"]
        norms = ", ".join(f"{layer}: {self.norm(layer):.4g}" for layer in self.layers[:4])
        parts.append(f"norm={{{norms}{', ...' if len(self.layers) > 4 else ''}}}")
        if "method" in self._made_by:
            parts.append(f"method={self._made_by['method']!r}")
        if "scale" in self._made_by:
            parts.append(f"scale={self._made_by['scale']:.4g}")
        if self._op != "add":
            parts.append(f"op={describe_op(self._op, self._op_params)!r}")
        return f"SteeringVector({', '.join(parts)})"


def mean_residual_norm(
    store: ActivationStore | str | os.PathLike[str],
    layer: int,
    phase: str = "decode",
    limit: int = 65536,
) -> float:
    """The mean L2 norm of ``layer``'s rows in ``store`` (float64), to choose a steering scale
    as a multiple of the typical residual norm.

    Reads at most ``limit`` rows: all of them if the layer has no more, else ``limit`` rows in
    16 evenly spaced contiguous windows across the store. ``store`` is an ``ActivationStore``
    or its path.
    """
    from probehook.store import ActivationStore

    if phase not in PHASES:
        raise CaptureConfigError(f"phase={phase!r}; valid phases are {PHASES}.")
    if isinstance(limit, bool) or not isinstance(limit, int | np.integer) or limit < 1:
        raise CaptureConfigError(f"limit must be a positive number of rows, got {limit!r}.")
    layer_index = _layer_index(layer)
    if not isinstance(store, ActivationStore):
        with ActivationStore.open(store) as opened:
            return mean_residual_norm(opened, layer_index, phase, limit)
    matrix = _matrix(store, layer_index, phase, "all")
    n = len(matrix)
    limit = int(limit)
    if n <= limit:
        windows = [(0, n)]
    else:
        k = min(NORM_WINDOWS, limit)
        size = limit // k
        starts = np.linspace(0, n - size, k).astype(np.int64)
        windows = [(int(s), int(s) + size) for s in starts]
    block = max(1, BLOCK_BYTES // (4 * store.hidden_size))
    total, count = 0.0, 0
    for begin, end in windows:
        for lo in range(begin, end, block):
            rows = matrix[lo : min(lo + block, end)].double()
            total += float(torch.linalg.vector_norm(rows, dim=1).sum())
            count += len(rows)
    return total / count


# -- helpers ------------------------------------------------------------------------------------


def _layer_index(key: Any) -> int:
    """A layer index: a non-negative integer of any integer type; ``bool`` is not one."""
    layer = None
    if not isinstance(key, bool):
        try:
            layer = operator.index(key)
        except TypeError:
            layer = None
    if layer is None:
        raise CaptureConfigError(
            f"layer {key!r} ({type(key).__name__}) is not an integer; layers are decoder layer "
            "indices 0, 1, ..."
        )
    if layer < 0:
        raise CaptureConfigError(
            f"layer {layer} is negative; steering vectors take absolute decoder layer indices "
            "(0 is the first layer)."
        )
    return int(layer)


def _vector(layer: int, value: Any) -> torch.Tensor:
    """A CPU float32 contiguous copy of one layer's vector: 1-D, non-empty, finite."""
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as e:
        raise CaptureConfigError(
            f"layer {layer}'s vector must be a tensor or array of numbers: {e}"
        ) from e
    if t.dtype == torch.bool or t.is_complex() or not (t.is_floating_point() or _is_int(t)):
        raise CaptureConfigError(f"layer {layer}'s vector must be real numbers, got {t.dtype}.")
    if t.ndim != 1:
        raise CaptureConfigError(
            f"layer {layer}'s vector has shape {tuple(t.shape)}; it must be 1-D [hidden] (one "
            "direction per layer)."
        )
    if len(t) == 0:
        raise CaptureConfigError(f"layer {layer}'s vector is empty; it must be [hidden].")
    t = t.detach().to("cpu", torch.float32).contiguous().clone()
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise CaptureConfigError(
            f"layer {layer}'s vector has {int(bad.sum())} NaN or infinite value(s) (first at "
            f"index {int(bad.nonzero()[0, 0])}, after conversion to float32)."
        )
    return t


def _checked_op(
    op: Any,
    params: Mapping[str, Any],
    vectors: Mapping[int, torch.Tensor],
    swap_to: Mapping[int, Any] | None,
    label: str,
) -> tuple[str, dict[str, Any], dict[int, torch.Tensor] | None]:
    """An op, its parameters and a swap's ``to`` directions, checked; bad ones are a
    :class:`CaptureConfigError` naming the value, the choices and the fix."""
    if op not in OPS:
        raise CaptureConfigError(f"steering vector {label}: op {op!r} is not one of {list(OPS)}.")
    params = dict(params)
    if op == "cap":
        extra = sorted(set(params) - {"min", "max"})
        if extra:
            raise CaptureConfigError(
                f"steering vector {label}: cap takes min and max, not {extra}."
            )
        bounds = {}
        for key in ("min", "max"):
            value = params.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                    raise CaptureConfigError(
                        f"steering vector {label}: cap {key}={value!r} must be a number or None."
                    )
                if not math.isfinite(float(value)):
                    raise CaptureConfigError(
                        f"steering vector {label}: cap {key}={value!r} must be finite (leave it "
                        "None for no bound on that side)."
                    )
                value = float(value)
            bounds[key] = value
        if bounds["min"] is None and bounds["max"] is None:
            raise CaptureConfigError(
                f"steering vector {label}: cap needs min, max or both (with_op('cap', "
                "max=4.0)); with neither it would change nothing."
            )
        if (
            bounds["min"] is not None
            and bounds["max"] is not None
            and bounds["min"] > bounds["max"]
        ):
            raise CaptureConfigError(
                f"steering vector {label}: cap min={bounds['min']} is above max={bounds['max']}."
            )
        params = bounds
    elif params:
        raise CaptureConfigError(
            f"steering vector {label}: op {op!r} takes no parameters, got {sorted(params)}."
        )
    to = None
    if op == "swap":
        if swap_to is None:
            raise CaptureConfigError(
                f"steering vector {label}: a swap needs its to directions; make it with "
                "SteeringVector.swap(from_=..., to=...)."
            )
        to = {_layer_index(k): _vector(_layer_index(k), v) for k, v in swap_to.items()}
        if sorted(to) != sorted(vectors) or any(len(to[k]) != len(vectors[k]) for k in to):
            raise CaptureConfigError(
                f"steering vector {label}: a swap's to directions cover layers {sorted(to)}, "
                f"its from directions {sorted(vectors)}; both need the same layers and sizes."
            )
        to = dict(sorted(to.items()))
    elif swap_to is not None:
        raise CaptureConfigError(f"steering vector {label}: only a swap has to directions.")
    if op != "add":  # every other op divides by the direction's norm
        for what, directions in (("", vectors), (" to", to or {})):
            for layer, vec in directions.items():
                if float(torch.linalg.vector_norm(vec.double())) == 0.0:
                    raise CaptureConfigError(
                        f"steering vector {label}: layer {layer}'s{what} direction is all "
                        f"zeros; op {op!r} divides by its norm. Pass a nonzero direction."
                    )
    return op, params, to


def _swap_name(from_: SteeringVector, to: SteeringVector) -> str | None:
    return f"{from_.name}->{to.name}" if from_.name and to.name else None


def _is_int(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _json_copy(what: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CaptureConfigError(f"{what} must be a dict, got {type(value).__name__}.")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CaptureConfigError(f"{what} must be JSON-serialisable (it is saved): {e}") from e


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _some(ids: Sequence[Any]) -> str:
    shown = ", ".join(repr(i) for i in ids[:MAX_IDS_SHOWN])
    return f"[{shown}{', ...' if len(ids) > MAX_IDS_SHOWN else ''}]"


class _Classifier:
    """Says which class (0 positive, 1 negative, None left out) each store id is in."""

    def __init__(
        self,
        ids: dict[str, int] | None,
        labels: Labels | None,
        positive_label: Any,
        negative_label: Any,
    ) -> None:
        self.ids, self.labels = ids, labels
        self.positive_label, self.negative_label = positive_label, negative_label
        self.seen: set[str] = set()
        """repr of every label met (labels= only), for errors."""

    def resolve(self, store: ActivationStore, present: list[str], where: str) -> dict[str, Any]:
        if self.ids is not None:
            unknown = [sid for sid in self.ids if sid not in store]
            if unknown:
                raise CaptureConfigError(
                    f"{len(unknown)} of the given ids are not store ids of {store.root}: "
                    f"{_some(unknown)}. Ids are StoredRequest.store_id (output.store_id), not "
                    "vLLM request ids."
                )
            have = set(present)
            absent = [sid for sid in self.ids if sid not in have]
            if absent:
                logger.warning(
                    "%d of the given requests have no %s and are not used: %s",
                    len(absent),
                    where,
                    _some(absent),
                )
            return {sid: self.ids.get(sid) for sid in present}
        from probehook.probes.rows import LabelSource

        source = LabelSource(self.labels)  # type: ignore[arg-type]
        found = source.resolve(store, present, where)
        self.seen = {repr(label) for label in found.values() if label is not None}
        return {sid: self._class_of(label) for sid, label in found.items()}

    def _class_of(self, label: Any) -> int | None:
        if label is None:
            return None
        if _equal(label, self.positive_label):
            return 0
        if _equal(label, self.negative_label):
            return 1
        return None


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. an array label: ambiguous truth value
        return False


def _classifier(
    positive: Sequence[str] | None,
    negative: Sequence[str] | None,
    labels: Labels | None,
    positive_label: Any,
    negative_label: Any,
) -> _Classifier:
    """Check ``from_store``'s way of naming the two classes before any rows are read."""
    if labels is not None:
        if positive is not None or negative is not None:
            raise CaptureConfigError(
                "give either positive=/negative= store ids or labels=, not both."
            )
        if not isinstance(labels, Mapping) and not callable(labels):
            raise CaptureConfigError(
                "labels must be a dict from store id to label or a callable taking a "
                f"StoredRequest; got {type(labels).__name__}."
            )
        if _equal(positive_label, negative_label):
            raise CaptureConfigError(
                f"positive_label and negative_label are equal ({positive_label!r}); the two "
                "classes need different labels."
            )
        return _Classifier(None, labels, positive_label, negative_label)
    if positive is None or negative is None:
        raise CaptureConfigError(
            "from_store needs the two classes: positive=[store ids] and negative=[store ids], "
            "or labels= (with positive_label= / negative_label=)."
        )
    sides = {}
    for what, ids in (("positive", positive), ("negative", negative)):
        if isinstance(ids, str) or not isinstance(ids, Sequence | set | frozenset):
            raise CaptureConfigError(f"{what} must be a list of store ids, got {ids!r}.")
        ids = list(ids)
        if not ids:
            raise CaptureConfigError(f"{what} is empty: each class needs at least one request.")
        bad = [i for i in ids if not isinstance(i, str)]
        if bad:
            raise CaptureConfigError(f"{what} has ids that are not strings: {_some(bad)}.")
        sides[what] = ids
    both = sorted(set(sides["positive"]) & set(sides["negative"]))
    if both:
        raise CaptureConfigError(
            f"{len(both)} id(s) are both positive and negative: {_some(both)}."
        )
    ids = {sid: 0 for sid in sides["positive"]} | {sid: 1 for sid in sides["negative"]}
    return _Classifier(ids, None, positive_label, negative_label)


def _matrix(store: ActivationStore, layer: int, phase: str, token: str) -> Any:
    if layer not in store.layers:
        raise CaptureConfigError(
            f"layer {layer} is not in {store.root}; its layers are {store.layers}."
        )
    matrix = store.layer(layer, phase, token)
    if len(matrix) == 0:
        hint = " (was it captured with include_prefill=True?)" if phase == "prefill" else ""
        raise CaptureConfigError(f"{store.root} has no {phase} rows of layer {layer}{hint}.")
    return matrix


def _class_sums(
    store: ActivationStore, layer: int, phase: str, token: str, classify: _Classifier
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Per class (positive, negative): the float64 sum of its rows, its row count and its
    request count, streamed a block of rows at a time."""
    matrix = _matrix(store, layer, phase, token)
    where = f"{phase} rows of layer {layer}"
    sids = matrix.index["store_id"]
    present = list(dict.fromkeys(sids.tolist()))
    class_of = classify.resolve(store, present, where)
    code = {sid: -1 if c is None else c for sid, c in class_of.items()}
    row_class = np.fromiter((code[sid] for sid in sids), dtype=np.int64, count=len(sids))
    counts = [int((row_class == c).sum()) for c in (0, 1)]
    requests = [sum(1 for v in class_of.values() if v == c) for c in (0, 1)]
    for c, what in ((0, "positive"), (1, "negative")):
        if counts[c] > 0:
            continue
        if classify.ids is not None:
            raise CaptureConfigError(
                f"none of the {what} requests has {where} in {store.root}; each class needs "
                "at least one request with rows."
            )
        wanted = classify.positive_label if c == 0 else classify.negative_label
        raise CaptureConfigError(
            f"no request with {where} in {store.root} is labelled {wanted!r} ({what}_label); "
            f"the labels seen are {sorted(classify.seen)[:10]}. Set positive_label= and "
            "negative_label= to two of them."
        )
    hidden = store.hidden_size
    sums = [torch.zeros(hidden, dtype=torch.float64) for _ in (0, 1)]
    block = max(1, BLOCK_BYTES // (4 * hidden))
    for begin in range(0, len(matrix), block):
        end = min(begin + block, len(matrix))
        cls_rows = row_class[begin:end]
        if not (cls_rows >= 0).any():
            continue
        rows = matrix[begin:end].double()
        for c in (0, 1):
            mask = torch.from_numpy(cls_rows == c)
            if bool(mask.any()):
                sums[c] += rows[mask].sum(dim=0)
    return sums, counts, requests
