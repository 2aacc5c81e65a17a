"""``probehook.SAE``: a sparse autoencoder read from disk without importing SAELens.

Reads SAELens folders (``cfg.json`` + ``sae_weights.safetensors``, as ``SAE.save_model``
writes them) and EleutherAI sparsify folders (``cfg.json`` + ``sae.safetensors``), works out
which probehook layer the SAE reads from its hook name, and computes what the engine computes
(:mod:`probehook.saes.encode`) on rows you have: ``sae.encode(rows)``, ``sae.top_k(rows, k)``.
Files are read with safetensors and json only: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from probehook.saes.encode import (
    ARCHITECTURES,
    NORMALIZATIONS,
    SAEWeights,
    encode_dense,
    pre_activations,
    read_top_k,
)
from probehook.saes.features import SAEFeatures
from probehook.saes.files import (
    CONFIG,
    SAELENS_WEIGHTS,
    SPARSIFY_WEIGHTS,
    SAEError,
    fingerprint_of,
    read_tensors,
)

NOT_READ = {
    "matching_pursuit": "its encoder is iterative (no single encode GEMM)",
    "temporal": "it attends over earlier tokens' codes",
    "transcoder": "a transcoder reads the MLP's input, not the residual stream",
    "skip_transcoder": "a transcoder reads the MLP's input, not the residual stream",
    "jumprelu_transcoder": "a transcoder reads the MLP's input, not the residual stream",
    "jumprelu_skip_transcoder": "a transcoder reads the MLP's input, not the residual stream",
}
HOOK_FORMS = (
    "blocks.L.hook_resid_post (layer L)",
    "blocks.L.hook_resid_pre (layer L-1)",
    "blocks.L.hook_out (layer L)",
    "model.layers.L (layer L)",
    "layers.L (layer L)",
)
_POST = re.compile(
    r"^(?:blocks\.(\d+)\.hook_resid_post|blocks\.(\d+)\.hook_out|"
    r"(?:model\.)?(?:language_model\.)?layers\.(\d+)(?:\.output)?)$"
)
_PRE = re.compile(r"^blocks\.(\d+)\.hook_resid_pre$")


def layer_of_hook(hook: str) -> int:
    """The probehook layer (the residual stream after decoder layer L, HF
    ``hidden_states[L + 1]``) a hook name reads; :class:`SAEError` for any other site."""
    post = _POST.match(hook)
    if post:
        return int(next(g for g in post.groups() if g is not None))
    pre = _PRE.match(hook)
    if pre:
        layer = int(pre.group(1)) - 1
        if layer < 0:
            raise SAEError(
                f"hook {hook!r} reads the embeddings (before layer 0), which probehook does not "
                "tap; use an SAE of a later layer."
            )
        return layer
    raise SAEError(
        f"hook {hook!r} is not the residual stream between decoder layers, the only site "
        f"probehook reads SAEs at (MLP, attention, hook_z and ln2 sites and transcoders are "
        f"not). Supported forms: {', '.join(HOOK_FORMS)}. If this SAE does read the residual "
        "stream, pass layer= to SAE.load."
    )


class SAE:
    """A sparse autoencoder on one layer's residual stream.

    ``SAE.load(folder)`` reads a SAELens or sparsify folder; ``layer=`` overrides the layer
    its hook name says. Attributes: ``layer``, ``d_in``, ``d_sae``, ``architecture``,
    ``hook_name``, ``k`` (topk / abstopk), ``path``, ``fingerprint`` (which SAE this is, as
    stores record it: a sha256 of the config, the safetensors header and samples of the
    weights, see :func:`~probehook.saes.files.fingerprint_of` for what it tells apart;
    :func:`~probehook.saes.files.matches_fingerprint` also checks one recorded before).
    """

    def __init__(
        self,
        weights: SAEWeights,
        layer: int,
        *,
        hook_name: str | None = None,
        path: str | None = None,
        fingerprint: str = "",
        W_dec: torch.Tensor | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.weights = weights
        self.layer = int(layer)
        self.hook_name = hook_name
        self.path = path
        self.fingerprint = fingerprint
        self.W_dec = W_dec
        """``[d_sae, d_in]`` decoder rows (steering and clamping use them)."""
        self.settings = dict(settings or {})
        """What changes the numbers besides the weights (stored with features)."""
        self.name: str | None = None
        """The SAE's name in a list given to an engine (``saes=[sae]``); a dict names it."""

    @property
    def architecture(self) -> str:
        return self.weights.architecture

    @property
    def d_in(self) -> int:
        return self.weights.d_in

    @property
    def d_sae(self) -> int:
        return self.weights.d_sae

    @property
    def k(self) -> int | None:
        return self.weights.k

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of what the engine holds of this SAE (its encoder)."""
        return sum(t.nbytes for t in vars(self.weights).values() if isinstance(t, torch.Tensor))

    def __repr__(self) -> str:
        hook = f", hook={self.hook_name!r}" if self.hook_name else ""
        return (
            f"SAE(architecture={self.architecture!r}, layer={self.layer}, d_in={self.d_in}, "
            f"d_sae={self.d_sae}{hook})"
        )

    # -- reading -------------------------------------------------------------------------

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], layer: int | None = None, *, weights: bool = True
    ) -> SAE:
        """Read an SAE folder: SAELens (``cfg.json`` + ``sae_weights.safetensors``) or
        EleutherAI sparsify (``cfg.json`` + ``sae.safetensors``). ``layer``: the probehook
        layer it reads, overriding the hook name (required when the folder names none).
        ``weights=False`` reads the config and the tensors' shapes only (an engine given a
        folder does this in the user's process: its workers read the weights), and for the
        fingerprint, the same as with weights, at most 512 KiB of each tensor; such an SAE
        describes itself but cannot encode."""
        folder = Path(path)
        if not folder.is_dir():
            raise SAEError(
                f"SAE path {os.fspath(path)!r} is not a folder; pass the folder holding "
                f"{CONFIG} and {SAELENS_WEIGHTS} (SAELens) or {SPARSIFY_WEIGHTS} (sparsify)."
            )
        config_file = folder / CONFIG
        if not config_file.is_file():
            raise SAEError(f"SAE folder {os.fspath(folder)!r} has no {CONFIG}.")
        try:
            cfg = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise SAEError(f"{os.fspath(config_file)!r} is not readable JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise SAEError(f"{os.fspath(config_file)!r} holds {type(cfg).__name__}, not a dict.")
        if (folder / SAELENS_WEIGHTS).is_file():
            return _read_saelens(folder, cfg, layer, weights)
        if (folder / SPARSIFY_WEIGHTS).is_file():
            from probehook.saes.sparsify import read_sparsify

            return SAE(**read_sparsify(folder, cfg, layer, weights))
        raise SAEError(
            f"SAE folder {os.fspath(folder)!r} has neither {SAELENS_WEIGHTS} (SAELens) nor "
            f"{SPARSIFY_WEIGHTS} (sparsify)."
        )

    # -- computing -----------------------------------------------------------------------

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Dense ``[n, d_sae]`` activations of ``rows`` (``[n, d_in]``), as SAELens's
        ``SAE.encode``."""
        return encode_dense(self.weights, self._check_rows(rows))

    def pre_activations(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, d_sae]`` pre-activations (SAELens's ``hook_sae_acts_pre``; gated: the gate),
        for margins: how near a feature was to switching."""
        return pre_activations(self.weights, self._check_rows(rows))

    def top_k(self, rows: torch.Tensor, k: int) -> SAEFeatures:
        """The engine's readout of ``rows`` offline: each row's ``k`` strongest features."""
        k = check_top_k(k, "k")
        packed = read_top_k(self.weights, self._check_rows(rows), k)
        return SAEFeatures.unpack(packed, k)

    @property
    def has_weights(self) -> bool:
        """False for an SAE read with ``SAE.load(..., weights=False)`` (shapes only)."""
        return not self.weights.W_enc.is_meta

    def check_weights(self, what: str) -> None:
        if not self.has_weights:
            raise SAEError(
                f"{what} needs the SAE's weights, but {self!r} was read without them "
                f"(weights=False); read it with SAE.load({self.path!r})."
            )

    def _check_rows(self, rows: torch.Tensor) -> torch.Tensor:
        self.check_weights("encoding rows")
        if not isinstance(rows, torch.Tensor):
            rows = torch.as_tensor(rows)
        if rows.dim() != 2 or rows.shape[1] != self.d_in:
            raise SAEError(
                f"rows of shape {tuple(rows.shape)} do not fit this SAE: it reads [n, "
                f"{self.d_in}] rows of layer {self.layer}."
            )
        return rows.to(self.weights.W_enc.device)

    def check_model(self, hidden_size: int, num_layers: int, name: str = "") -> None:
        """Refuse a model this SAE cannot read: another hidden size, too few layers."""
        label = f"SAE {name!r}" if name else "this SAE"
        if self.d_in != hidden_size:
            raise SAEError(
                f"{label} reads rows of size d_in={self.d_in}, but the model's hidden size is "
                f"{hidden_size}; use an SAE trained on this model."
            )
        if not 0 <= self.layer < num_layers:
            raise SAEError(
                f"{label} reads layer {self.layer}, but the model has {num_layers} layers "
                f"(0..{num_layers - 1}); pass layer= to SAE.load if its hook name misleads."
            )


def check_top_k(k: Any, what: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SAEError(f"{what}={k!r} must be a positive int (features kept per token).")
    return k


def _read_saelens(folder: Path, raw: dict[str, Any], layer: int | None, weights: bool) -> SAE:
    cfg = _modern(raw)
    arch = cfg.get("architecture", "standard")
    if arch in NOT_READ:
        raise SAEError(
            f"SAE {os.fspath(folder)!r} has architecture {arch!r}, which probehook does not read: "
            f"{NOT_READ[arch]}. Readable architectures: {list(ARCHITECTURES)}."
        )
    if arch not in ARCHITECTURES:
        raise SAEError(
            f"SAE {os.fspath(folder)!r} has unknown architecture {arch!r}; readable: "
            f"{list(ARCHITECTURES)}."
        )
    if cfg.get("reshape_activations", "none") != "none":
        raise SAEError(
            f"SAE {os.fspath(folder)!r} reads attention heads (reshape_activations="
            f"{cfg['reshape_activations']!r}), not the residual stream."
        )
    norm = cfg.get("normalize_activations", "none")
    if norm in ("expected_average_only_in", "covariance_whitening"):
        norm = "none"  # SAELens's encode does nothing for these either (folded at training)
    if norm not in NORMALIZATIONS:
        raise SAEError(
            f"SAE {os.fspath(folder)!r} has normalize_activations={norm!r}; probehook reads "
            f"{list(NORMALIZATIONS)}."
        )
    hook = _hook_name(cfg)
    if layer is None:
        if hook is None:
            raise SAEError(
                f"SAE {os.fspath(folder)!r} names no hook (metadata.hook_name), so its layer is "
                "unknown; pass layer= to SAE.load."
            )
        layer = layer_of_hook(hook)
    tensors = read_tensors(folder / SAELENS_WEIGHTS, weights)
    need = {"W_enc", "W_dec", "b_dec"} | (
        {"b_gate", "b_mag", "r_mag"} if arch == "gated" else {"b_enc"}
    )
    if arch == "jumprelu":
        need.add("threshold")
    missing = sorted(need - set(tensors))
    if missing:
        raise SAEError(f"SAE {os.fspath(folder)!r} ({arch}) lacks tensor(s) {missing}.")
    W_enc, W_dec = tensors["W_enc"], tensors["W_dec"]
    d_in, d_sae = int(cfg.get("d_in", W_enc.shape[0])), int(cfg.get("d_sae", W_enc.shape[1]))
    if tuple(W_enc.shape) != (d_in, d_sae) or tuple(W_dec.shape) != (d_sae, d_in):
        raise SAEError(
            f"SAE {os.fspath(folder)!r}: W_enc {tuple(W_enc.shape)} and W_dec "
            f"{tuple(W_dec.shape)} do not match d_in={d_in}, d_sae={d_sae}."
        )
    k = None
    norms = None
    if arch in ("topk", "abstopk"):
        k = int(cfg.get("k", 100))
        if cfg.get("rescale_acts_by_decoder_norm", False):
            norms = W_dec.norm(dim=-1)
    weights = SAEWeights(
        arch,
        W_enc,
        tensors.get("b_enc"),
        tensors["b_dec"],
        bool(cfg.get("apply_b_dec_to_input", True)),
        norm,
        threshold=tensors.get("threshold"),
        b_gate=tensors.get("b_gate"),
        b_mag=tensors.get("b_mag"),
        r_mag_exp=tensors["r_mag"].exp() if arch == "gated" else None,
        decoder_norms=norms,
        k=k,
    )
    settings = {
        "format": "saelens",
        "architecture": arch,
        "apply_b_dec_to_input": weights.apply_b_dec_to_input,
        "normalize_activations": norm,
        "k": k,
        "rescale_acts_by_decoder_norm": norms is not None,
        "dtype": str(W_enc.dtype).removeprefix("torch."),
    }
    return SAE(
        weights,
        layer,
        hook_name=hook,
        path=os.fspath(folder),
        fingerprint=fingerprint_of(folder, SAELENS_WEIGHTS),
        W_dec=W_dec,
        settings=settings,
    )


def _modern(cfg: dict[str, Any]) -> dict[str, Any]:
    """A pre-6.0 SAELens config in 6.x terms (as SAELens's ``handle_pre_6_0_config``): hook
    names renamed, ``activation_fn: topk`` as ``architecture: topk``, boolean normalisation."""
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    if "sae_lens_version" in cfg or "sae_lens_version" in metadata:
        return cfg
    out = dict(cfg)
    if "hook_point" in out and "hook_name" not in out:
        out["hook_name"] = out.pop("hook_point")
    activation = out.get("activation_fn", out.get("activation_fn_str"))
    k = (out.get("activation_fn_kwargs") or {}).get("k")
    if activation == "topk" and k is not None:  # saved as "standard" before 6.0
        out["architecture"], out["k"] = "topk", k
    if isinstance(out.get("normalize_activations"), bool):
        out["normalize_activations"] = (
            "expected_average_only_in" if out["normalize_activations"] else "none"
        )
    return out


def _hook_name(cfg: dict[str, Any]) -> str | None:
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook = metadata.get("hook_name", cfg.get("hook_name"))
    return hook if isinstance(hook, str) and hook else None
