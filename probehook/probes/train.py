"""Fitting a ``LinearProbe`` on one layer of an activation store (``LinearProbe.fit``).

The split is by request, never by row: rows of one request are near-copies of each other, so a
row split would score memorisation as accuracy. scikit-learn is imported only when fitting.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from probehook.errors import ProbeError
from probehook.probes.linear import PHASES, TOKENS, LinearProbe, ProbeSplit
from probehook.probes.rows import Examples, Labels, LabelSource, collect_examples

if TYPE_CHECKING:
    from probehook.store import ActivationStore

logger = logging.getLogger(__name__)

STD_FLOOR = 1e-6
"""Smallest standard deviation used to standardise a feature (constant features stay finite)."""


def fit_probe(
    store: ActivationStore | str | os.PathLike[str],
    layer: int,
    labels: Labels | LabelSource,
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
    """Train a linear probe on ``layer`` of ``store`` and score it on held-out requests.

    ``token``: ``"last"`` (one example per request, or per completion for decode),
    ``"mean"`` (the mean of those rows) or ``"all"`` (every row, labelled by its request).
    ``estimator``: any scikit-learn linear classifier or regressor with ``coef_`` and
    ``intercept_`` (default ``LogisticRegression``), fitted on inputs standardised with the
    training rows' mean and std (``standardize=False`` to skip); the scaling is folded into the
    probe. Metrics on the held-out requests are in ``probe.metrics``, the split in
    ``probe.split``.
    """
    from probehook.store import ActivationStore

    if token not in TOKENS:
        raise ProbeError(f"token={token!r}; valid values are {TOKENS}.")
    if phase not in PHASES:
        raise ProbeError(f"phase={phase!r}; valid phases are {PHASES}.")
    check_test_size(test_size)  # before any rows are read
    model = prepare_estimator(estimator, seed)
    source = labels if isinstance(labels, LabelSource) else LabelSource(labels)
    if not isinstance(store, ActivationStore):
        with ActivationStore.open(store) as opened:  # its shard files are closed afterwards
            return fit_probe(
                opened,
                layer,
                source,
                token=token,
                phase=phase,
                estimator=model,
                test_size=test_size,
                seed=seed,
                name=name,
                standardize=standardize,
                progress=progress,
            )
    if layer not in store.layers:
        raise ProbeError(f"layer {layer} is not in {store.root}; its layers are {store.layers}.")
    examples = collect_examples(store, layer, phase, token, source, progress)
    probe_fields = dict(
        layer=layer,
        phase=phase,
        token=token,
        name=name,
        model_fingerprint=store.meta.get("model_fingerprint"),
    )
    return _fit(examples, model, probe_fields, test_size, seed, standardize)


def prepare_estimator(estimator: Any, seed: int) -> Any:
    """A fresh, unfitted copy of ``estimator`` (default: LogisticRegression), seeded."""
    from sklearn.base import clone, is_classifier, is_regressor
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    if estimator is None:
        return LogisticRegression(max_iter=5000, random_state=seed)
    if isinstance(estimator, type):
        raise ProbeError(
            f"estimator must be an instance, e.g. {estimator.__name__}(), not the class."
        )
    if isinstance(estimator, Pipeline):
        raise ProbeError(
            "estimator is a scikit-learn Pipeline; pass its final linear estimator alone. "
            "LinearProbe.fit standardises the inputs itself (standardize=True) and folds the "
            "scaling into the probe, which a Pipeline's steps cannot be."
        )
    if not (is_classifier(estimator) or is_regressor(estimator)):
        raise ProbeError(
            f"estimator {type(estimator).__name__} is neither a scikit-learn classifier nor "
            "regressor; use a linear one such as LogisticRegression, RidgeClassifier or Ridge."
        )
    model = clone(estimator)
    if model.get_params().get("random_state", 0) is None:  # reproducible unless chosen
        model.set_params(random_state=seed)
    return model


def check_test_size(test_size: float | int) -> None:
    """A fraction in (0, 1) or a positive count of requests, as in scikit-learn."""
    if isinstance(test_size, bool) or not isinstance(test_size, int | float):
        raise ProbeError(f"test_size must be a fraction in (0, 1) or a count, got {test_size!r}.")
    if isinstance(test_size, float) and not 0 < test_size < 1:
        raise ProbeError(f"test_size={test_size}; a fraction must be in (0, 1).")
    if isinstance(test_size, int) and test_size < 1:
        raise ProbeError(f"test_size={test_size}; a count of held-out requests must be >= 1.")


def split_requests(
    request_ids: list[str],
    request_labels: list[Any] | None,
    test_size: float | int,
    seed: int,
) -> tuple[list[str], list[str]]:
    """Split requests (not rows) into train and test; stratified by ``request_labels`` when
    given and every class has at least 2 requests."""
    from sklearn.model_selection import train_test_split

    check_test_size(test_size)
    n = len(request_ids)
    n_test = math.ceil(test_size * n) if isinstance(test_size, float) else test_size
    n_train = n - n_test
    if n_test < 1 or n_train < 1:
        raise ProbeError(
            f"too few requests to split: {n} labelled request(s) with test_size={test_size} "
            f"leave {max(n_train, 0)} for training and {max(n_test, 0)} held out; at least one "
            "of each is needed (the split is by request, not by row)."
        )
    stratify = None
    if request_labels is not None:
        counts = Counter(request_labels)
        n_classes = len(counts)
        if min(counts.values()) >= 2 and min(n_test, n_train) >= n_classes:
            stratify = request_labels
    train, test = train_test_split(
        request_ids, test_size=n_test, random_state=seed, stratify=stratify
    )
    return list(train), list(test)


def _fit(
    examples: Examples,
    model: Any,
    probe_fields: dict[str, Any],
    test_size: float | int,
    seed: int,
    standardize: bool,
) -> LinearProbe:
    from sklearn.base import is_regressor

    regression = is_regressor(model)
    layer = probe_fields["layer"]
    y = _check_targets(examples.y, regression, type(model).__name__)
    request_ids = list(dict.fromkeys(examples.request_ids.tolist()))
    row_of = {sid: i for i, sid in enumerate(examples.request_ids.tolist())}  # any of its rows
    request_labels = None if regression else [y[row_of[sid]].item() for sid in request_ids]
    train_ids, test_ids = split_requests(request_ids, request_labels, test_size, seed)
    train_set = set(train_ids)
    train = np.fromiter(
        (sid in train_set for sid in examples.request_ids), dtype=bool, count=len(y)
    )
    x_train, y_train = examples.x[train], y[train]
    x_test, y_test = examples.x[~train], y[~train]
    if not regression and len(np.unique(y_train)) < 2:
        raise ProbeError(
            f"the training requests of layer {layer} all have the label {y_train[0].item()!r}; add "
            "requests of the other class(es) or lower test_size."
        )
    mean = std = None
    if standardize:
        mean = x_train.mean(axis=0, dtype=np.float64)
        std = np.maximum(x_train.std(axis=0, dtype=np.float64), STD_FLOOR)
        x_fit = ((x_train - mean) / std).astype(np.float32)
    else:
        x_fit = x_train
    try:
        model.fit(x_fit, y_train)
    except (ValueError, TypeError) as e:
        raise ProbeError(
            f"{type(model).__name__}.fit failed on layer {layer} ({len(x_fit)} rows): {e}"
        ) from e
    weight, bias, kind, label_names = _linear_part(model, regression)
    _check_is_linear(model, x_fit, weight, bias, kind)
    fields = dict(
        probe_fields,
        kind=kind,
        label_names=label_names,
        mean=mean,
        std=std,
        split=ProbeSplit(tuple(train_ids), tuple(test_ids)),
    )
    probe = LinearProbe(weight, bias, **fields)
    metrics: dict[str, Any] = {
        "n_train": int(len(x_train)),
        "n_test": int(len(x_test)),
        "n_train_requests": len(train_ids),
        "n_test_requests": len(test_ids),
        "seed": seed,
        "test_size": test_size,
    }
    # From probe.score, so the metrics measure the probe as saved, not the estimator.
    metrics.update(_held_out_metrics(probe, model, x_test, y_test))
    logger.info("probe layer %d: %s", layer, metrics)
    return LinearProbe(weight, bias, **fields, metrics=metrics)


def _check_targets(labels: list[Any], regression: bool, estimator: str) -> np.ndarray:
    from sklearn.utils.multiclass import type_of_target

    if regression:
        try:
            y = np.asarray(labels, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ProbeError(
                f"{estimator} is a regressor but the labels are not numbers: {e}"
            ) from e
        if len(np.unique(y)) < 2:
            raise ProbeError(f"every label is {y[0]}; a regression needs varying targets.")
        return y
    y = np.asarray(labels)
    kind = type_of_target(y)
    if kind == "continuous":
        raise ProbeError(
            f"the labels are continuous numbers but {estimator} is a classifier; pass a linear "
            "regressor, e.g. estimator=sklearn.linear_model.Ridge()."
        )
    if kind not in ("binary", "multiclass"):
        raise ProbeError(f"labels must be one class per request (got {kind} targets).")
    classes = np.unique(y)
    if len(classes) < 2:
        raise ProbeError(
            f"every labelled request has the label {classes[0].item()!r}; a classifier needs "
            "at least two classes."
        )
    return y


def _linear_part(model: Any, regression: bool) -> tuple[np.ndarray, np.ndarray, str, Any]:
    """(weight [n_outputs, hidden], bias [n_outputs], kind, label_names) of a fitted model."""
    if not hasattr(model, "coef_") or not hasattr(model, "intercept_"):
        raise ProbeError(
            f"{type(model).__name__} has no coef_/intercept_ after fitting: only linear "
            "estimators can become probes."
        )
    coef = np.atleast_2d(np.asarray(model.coef_, dtype=np.float64))
    intercept = np.atleast_1d(np.asarray(model.intercept_, dtype=np.float64))
    if regression:
        if coef.shape[0] != 1:
            raise ProbeError(f"multi-output regression is not supported (coef_ {coef.shape}).")
        return coef, np.broadcast_to(intercept, (1,)).copy(), "regression", None
    classes = list(model.classes_)
    names = [str(c) for c in classes]
    if len(classes) == 2:
        if coef.shape[0] == 2:  # one row per class: the positive logit is their difference
            intercept = np.broadcast_to(intercept, (2,))
            coef, intercept = coef[1:] - coef[:1], intercept[1:] - intercept[:1]
        return coef, np.broadcast_to(intercept, (1,)).copy(), "binary", names
    if coef.shape[0] != len(classes):
        raise ProbeError(
            f"{type(model).__name__}.coef_ has shape {coef.shape} for {len(classes)} classes; "
            "expected one row per class."
        )
    return coef, np.broadcast_to(intercept, (len(classes),)).copy(), "multiclass", names


def _check_is_linear(
    model: Any, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, kind: str
) -> None:
    """The estimator's own decision must be ``x @ coef_.T + intercept_``, or the probe would
    silently differ from what was trained."""
    decide = getattr(model, "predict" if kind == "regression" else "decision_function", None)
    if decide is None:
        return
    sample = x[:256]
    expected = np.asarray(decide(sample), dtype=np.float64).reshape(len(sample), -1)
    got = sample.astype(np.float64) @ weight.T + bias
    if kind == "binary" and expected.shape[1] == 2:  # one column per class
        expected = expected[:, 1:] - expected[:, :1]
    if expected.shape != got.shape:
        return  # a decision in some other layout: nothing to compare
    if np.allclose(got, expected, rtol=1e-3, atol=1e-3 * max(1.0, float(np.abs(expected).max()))):
        return
    raise ProbeError(
        f"{type(model).__name__}'s decision is not coef_ @ x + intercept_; only linear "
        "estimators can become probes."
    )


def _held_out_metrics(
    probe: LinearProbe, model: Any, x_test: np.ndarray, y_test: np.ndarray
) -> dict[str, Any]:
    from sklearn.metrics import mean_squared_error, r2_score, roc_auc_score

    scores = probe.score(x_test)
    if probe.kind == "regression":
        r2 = float(r2_score(y_test, scores)) if len(y_test) >= 2 else None
        return {"r2": r2, "mse": float(mean_squared_error(y_test, scores))}
    truth = np.searchsorted(model.classes_, y_test)  # classes_ is sorted
    if probe.kind == "binary":
        predicted = (scores > 0.5).astype(np.int64)
        both = len(np.unique(truth)) == 2
        roc_auc = float(roc_auc_score(truth, scores)) if both else None
        return {"accuracy": float(np.mean(predicted == truth)), "roc_auc": roc_auc}
    return {"accuracy": float(np.mean(scores.argmax(axis=1) == truth))}
