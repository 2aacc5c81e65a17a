"""Fitting a Jacobian lens (``JacobianLens.fit``) on a Hugging Face checkpoint, with autograd.

For each source layer ``l`` the lens is one ``[d, d]`` matrix: the Jacobian of the final block's
output (before the final norm) with respect to the output of block ``l`` (probehook's layer
``l``, HF ``hidden_states[l + 1]``), summed over target positions ``t' >= t`` and averaged over
source positions ``t`` and prompts. This is the estimator of TransformerLens 3.9's
``JacobianLens.fit`` (itself Anthropic's reference), reproduced on a plain ``transformers``
model so that probehook needs neither TransformerLens nor vLLM to fit one, and so that a lens
fitted here equals, to float rounding, one fitted there: same tokenisation (BOS prepended, the
model's context length), same excluded positions (the first ``skip_first_positions`` and the
last), same batching of one-hot cotangents, same averaging order, same artifact file.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from probehook._version import __version__
from probehook.capture_config import resolve_layers

DEFAULT_SKIP_FIRST_POSITIONS = 16
"""Leading positions left out of the source average (attention sinks), as in TransformerLens."""

HOOK_CONVENTION = "blocks.{layer}.hook_out"
"""TransformerLens's name for the site probehook calls layer ``l``: the output of block ``l``."""

_FIT_KEYS = (
    "model_name", "model_revision", "model_system", "processing", "hook_convention", "corpus",
    "n_prompts", "fit_dtype", "target_layer", "dim_batch", "max_seq_len",
    "skip_first_positions", "probehook_version",
)  # fmt: skip


def fit_jacobian_lens(
    model_path: str | os.PathLike[str],
    prompts: Sequence[str],
    layers: Sequence[int] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    corpus: str | None = None,
    dim_batch: int = 8,
    max_seq_len: int = 128,
    skip_first_positions: int = DEFAULT_SKIP_FIRST_POSITIONS,
    metadata: Mapping[str, Any] | None = None,
    progress: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """Fit a Jacobian lens of the causal LM at ``model_path`` on ``prompts``.

    Args:
        model_path: A local Hugging Face checkpoint (or hub id) with its tokenizer.
        prompts: Prompt strings. One too short to have a valid position
            (``<= skip_first_positions + 1`` tokens) is skipped with a warning.
        layers: Source layers (negative ones count from the end); default every layer but
            the last, whose transport is the identity.
        path: Also save the lens there, in TransformerLens's artifact format (fp16).
        corpus: Name of the prompt corpus, recorded in the metadata.
        dim_batch: Output dimensions per backward pass (the prompt is replicated this many
            times); faster when larger, same result.
        max_seq_len: Prompts are cut to this many tokens.
        skip_first_positions: Leading positions left out of the source average.
        metadata: Extra provenance, merged into the returned metadata.
        progress: Show a progress bar over prompts.
        device: Where the model runs (it runs in float32).

    Returns:
        ``{"jacobians": {layer: float32 [d, d] on CPU}, "n_prompts": int, "d_model": int,
        "metadata": dict}``.

    Raises:
        ValueError: bad layers or settings, metadata that overrides a fit key, or no prompt
            long enough to fit on.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    if dim_batch < 1:
        raise ValueError(f"dim_batch must be >= 1, got {dim_batch}")
    if skip_first_positions < 0:
        raise ValueError(f"skip_first_positions must be >= 0, got {skip_first_positions}")
    clash = sorted(set(_FIT_KEYS).intersection(metadata or {}))
    if clash:
        raise ValueError(f"metadata cannot override the fit's own keys: {clash}")

    # eager: the attention TransformerLens's bridge forces, so both fits round alike
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager"
    )
    model.to(device).eval().requires_grad_(False)  # frozen: the graph starts at the residual
    blocks = _decoder_layers(model)
    target_layer = len(blocks) - 1
    sources = _source_layers(layers, len(blocks))
    d_model = int(model.config.hidden_size)
    tokenize = _tokenizer(model_path, model.config)

    sums = {layer: torch.zeros(d_model, d_model) for layer in sources}
    n_done = 0
    for prompt in tqdm(prompts, desc="fitting J-lens", unit="prompt", disable=not progress):
        tokens = tokenize(prompt)[:max_seq_len]
        if len(tokens) <= skip_first_positions + 1:
            warnings.warn(
                f"skipping a prompt of {len(tokens)} tokens (need > {skip_first_positions + 1})",
                stacklevel=2,
            )
            continue
        ids = torch.tensor([tokens], device=device)
        _add_prompt(
            model, blocks, ids, sources, target_layer, sums, dim_batch, skip_first_positions
        )
        n_done += 1
    if n_done == 0:
        raise ValueError("every prompt was too short to have a valid position; nothing was fitted")

    revision = getattr(model.config, "_commit_hash", None)
    fit_metadata = {
        "model_name": str(model_path),
        "model_revision": revision if isinstance(revision, str) and revision else None,
        "model_system": "transformers",
        "processing": {"compatibility_mode": False, "weight_basis": "raw_huggingface"},
        "hook_convention": HOOK_CONVENTION,
        "corpus": corpus,
        "n_prompts": n_done,
        "fit_dtype": "float32",
        "target_layer": target_layer,
        "dim_batch": dim_batch,
        "max_seq_len": max_seq_len,
        "skip_first_positions": skip_first_positions,
        "probehook_version": __version__,
    }
    result = {
        "jacobians": {layer: sums[layer] / n_done for layer in sources},
        "n_prompts": n_done,
        "d_model": d_model,
        "metadata": {**(metadata or {}), **fit_metadata},
    }
    if path is not None:
        save_artifact(path, result)
    return result


def save_artifact(
    path: str | os.PathLike[str], lens: Mapping[str, Any], dtype: torch.dtype = torch.float16
) -> None:
    """Write ``fit_jacobian_lens``'s result as TransformerLens (and the reference) save it:
    keys ``J``, ``n_prompts``, ``source_layers``, ``d_model`` and ``metadata``."""
    jacobians = lens["jacobians"]
    payload: dict[str, Any] = {
        "J": {int(layer): matrix.to(dtype) for layer, matrix in jacobians.items()},
        "n_prompts": int(lens["n_prompts"]),
        "source_layers": sorted(int(layer) for layer in jacobians),
        "d_model": int(lens["d_model"]),
    }
    if lens.get("metadata"):
        payload["metadata"] = dict(lens["metadata"])
    torch.save(payload, path)


def _add_prompt(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    ids: torch.Tensor,
    sources: list[int],
    target_layer: int,
    sums: dict[int, torch.Tensor],
    dim_batch: int,
    skip_first_positions: int,
) -> None:
    """Add one prompt's Jacobians (rows averaged over its valid source positions) to ``sums``.

    The prompt is replicated ``dim_batch`` times and copy ``i`` gets the one-hot cotangent of
    output dimension ``start + i`` at every valid position at once: causal attention makes the
    gradient at source ``t`` the sum over targets ``t' >= t`` with no masking.
    """
    d_model = sums[sources[0]].shape[0]
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.ndim != 3 or hidden.shape[-1] != d_model:
                raise ValueError(
                    f"block {layer} outputs shape {tuple(hidden.shape)}, not a "
                    f"[batch, position, {d_model}] residual stream"
                )
            if layer == sources[0]:  # the root of the graph (parameters are frozen)
                hidden.requires_grad_(True)
            captured[layer] = hidden

        return hook

    hooked = sorted({*sources, target_layer})
    handles = [blocks[layer].register_forward_hook(hook_for(layer)) for layer in hooked]
    try:
        with torch.enable_grad():
            model.base_model(input_ids=ids.expand(dim_batch, -1), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    target = captured[target_layer]
    inputs = [captured[layer] for layer in sources]
    valid = torch.arange(skip_first_positions, ids.shape[1] - 1, device=target.device)
    copies = torch.arange(dim_batch, device=target.device)
    cotangent = torch.zeros_like(target)
    for start in range(0, d_model, dim_batch):
        n = min(dim_batch, d_model - start)
        cotangent.zero_()
        cotangent[copies[:n, None], valid[None, :], start + copies[:n, None]] = 1.0
        last = start + dim_batch >= d_model
        grads = torch.autograd.grad(target, inputs, cotangent, retain_graph=not last)
        for layer, grad in zip(sources, grads, strict=True):
            sums[layer][start : start + n] += grad[:n, valid].mean(dim=1).cpu()


def _source_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """Sorted source layers, negative ones resolved; each must be below the final layer."""
    if layers is None:
        return list(range(num_layers - 1))
    resolved = list(resolve_layers(layers, num_layers))
    if resolved[-1] >= num_layers - 1:
        raise ValueError(
            f"every source layer must be below the final layer {num_layers - 1}; got {resolved}"
        )
    return resolved


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The decoder-layer list of an HF causal LM (Llama-type ``model.layers``, GPT-2's
    ``transformer.h``, OPT's ``model.decoder.layers``)."""
    base = model.base_model
    for name in ("layers", "h", "decoder.layers"):
        module: Any = base
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"no decoder layers found on {type(base).__name__}")


def _tokenizer(model_path: str | os.PathLike[str], config: Any) -> Callable[[str], list[int]]:
    """``prompt -> token ids`` as TransformerLens's ``to_tokens`` makes them, so that both fits
    see the same tokens: BOS first (the EOS token stands in for a missing one; asked of the
    tokenizer, else prepended as text), no appended EOS, cut at the model's context length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.bos_token is not None and not getattr(tokenizer, "add_bos_token", False):
        # a ValueError: a BOS its post-processor cannot express; it is prepended as text below
        with contextlib.suppress(ValueError):
            tokenizer = AutoTokenizer.from_pretrained(model_path, add_bos_token=True)
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.eos_token
    probe = tokenizer.encode("a")
    leading = {tokenizer.bos_token_id, getattr(tokenizer, "cls_token_id", None)} - {None}
    prepends_bos = len(probe) > 1 and probe[0] in leading
    eos_id = tokenizer.eos_token_id
    appends_eos = len(probe) > 1 and eos_id is not None and probe[-1] == eos_id
    bos = tokenizer.bos_token
    bos_is_one_token = (
        bos is not None and len(tokenizer(bos, add_special_tokens=False)["input_ids"]) == 1
    )
    n_ctx = _context_length(config)

    def tokenize(prompt: str) -> list[int]:
        text = bos + prompt if not prepends_bos and bos_is_one_token else prompt
        ids = tokenizer(text, truncation=n_ctx is not None, max_length=n_ctx)["input_ids"]
        while appends_eos and len(ids) > 1 and ids[-1] == eos_id:
            ids = ids[:-1]
        return list(ids)

    return tokenize


def _context_length(config: Any) -> int | None:
    """The context length TransformerLens reads off an HF config (its ``n_ctx``; None: none)."""
    for name in ("n_positions", "max_position_embeddings", "max_context_length", "max_length",
                 "seq_length", "max_sequence_length"):  # fmt: skip
        if hasattr(config, name):
            return getattr(config, name)
    return 2048
