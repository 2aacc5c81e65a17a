"""Lens files: the J-lens artifact TransformerLens 3.9 writes and reads, and the ``tuned-lens``
package's folder.

Both reduce to what the worker applies to a row ``h`` of layer ``L`` before the model's final
norm and unembedding: ``M h + b`` (:func:`lens_affine`), the identity for the logit lens and at
the last layer (neither format fits one there). Every file is read with
``torch.load(weights_only=True)``: a lens file is data, never code.

- **J-lens** (:class:`JacobianLens`): ``{"J": {layer: [d, d]}, "n_prompts", "source_layers",
  "d_model", "metadata"}`` (fp16 matrices by default), or the reference implementation's fit
  checkpoint (``{"jacobian_sum": ..., "n_done": ...}``, running sums). ``J[L]`` maps the output
  of block ``L`` (probehook's layer ``L``) to the last block's output: ``M = J[L]``.
- **Tuned lens** (:class:`TunedLens`): ``config.json`` (``d_model``, ``num_hidden_layers``,
  ``bias``) and ``params.pt`` (``{i}.weight``, ``{i}.bias``). Translator ``i`` reads Hugging
  Face's ``hidden_states[i]`` (``i = 0``: the embeddings) and returns ``h + W h + b``: probehook's
  layer ``L`` uses translator ``L + 1``, so ``M = I + W[L + 1]``, ``b = b[L + 1]``.

No vLLM.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from probehook.errors import CaptureConfigError

LOGIT = "logit"
LENS_CHOICES = (
    "'logit', a JacobianLens or TunedLens, a J-lens file (.pt, TransformerLens's format) or a "
    "tuned-lens folder (config.json + params.pt)"
)


def _load_tensors(path: Path, mapped: bool = False) -> Any:
    """A lens file's payload; ``mapped``: its tensors mapped from the file, not read (shapes
    and metadata cost nothing; a file of the old, non-zip format is read as usual)."""
    try:
        if mapped:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickled code, a truncated file: say which file
        raise CaptureConfigError(
            f"{os.fspath(path)!r} is not a lens file probehook reads (torch.load with "
            f"weights_only=True: tensors and plain values only): {type(e).__name__}: {e}"
        ) from e


class JacobianLens:
    """A Jacobian lens: one ``[d, d]`` transport matrix per source layer (float32, CPU)."""

    kind = "jacobian"

    def __init__(
        self,
        jacobians: Mapping[int, torch.Tensor],
        *,
        n_prompts: int,
        d_model: int,
        metadata: Mapping[str, Any] | None = None,
        path: str | os.PathLike[str] | None = None,
        weights: bool = True,
    ) -> None:
        if not jacobians:
            raise ValueError("a JacobianLens needs at least one layer's matrix")
        self.d_model = int(d_model)
        for layer, matrix in jacobians.items():
            if tuple(matrix.shape) != (self.d_model, self.d_model):
                raise ValueError(
                    f"J[{layer}] has shape {tuple(matrix.shape)}, not "
                    f"({self.d_model}, {self.d_model})"
                )
        self.weights = weights
        """False: a description read with ``load(weights=False)``: the matrices are the file's
        tensors as mapped (shapes right, values not read, not averaged), for checks only."""
        convert = (lambda v: v.detach().float().cpu()) if weights else (lambda v: v)
        self.jacobians = {int(k): convert(v) for k, v in jacobians.items()}
        self.n_prompts = int(n_prompts)
        self.metadata = dict(metadata or {})
        self.path = os.fspath(path) if path is not None else None
        """The file the lens was read from or saved to (the workers read it from there)."""

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.jacobians)

    def __repr__(self) -> str:
        return f"JacobianLens(layers={self.source_layers}, d_model={self.d_model})"

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, weights: bool = True) -> JacobianLens:
        """A J-lens artifact, or a reference fit checkpoint (running sums over ``n_done``
        prompts, divided here). ``weights=False``: its description alone (layers, width,
        metadata; the matrices mapped from the file, not read), what an engine's front end
        checks a lens with: a 2 GB lens costs the user's process nothing."""
        payload = _load_tensors(Path(path), mapped=not weights)
        if not isinstance(payload, Mapping):
            raise CaptureConfigError(f"{os.fspath(path)!r} holds no J-lens (not a dict).")
        if "J" in payload:
            if "d_model" not in payload or not isinstance(payload["J"], Mapping):
                raise CaptureConfigError(
                    f"{os.fspath(path)!r} is a damaged J-lens: it needs 'J' (layer -> [d, d] "
                    "matrix) and 'd_model'."
                )
            return _build(
                cls,
                path,
                payload["J"],
                n_prompts=int(payload.get("n_prompts", 0)),
                d_model=int(payload["d_model"]),
                metadata=payload.get("metadata"),
                weights=weights,
            )
        if "jacobian_sum" in payload:
            n = int(payload.get("n_done", payload.get("n_prompts", 0)))
            if n <= 0 or not payload["jacobian_sum"]:
                raise CaptureConfigError(
                    f"{os.fspath(path)!r} is a J-lens fit checkpoint of {n} prompts and "
                    f"{len(payload['jacobian_sum'])} layers: nothing to average."
                )
            sums = payload["jacobian_sum"]
            d = int(next(iter(sums.values())).shape[0])
            matrices = {int(k): v.float() / n if weights else v for k, v in sums.items()}
            metadata = _checkpoint_metadata(payload)
            return _build(cls, path, matrices, n_prompts=n, d_model=d, metadata=metadata,
                          weights=weights)  # fmt: skip
        raise CaptureConfigError(
            f"{os.fspath(path)!r} is not a J-lens: it has neither a 'J' key (an artifact) nor "
            "a 'jacobian_sum' key (a fit checkpoint)."
        )

    def save(self, path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float16) -> Path:
        """Write the artifact TransformerLens's ``JacobianLens.load`` reads (fp16 by default,
        as it writes them); the lens remembers the path."""
        _check_metadata(self.metadata)
        payload: dict[str, Any] = {
            "J": {layer: m.to(dtype) for layer, m in self.jacobians.items()},
            "n_prompts": self.n_prompts,
            "source_layers": self.source_layers,
            "d_model": self.d_model,
        }
        if self.metadata:
            payload["metadata"] = self.metadata
        torch.save(payload, path)
        self.path = os.fspath(path)
        return Path(path)

    @classmethod
    def fit(
        cls,
        model_path: str | os.PathLike[str],
        prompts: Sequence[str],
        layers: Sequence[int] | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> JacobianLens:
        """Fit one on the Hugging Face checkpoint ``model_path`` with autograd, as
        TransformerLens 3.9's ``JacobianLens.fit`` does (:func:`probehook.lenses.fit.
        fit_jacobian_lens`: ``dim_batch``, ``max_seq_len``, ``skip_first_positions``,
        ``corpus``, ``progress``, ``device``); with ``path``, saved there (an engine reads a
        lens from its file)."""
        from probehook.lenses.fit import fit_jacobian_lens

        fitted = fit_jacobian_lens(model_path, prompts, layers, **settings)
        lens = cls(
            fitted["jacobians"],
            n_prompts=fitted["n_prompts"],
            d_model=fitted["d_model"],
            metadata=fitted["metadata"],
        )
        if path is not None:
            lens.save(path)
        return lens

    def matrix(self, layer: int, num_layers: int) -> torch.Tensor | None:
        """``J[layer]`` (None at the last layer when not fitted there: the identity)."""
        if layer in self.jacobians:
            return self.jacobians[layer]
        if layer == num_layers - 1:
            return None
        raise CaptureConfigError(
            f"the J-lens{_from(self.path)} has no matrix for layer {layer}: it was fitted on "
            f"layers {self.source_layers} (and the last, {num_layers - 1}, is the identity); "
            "pass lens_layers among those."
        )


# What TransformerLens's checkpoint conversion leaves out of the metadata (its fit's own keys,
# so that its merge refuses to mix converted lenses with fitted ones) and takes from the top
# level of the payload: the same here, so a checkpoint reads the same in both.
_FIT_RESERVED_KEYS = frozenset(
    {
        "transformer_lens_fit",
        "transformer_lens_version",
        "model_system",
        "processing",
        "hook_convention",
        "fit_dtype",
        "dim_batch",
        "max_seq_len",
        "skip_first_positions",
    }
)
_FLAT_PROVENANCE = ("model_name", "model_revision", "corpus", "target_layer")


def _checkpoint_metadata(payload: Mapping[str, Any]) -> dict[str, Any]:
    raw = dict(payload.get("metadata") or {})
    for key in _FLAT_PROVENANCE:
        if key in payload and key not in raw:
            raw[key] = payload[key]
    clean: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in raw.items():
        if key in _FIT_RESERVED_KEYS:
            continue
        if isinstance(value, torch.Tensor):
            dropped.append(f"{key}: shape={tuple(value.shape)} dtype={value.dtype}")
        elif _plain(value):
            clean[key] = value
        else:
            dropped.append(key)
    clean["converted_from"] = "jacobian_lens_checkpoint"
    if dropped:
        clean["dropped_fields"] = dropped
    return clean


def _plain(value: Any) -> bool:
    """What ``torch.load(weights_only=True)`` reads back, as TransformerLens allows it."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def _check_metadata(metadata: Mapping[str, Any]) -> None:
    bad = sorted(k for k, v in metadata.items() if not _plain(v))
    if bad:
        raise CaptureConfigError(
            f"J-lens metadata {bad} would not load back (weights_only=True): use None, bool, "
            "int, float, str, lists, tuples and string-keyed dicts."
        )


def _build(cls: type[JacobianLens], path: Any, matrices: Any, **fields: Any) -> JacobianLens:
    try:
        return cls(matrices, path=path, **fields)
    except (ValueError, TypeError, AttributeError) as e:  # a wrong shape, a non-tensor
        raise CaptureConfigError(f"{os.fspath(path)!r} is a damaged J-lens: {e}") from e


class TunedLens:
    """A tuned lens: one affine translator per Hugging Face hidden state."""

    kind = "tuned"

    def __init__(
        self,
        translators: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]],
        config: Mapping[str, Any],
        path: str | os.PathLike[str] | None = None,
        weights: bool = True,
    ) -> None:
        self.config = dict(config)
        self.d_model = int(config["d_model"])
        self.num_hidden_layers = int(config["num_hidden_layers"])
        self.weights = weights
        """False: a description (``load(weights=False)``): translators mapped, not read."""
        convert = (lambda v: v.detach().float().cpu()) if weights else (lambda v: v)
        self.translators = {
            int(i): (convert(w), None if b is None else convert(b))
            for i, (w, b) in translators.items()
        }
        self.path = os.fspath(path) if path is not None else None

    def __repr__(self) -> str:
        return f"TunedLens(d_model={self.d_model}, translators={len(self.translators)})"

    @classmethod
    def load(cls, folder: str | os.PathLike[str], *, weights: bool = True) -> TunedLens:
        """A tuned-lens folder; ``weights=False``: its description alone (the translators
        mapped from params.pt, not read), as :meth:`JacobianLens.load`."""
        folder = Path(folder)
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise CaptureConfigError(
                f"{os.fspath(folder)!r} is not a tuned-lens folder (its config.json: {e})."
            ) from e
        missing = [k for k in ("d_model", "num_hidden_layers") if k not in config]
        if missing:
            raise CaptureConfigError(f"{os.fspath(folder)!r}: config.json lacks {missing}.")
        params = _load_tensors(folder / "params.pt", mapped=not weights)
        if not isinstance(params, Mapping):
            raise CaptureConfigError(f"{os.fspath(folder)!r}: params.pt holds no state dict.")
        d = int(config["d_model"])
        translators: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for key in params:
            index, _, part = str(key).partition(".")
            if part == "weight" and index.isdigit():
                weight, bias = params[key], params.get(f"{index}.bias")
                # Checked here, not when the engine first applies it.
                for name, value, shape in ((key, weight, (d, d)), (f"{index}.bias", bias, (d,))):
                    if value is not None and (
                        not isinstance(value, torch.Tensor) or tuple(value.shape) != shape
                    ):
                        got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                        raise CaptureConfigError(
                            f"{os.fspath(folder)!r}: params.pt's {name} has shape {got}, not "
                            f"{shape} (config.json's d_model is {d})."
                        )
                translators[int(index)] = (weight, bias)
        return cls(translators, config, folder, weights=weights)

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the package's folder format; the lens remembers the folder."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        bias = any(b is not None for _, b in self.translators.values())
        (out / "config.json").write_text(json.dumps({**self.config, "bias": bias}, indent=2))
        params: dict[str, torch.Tensor] = {}
        for i, (w, b) in sorted(self.translators.items()):
            params[f"{i}.weight"] = w
            if b is not None:
                params[f"{i}.bias"] = b
        torch.save(params, out / "params.pt")
        self.path = os.fspath(out)
        return out

    def affine(
        self, layer: int, num_layers: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(I + W[layer + 1], b[layer + 1])``; ``(None, None)`` at the last layer."""
        if not self.check_layer(layer, num_layers):
            return None, None
        weight, bias = self.translators[layer + 1]
        return torch.eye(self.d_model) + weight, bias

    def check_layer(self, layer: int, num_layers: int) -> bool:
        """Whether ``layer`` has a translator (False: the last layer, none needed); a
        :class:`CaptureConfigError` where it needs one and has none."""
        if layer == num_layers - 1:
            return False
        if layer + 1 not in self.translators:
            raise CaptureConfigError(
                f"the tuned lens{_from(self.path)} has no translator for layer {layer} "
                f"(translator {layer + 1}; it has {sorted(self.translators)})."
            )
        return True


def _from(path: str | None) -> str:
    return f" {path!r}" if path else ""


def load_lens(spec: Any, *, weights: bool = True) -> JacobianLens | TunedLens | str:
    """A lens from what an engine's ``lenses={name: spec}`` takes (module docstring);
    ``weights=False``: a file's description alone (its tensors mapped, not read)."""
    if isinstance(spec, (JacobianLens, TunedLens)):
        return spec
    if isinstance(spec, str) and spec == LOGIT:
        return LOGIT
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_dir():
            return TunedLens.load(path, weights=weights)
        if path.is_file():
            return JacobianLens.load(path, weights=weights)
        raise CaptureConfigError(f"lens {os.fspath(spec)!r}: no such file or folder; pass "
                                 f"{LENS_CHOICES}.")  # fmt: skip
    raise CaptureConfigError(f"lens {spec!r} is not a lens: pass {LENS_CHOICES}.")


def check_lens(
    lens: JacobianLens | TunedLens | str,
    name: str,
    *,
    hidden_size: int,
    num_layers: int,
    layers: Sequence[int],
    model_name: str | None = None,
) -> None:
    """Refuse a lens the model cannot use (its width, a layer it has no map for); warn when it
    records another model's name (published lenses name Hub ids, users load local paths)."""
    if isinstance(lens, str):
        return
    if lens.d_model != hidden_size:
        raise CaptureConfigError(
            f"lenses[{name!r}] is for d_model {lens.d_model}, and the model's hidden size is "
            f"{hidden_size}: a lens of another model."
        )
    if isinstance(lens, TunedLens) and lens.num_hidden_layers != num_layers:
        raise CaptureConfigError(
            f"lenses[{name!r}] is a tuned lens of {lens.num_hidden_layers} layers, and the "
            f"model has {num_layers}: a lens of another model."
        )
    for layer in layers:
        try:  # the layer's map exists (nothing computed: a description is enough)
            if isinstance(lens, TunedLens):
                lens.check_layer(layer, num_layers)
            else:
                lens.matrix(layer, num_layers)
        except CaptureConfigError as e:
            raise CaptureConfigError(f"lenses[{name!r}]: {e}") from None
    recorded = (
        lens.metadata.get("model_name")
        if isinstance(lens, JacobianLens)
        else lens.config.get("base_model_name_or_path")
    )
    if recorded and model_name and str(recorded) != str(model_name):
        warnings.warn(
            f"lenses[{name!r}] was fitted on {recorded!r} and this engine serves "
            f"{model_name!r}: check that they are the same weights.",
            UserWarning,
            stacklevel=3,
        )


def lens_affine(
    lens: JacobianLens | TunedLens | str, layer: int, num_layers: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(M, b)`` the worker applies to a row of ``layer`` (``M @ h + b``; None: none)."""
    if isinstance(lens, str):
        return None, None
    if isinstance(lens, JacobianLens):
        return lens.matrix(layer, num_layers), None
    return lens.affine(layer, num_layers)
