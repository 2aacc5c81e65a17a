"""``LinearProbe``: a linear read-out of one layer's residual stream, saved as one safetensors file.

A probe is ``activate(rows @ W.T + b)`` on raw residual-stream rows ``[rows, hidden]``, where
``(W, b) = probe.linear()`` has the optional input normalisation ``(x - mean) / std`` folded in.
The runtime engine applies exactly ``linear()`` and ``activate()``; ``score()`` is the same on CPU.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from probehook.errors import ProbeError

if TYPE_CHECKING:
    from probehook.probes.rows import Labels
    from probehook.store import ActivationStore

logger = logging.getLogger(__name__)

KINDS = ("binary", "multiclass", "regression")
PHASES = ("prefill", "decode")  # the store's phases (probehook.store.format.PHASES)
TOKENS = ("last", "mean", "all")

ArrayLike = torch.Tensor | np.ndarray


@dataclass(frozen=True)
class ProbeSplit:
    """The requests (store ids) ``LinearProbe.fit`` trained on and held out for its metrics."""

    train: tuple[str, ...]
    test: tuple[str, ...]


class LinearProbe:
    """A linear probe over layer ``layer``: weight ``[n_outputs, hidden]``, bias ``[n_outputs]``.

    ``kind``: ``"binary"`` (one output, the logit of ``label_names[1]``; scores are
    probabilities), ``"multiclass"`` (one output per class; scores are a softmax) or
    ``"regression"`` (one output, the value itself). ``mean``/``std`` (``[hidden]``) normalise the
    input as ``(x - mean) / std`` before the linear map. ``phase`` and ``token`` say which rows it
    was trained on; ``model_fingerprint`` is the store's, checked by :meth:`check_model`.
    """

    def __init__(
        self,
        weight: ArrayLike | Sequence,
        bias: ArrayLike | Sequence | float,
        *,
        layer: int,
        kind: str,
        label_names: Sequence[str] | None = None,
        phase: str = "decode",
        token: str = "last",
        name: str | None = None,
        mean: ArrayLike | Sequence | None = None,
        std: ArrayLike | Sequence | None = None,
        model_fingerprint: str | None = None,
        metrics: dict[str, Any] | None = None,
        split: ProbeSplit | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ProbeError(f"kind={kind!r}; valid kinds are {KINDS}.")
        if phase not in PHASES:
            raise ProbeError(f"phase={phase!r}; valid phases are {PHASES}.")
        if token not in TOKENS:
            raise ProbeError(f"token={token!r}; valid values are {TOKENS}.")
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise ProbeError(f"layer must be an int, got {layer!r}.")
        w = _float32("weight", weight)
        if w.ndim == 1:  # one output given as [hidden]
            w = w[None]
        if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
            raise ProbeError(f"weight must be [n_outputs, hidden], got shape {tuple(w.shape)}.")
        n_outputs, hidden = w.shape
        b = _float32("bias", bias)
        if b.ndim == 0:
            b = b.reshape(1)
        if tuple(b.shape) != (n_outputs,):
            raise ProbeError(
                f"bias has shape {tuple(b.shape)} but weight {tuple(w.shape)} needs "
                f"({n_outputs},): one bias per output."
            )
        if kind in ("binary", "regression") and n_outputs != 1:
            raise ProbeError(
                f"a {kind} probe has one output, but weight has shape {tuple(w.shape)}; "
                "use kind='multiclass' for one output per class."
            )
        if kind == "multiclass" and n_outputs < 2:
            raise ProbeError(
                f"a multiclass probe has one output per class (at least 2), but weight has "
                f"shape {tuple(w.shape)}; use kind='binary' for a single logit."
            )
        self._label_names = _check_labels(label_names, kind, n_outputs)
        self._mean = None if mean is None else _float32("mean", mean)
        self._std = None if std is None else _float32("std", std)
        for what, vec in (("mean", self._mean), ("std", self._std)):
            if vec is not None and tuple(vec.shape) != (hidden,):
                raise ProbeError(
                    f"{what} has shape {tuple(vec.shape)} but weight {tuple(w.shape)} needs "
                    f"({hidden},)."
                )
        if self._std is not None and not bool((self._std > 0).all()):
            raise ProbeError("std must be positive everywhere (it divides the input).")
        self._weight, self._bias = w, b
        self._layer = int(layer)
        self._kind, self._phase, self._token = kind, phase, token
        self._name = name
        self._model_fingerprint = model_fingerprint
        self._metrics = _plain(dict(metrics or {}))
        try:
            json.dumps(self._metrics)  # they go into the file's JSON header
        except TypeError as e:
            raise ProbeError(f"metrics must be JSON-serialisable: {e}") from e
        self._split = split

    # -- fields -------------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self._weight.shape[1])

    @property
    def n_outputs(self) -> int:
        return int(self._weight.shape[0])

    @property
    def layer(self) -> int:
        return self._layer

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def label_names(self) -> list[str] | None:
        return None if self._label_names is None else list(self._label_names)

    @property
    def phase(self) -> str:
        return self._phase

    @property
    def token(self) -> str:
        return self._token

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def model_fingerprint(self) -> str | None:
        return self._model_fingerprint

    @property
    def metrics(self) -> dict[str, Any]:
        """Held-out metrics from :meth:`fit` (a copy); empty for a hand-built probe."""
        return dict(self._metrics)

    @property
    def split(self) -> ProbeSplit | None:
        """The train / held-out requests of :meth:`fit`, or None for a hand-built probe."""
        return self._split

    @property
    def weight(self) -> torch.Tensor:
        """``[n_outputs, hidden]`` float32, applied to normalised rows (a copy)."""
        return self._weight.clone()

    @property
    def bias(self) -> torch.Tensor:
        return self._bias.clone()

    @property
    def mean(self) -> torch.Tensor | None:
        return None if self._mean is None else self._mean.clone()

    @property
    def std(self) -> torch.Tensor | None:
        return None if self._std is None else self._std.clone()

    # -- applying -----------------------------------------------------------------------------

    def linear(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W, b)``, float32 ``[n_outputs, hidden]`` and ``[n_outputs]``, with the normalisation
        folded in: ``raw = rows @ W.T + b`` on raw rows equals the probe on normalised rows."""
        # (x - m) / s @ w.T + b  ==  x @ (w / s).T + (b - (w / s) @ m); folded in float64.
        w, b = self._weight.double(), self._bias.double()
        if self._std is not None:
            w = w / self._std.double()
        if self._mean is not None:
            b = b - w @ self._mean.double()
        return w.float().contiguous(), b.float().contiguous()

    def activate(self, raw: torch.Tensor) -> torch.Tensor:
        """Scores from raw outputs ``[rows, n_outputs]``: binary ``[rows]`` probabilities of
        ``label_names[1]``, multiclass ``[rows, n_classes]`` softmax, regression ``[rows]``."""
        if raw.ndim != 2 or raw.shape[1] != self.n_outputs:
            raise ProbeError(
                f"raw outputs must be [rows, {self.n_outputs}] for this probe, got shape "
                f"{tuple(raw.shape)}."
            )
        if self._kind == "binary":
            return torch.sigmoid(raw[:, 0])
        if self._kind == "multiclass":
            return torch.softmax(raw, dim=-1)
        return raw[:, 0]

    def score(self, rows: ArrayLike) -> ArrayLike:
        """float32 scores of ``rows`` (``[rows, hidden]``, or one ``[hidden]`` row), any float
        dtype; numpy in, numpy out; torch in, CPU torch out. See :meth:`activate` for shapes."""
        as_numpy = isinstance(rows, np.ndarray)
        if as_numpy:
            if not np.issubdtype(rows.dtype, np.floating):
                raise ProbeError(f"rows must be floating point, got numpy {rows.dtype}.")
            x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        elif isinstance(rows, torch.Tensor):
            if not rows.is_floating_point():
                raise ProbeError(f"rows must be floating point, got torch {rows.dtype}.")
            x = rows.detach().to("cpu", torch.float32)
        else:
            raise ProbeError(f"rows must be a torch.Tensor or numpy array, got {type(rows)}.")
        single = x.ndim == 1
        if single:
            x = x[None]
        if x.ndim != 2:
            raise ProbeError(
                f"rows must be [rows, hidden] or [hidden], got shape {tuple(x.shape)}."
            )
        if x.shape[1] != self.hidden_size:
            raise ProbeError(
                f"rows have hidden size {x.shape[1]} but this probe expects "
                f"{self.hidden_size} (shape {tuple(x.shape)} vs weight "
                f"{tuple(self._weight.shape)})."
            )
        w, b = self.linear()
        out = self.activate(torch.addmm(b, x, w.T))
        if single:
            out = out[0]
        return out.numpy()[()] if as_numpy else out

    def check_model(self, hidden_size: int, model_fingerprint: str | None) -> None:
        """Raise if a model's hidden size differs from the probe's; warn (and log) if both
        fingerprints are known and differ (same shape, maybe another model)."""
        if hidden_size != self.hidden_size:
            raise ProbeError(
                f"Probe {self._label()} expects hidden size {self.hidden_size}, but the model's "
                f"hidden size is {hidden_size}: it was trained on another model."
            )
        if (
            self._model_fingerprint is not None
            and model_fingerprint is not None
            and self._model_fingerprint != model_fingerprint
        ):
            message = (
                f"Probe {self._label()} was trained on a model with fingerprint "
                f"{self._model_fingerprint}, but this model's is {model_fingerprint}; its scores "
                "may mean nothing here."
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)

    # -- files --------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write one safetensors file: tensors ``weight``, ``bias`` (and ``mean``, ``std``), the
        rest as JSON under the metadata key ``probehook_probe``. Returns the path."""
        from probehook.probes.file import save_probe

        return save_probe(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LinearProbe:
        """Read a file written by :meth:`save`; a damaged or foreign file raises
        :class:`~probehook.errors.ProbeError` naming it."""
        from probehook.probes.file import load_probe

        return load_probe(path)

    # -- training -----------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        store: ActivationStore | str | os.PathLike[str],
        layer: int,
        labels: Labels,
        *,
        token: str = "last",
        phase: str = "prefill",
        estimator: Any = None,
        test_size: float | int = 0.2,
        seed: int = 0,
        name: str | None = None,
        standardize: bool = True,
        progress: bool = True,
    ) -> LinearProbe:
        """Train a probe on one layer of an activation store; see
        :func:`probehook.probes.train.fit_probe` and docs/probes.md."""
        from probehook.probes.train import fit_probe

        return fit_probe(
            store,
            layer,
            labels,
            token=token,
            phase=phase,
            estimator=estimator,
            test_size=test_size,
            seed=seed,
            name=name,
            standardize=standardize,
            progress=progress,
        )

    # -- display ------------------------------------------------------------------------------

    def _label(self) -> str:
        return repr(self._name) if self._name else f"(layer {self._layer}, {self._kind})"

    def __repr__(self) -> str:
        parts = [f"name={self._name!r}"] if self._name else []
        parts += [f"layer={self._layer}", f"kind={self._kind!r}", f"hidden={self.hidden_size}"]
        if self._label_names is not None:
            parts.append(f"labels={self._label_names}")
        parts += [f"phase={self._phase!r}", f"token={self._token!r}"]
        for key in ("accuracy", "roc_auc", "r2"):
            value = self._metrics.get(key)
            if isinstance(value, float):
                parts.append(f"{key}={value:.3f}")
        if "n_test_requests" in self._metrics:
            parts.append(f"n_test_requests={self._metrics['n_test_requests']}")
        return f"LinearProbe({', '.join(parts)})"


def _float32(what: str, value: Any) -> torch.Tensor:
    """A CPU float32 copy of a tensor, array, list or number; finite, or a ProbeError."""
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as e:
        raise ProbeError(f"{what} must be a tensor or array of numbers: {e}") from e
    if t.dtype == torch.bool or t.is_complex():
        raise ProbeError(f"{what} must be real numbers, got dtype {t.dtype}.")
    t = t.detach().to("cpu", torch.float32).contiguous().clone()
    if not bool(torch.isfinite(t).all()):
        raise ProbeError(f"{what} has NaN or infinite values.")
    return t


def _check_labels(names: Sequence[str] | None, kind: str, n_outputs: int) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise ProbeError(f"label_names must be a list of strings, got the string {names!r}.")
    names = list(names)
    if not all(isinstance(n, str) for n in names):
        raise ProbeError(f"label_names must be strings, got {names!r}.")
    expected = {"binary": 2, "multiclass": n_outputs, "regression": 0}[kind]
    if kind == "regression":
        raise ProbeError("a regression probe has no label_names; leave them None.")
    if len(names) != expected:
        raise ProbeError(
            f"a {kind} probe with {n_outputs} output(s) needs {expected} label_names, got "
            f"{len(names)}: {names}."
        )
    return names


def _plain(value: Any) -> Any:
    """JSON-ready copy of metrics: numpy scalars become Python numbers, NaN becomes None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
