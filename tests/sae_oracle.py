"""SAEs built and saved with SAELens's own classes, and the margin rule that compares
probehook's top-k readout with SAELens's dense ``encode`` (the oracle).

Exact top-k sets flip on 1e-4 noise at a JumpReLU threshold or at the k-th value, so a feature
may differ between the two only within ``tau`` of where it would switch: of its threshold (or
0, or the gate) or of the row's k-th value; ``tau = TAU * max |pre-activation|`` of the row.
"""

from __future__ import annotations

from pathlib import Path

import torch

TAU = 1e-3
ARCHITECTURES = ("standard", "gated", "jumprelu", "topk", "abstopk")


def make_saelens_sae(
    arch: str,
    folder: Path,
    d_in: int,
    d_sae: int,
    hook_name: str,
    seed: int = 0,
    **cfg: object,
) -> Path:
    """A random SAE of ``arch`` built with SAELens's class, saved with its ``save_model``."""
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "abstopk": (sae_lens.AbsTopKSAE, sae_lens.AbsTopKSAEConfig),
    }
    cls, config_cls = classes[arch]
    config = config_cls(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name=hook_name), **cfg)
    sae = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            scale = d_in**-0.5 if name.startswith("W_") else 0.1
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
        if arch == "jumprelu":
            sae.threshold.copy_(torch.rand(d_sae, generator=gen) * 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    sae.save_model(folder)
    return folder


def oracle(folder: Path):
    """SAELens's own reading of a saved SAE."""
    from sae_lens import SAE as LensSAE

    return LensSAE.load_from_disk(str(folder))


def oracle_encode(lens_sae, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SAELens's dense activations and pre-activations (gated: the gate) of ``rows``."""
    with torch.no_grad():
        _, cache = lens_sae.run_with_cache(rows.float())
        acts = lens_sae.encode(rows.float())
        pre = cache["hook_sae_acts_pre"]
        if lens_sae.cfg.architecture() == "gated":  # its pre hook holds the magnitude path
            sae_in = lens_sae.process_sae_in(rows.float())
            pre = sae_in @ lens_sae.W_enc + lens_sae.b_gate
    return acts, pre


def near_switch(lens_sae, rows, pre: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``[n, d_sae]`` bool: features within ``tau`` (``[n, 1]``) of switching on or off: a
    ReLU's pre-activation near 0, a JumpReLU's near its threshold, a gate (or a gated
    magnitude) near 0, a topk pre-activation near the SAE's own k-th."""
    arch = lens_sae.cfg.architecture()
    # abstopk has no ReLU: a feature switches only at the SAE's k-th |value|.
    near = torch.zeros_like(pre, dtype=torch.bool) if arch == "abstopk" else pre.abs() <= tau
    if arch == "jumprelu":
        near |= (pre - lens_sae.threshold).abs() <= tau
    elif arch == "gated":
        with torch.no_grad():
            sae_in = lens_sae.process_sae_in(rows.float())
            magnitude = sae_in @ lens_sae.W_enc * lens_sae.r_mag.exp() + lens_sae.b_mag
        near |= magnitude.abs() <= tau
    elif arch in ("topk", "abstopk"):
        rank = pre.abs() if arch == "abstopk" else pre
        k = min(lens_sae.cfg.k, rank.shape[1])
        kth = rank.topk(k, dim=1).values[:, -1:]
        near |= (rank - kth).abs() <= tau
    return near


def assert_features_match(indices, values, l0, lens_sae, rows, k, tau=TAU) -> int:
    """Fail unless probehook's readout of ``rows`` (``indices``/``values`` ``[n, k]``, ``l0``)
    equals SAELens's within the margin rule; return how many features the rule excused."""
    acts, pre = oracle_encode(lens_sae, rows)
    signed = lens_sae.cfg.architecture() == "abstopk"
    row_tau = tau * pre.abs().max(dim=1, keepdim=True).values
    near = near_switch(lens_sae, rows, pre, row_tau)
    rank = acts.abs() if signed else acts
    excused = 0
    for r in range(rows.shape[0]):
        t = float(row_tau[r])
        order = sorted(range(acts.shape[1]), key=lambda i: (-float(rank[r, i]), i))
        want = [i for i in order[:k] if rank[r, i] > 0]
        kth = float(rank[r, order[min(k, len(order)) - 1]])
        got = [int(i) for i in indices[r] if int(i) >= 0]
        for feature in set(want) ^ set(got):
            at_kth = abs(float(rank[r, feature]) - kth) <= t
            assert bool(near[r, feature]) or at_kth, (
                f"row {r}: feature {feature} differs (probehook {got}, SAELens {want}); "
                f"activation {float(acts[r, feature]):.6f}, pre {float(pre[r, feature]):.6f}, "
                f"k-th {kth:.6f}, tau {t:.2e}"
            )
            excused += 1
        for slot, feature in enumerate(got):
            assert abs(float(values[r, slot]) - float(acts[r, feature])) <= t, (
                f"row {r}: feature {feature} = {float(values[r, slot])}, SAELens "
                f"{float(acts[r, feature])}"
            )
        ranks = [float(rank[r, i]) for i in got]
        assert all(a >= b - t for a, b in zip(ranks, ranks[1:], strict=False)), (
            f"row {r}: order {got}"
        )
        nonzero = int((acts[r] != 0).sum())
        assert abs(int(l0[r]) - nonzero) <= int(near[r].sum()), (
            f"row {r}: l0 {int(l0[r])}, SAELens {nonzero}"
        )
        assert all(int(i) == -1 for i in indices[r, len(got) :]), f"row {r}: padding"
    return excused


def assert_output_features(out, model_dir, lenses: dict, layers: dict, names, k: int) -> None:
    """Every completion's and the prompt's features of ``out`` (a finished, whole output)
    equal SAELens's (``lenses``: name -> oracle SAE; ``layers``: name -> layer) on Hugging
    Face's rows of its tokens."""
    from probehook.testing import hf_residual_stream

    prompt = list(out.prompt_token_ids)
    p = len(prompt)
    assert sorted(out.prefill_sae_features) == sorted(names)
    ref = hf_residual_stream(model_dir, prompt)
    for name in names:
        f = out.prefill_sae_features[name]
        assert f.indices.shape == (p, k) and f.values.shape == (p, k) and f.l0.shape == (p,)
        assert_features_match(f.indices, f.values, f.l0, lenses[name], ref[layers[name]], k)
    for completion in out.outputs:
        n = len(completion.token_ids)
        ref = hf_residual_stream(model_dir, prompt + list(completion.token_ids))
        assert sorted(completion.sae_features) == sorted(names)
        for name in names:
            f = completion.sae_features[name]
            assert f.indices.shape == (n, k) and f.indices.dtype == torch.int64
            rows = ref[layers[name], p - 1 : p - 1 + n]
            assert_features_match(f.indices, f.values, f.l0, lenses[name], rows, k)
    assert out.sae_features is out.outputs[0].sae_features


def hf_streams_clamped(
    model_dir, token_ids, layer: int, lens_sae, held: dict[int, float], then=None
):
    """Hugging Face's residual streams (``[layers, T, H]``, as ``hf_residual_stream``) with
    SAE features held on every token at ``layer``: a forward hook adds
    ``sum_f (v_f - a_f(x)) * W_dec[f]`` to the layer's output, ``a`` SAELens's encode;
    ``then(stream)``, if given, applies after the clamp in the same hook (a steering op)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    features = torch.tensor(list(held), dtype=torch.int64)
    values = torch.tensor(list(held.values()), dtype=torch.float32)

    def clamp(module, args, output):
        stream = output[0] if isinstance(output, tuple) else output
        acts = lens_sae.encode(stream[0])[:, features]
        stream = stream + ((values - acts) @ lens_sae.W_dec[features]).unsqueeze(0)
        if then is not None:
            stream = then(stream)
        return (stream, *output[1:]) if isinstance(output, tuple) else stream

    captured = []
    handles = [
        model.model.layers[layer].register_forward_hook(clamp),
        model.model.norm.register_forward_pre_hook(lambda m, args: captured.append(args[0])),
    ]
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    streams = [h[0] for h in out.hidden_states[1:-1]] + [captured[-1][0]]
    return torch.stack(streams)
