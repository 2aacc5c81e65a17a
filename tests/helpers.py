"""The test suite's helpers: random-weight checkpoints of many architectures, random probes,
checks on probe scores, a JSON POST. (probehook.testing keeps what users of the examples and
benchmarks need: Hugging Face parity references, ``ServerProcess``, model paths.)

Everything here builds models locally; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from probehook.models import tiny_model_path
from probehook.testing import minilm_path

ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "opt",
    "gpt_neox",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "mixtral",
    "qwen3_moe",
    "granite",
)
"""Short names ``build_random_checkpoint`` accepts (transformers' ``model_type`` spelling)."""


def _arch_config(arch: str, common: dict[str, Any], hidden: int, heads: int) -> dict[str, Any]:
    """Config keyword arguments of one tiny architecture (its model_type and quirks)."""
    head_dim = hidden // heads
    vocab, layers = common["vocab_size"], common["num_hidden_layers"]
    ids = {k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if arch == "gpt2":  # its own names; learned positions
        return dict(
            model_type="gpt2", vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
            n_positions=256, **ids,
        )  # fmt: skip
    if arch == "opt":
        return dict(
            model_type="opt", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, ffn_dim=common["intermediate_size"],
            word_embed_proj_dim=hidden, max_position_embeddings=256, **ids,
        )  # fmt: skip
    if arch == "gpt_neox":
        return dict(
            model_type="gpt_neox", vocab_size=vocab, hidden_size=hidden,
            num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=common["intermediate_size"], max_position_embeddings=256,
            rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, **ids,
        )  # fmt: skip
    extra: dict[str, Any] = {}
    if arch in ("qwen3", "gemma", "gemma2", "gemma3", "qwen3_moe"):
        extra["head_dim"] = head_dim  # these default to a head_dim of their own
    if arch in ("mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"):
        extra["sliding_window"] = None
    if arch.startswith("gemma"):
        extra["tie_word_embeddings"] = True  # vLLM's Gemma classes have no separate lm_head
    if arch == "gemma2":
        extra.update(query_pre_attn_scalar=head_dim, sliding_window=64)
    if arch == "gemma3":
        # model_type gemma3_text is the text-only Gemma3ForCausalLM
        extra.update(query_pre_attn_scalar=head_dim, sliding_window=64, sliding_window_pattern=2)
        arch = "gemma3_text"
    if arch == "mixtral":
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        extra.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
            decoder_sparse_step=1, norm_topk_prob=True,
        )  # fmt: skip
    if arch == "granite":  # multipliers away from 1, so a missing one shows
        extra.update(
            residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.1,
            logits_scaling=2.0,
        )  # fmt: skip
    return dict(model_type=arch, **{**common, **extra})


def build_random_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    spread_norms: bool = False,
    tie_embeddings: bool = False,
    vocab_size: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight checkpoint of architecture ``arch`` (one of ``ARCHITECTURES``;
    GQA allowed where the architecture has it) to ``out_dir``.

    head_dim is ``hidden_size // num_heads``; keep it at 64, which vLLM's CPU attention accepts.
    The bundled tiny model's tokenizer is copied in so vLLM and HF tokenise identically.
    ``spread_norms`` moves norm weights away from their init (1, or 0 for Gemma's offset
    form), so that a norm skipped or applied twice shows in the rows. ``tie_embeddings``:
    the LM head is the embedding matrix (no ``lm_head.weight`` in the checkpoint).
    ``vocab_size``: more token ids than the tokenizer's (a vocabulary that spans both ranks of
    a TP=2 engine; generate with ``detokenize=False``: the tokenizer knows 19 of them).
    ``overrides``: config fields set over the architecture's (a small sliding window, a
    logit soft-cap).
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not one of {ARCHITECTURES}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    common = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen2":
        common["use_sliding_window"] = False
    kwargs = {**_arch_config(arch, common, hidden_size, num_heads), **(overrides or {})}
    config = CONFIG_MAPPING[kwargs.pop("model_type")](**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Default init is tiny (std 0.02); a larger spread makes layers differ visibly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        if spread_norms:  # after the matrices, which stay what they were without it
            for name, p in model.named_parameters():
                if p.dim() == 1 and ("norm" in name or "ln" in name):
                    p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_random_bert_classifier(
    out_dir: str | Path, *, num_labels: int = 3, num_layers: int = 2, seed: int = 0
) -> Path:
    """Write a random-weight ``BertForSequenceClassification`` (hidden 128, 2 heads of 64)
    with MiniLM's tokenizer: a classifier and cross-encoder for pooling tests."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=256,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


ATTENTION_LAYERS = [1, 3]
"""The layers whose attention per head the compiled engine under load reads (top 4)."""

PROMPTS = ["1+2=", "12+34=56. 7+", "99+99=198. 3+4=7. 50+5", "0"]


def worker_stats(llm: Any) -> dict[str, int]:
    """probehook's counters from the collecting worker (rank 0)."""
    return next(s for s in llm.collective_rpc("probehook_stats") if s is not None)


def random_probes(hidden_size: int, seed: int = 0) -> dict[str, Any]:
    """Four random probes of every kind over layers 0, 1 and 3, scaled so that scores are
    spread out (not saturated) on a random-weight model's residual stream."""
    from probehook.probes import LinearProbe

    g = torch.Generator().manual_seed(seed)

    def weight(outputs: int) -> torch.Tensor:
        return torch.randn(outputs, hidden_size, generator=g) / hidden_size**0.5

    return {
        "truth": LinearProbe(weight(1), torch.zeros(1), layer=1, kind="binary", name="truth"),
        "other": LinearProbe(weight(1), torch.ones(1), layer=1, kind="binary", name="other"),
        "topic": LinearProbe(
            weight(3),
            torch.zeros(3),
            layer=3,
            kind="multiclass",
            label_names=["a", "b", "c"],
            name="topic",
        ),
        "size": LinearProbe(weight(1), torch.zeros(1), layer=0, kind="regression", name="size"),
    }


def assert_scores_match_rows(output: Any, probes: dict[str, Any], tol: float = 1e-3) -> int:
    """Assert runtime scores equal ``probe.score`` of the rows the same output captured, for
    every probe whose layer was captured; return how many score tensors were compared."""
    compared = 0
    pairs = [(output.prefill_probe_scores, output.prefill_hidden_states)]
    pairs += [(c.probe_scores, c.hidden_states) for c in output.outputs]
    for scores, rows in pairs:
        for name, probe in probes.items():
            if probe.layer not in rows:
                continue
            assert name in scores, f"no runtime scores for probe {name!r}"
            want = probe.score(rows[probe.layer])
            got = scores[name]
            assert got.dtype == torch.float32 and got.shape == want.shape, (got.shape, want.shape)
            diff = (got - want).abs().max().item() if len(got) else 0.0
            assert diff <= tol, f"probe {name}: max abs diff {diff}"
            compared += 1
    return compared


def assert_same_top_k(
    ids: Any, values: Any, want_ids: Any, want_values: Any, atol: float = 1e-5
) -> None:
    """Top-k entries computed over another batch shape than the reference (rows of one step
    against one row alone, tiles): the same values to float rounding, and the same ids except
    where neighbouring values are within ``atol`` (a near-tie, which two batch shapes may
    order either way; the last entry may swap with the first one left out)."""
    ids, want_ids = torch.as_tensor(ids), torch.as_tensor(want_ids)
    values = torch.as_tensor(values, dtype=torch.float32)
    want_values = torch.as_tensor(want_values, dtype=torch.float32)
    torch.testing.assert_close(values, want_values, atol=atol, rtol=0)
    k = ids.shape[-1]
    for row, j in (ids != want_ids).nonzero().tolist() if ids.dim() > 1 else []:
        v = want_values[row]
        near = [abs(float(v[j] - v[i])) for i in (j - 1, j + 1) if 0 <= i < k]
        assert j == k - 1 or min(near) <= 2 * atol, (row, j, ids[row], want_ids[row])


RECORD_GAP = 1e-4
"""The least margin between a record and the scores before it: a threshold halfway between
them stays on its side when another run (another batch shape) moves a score in its last bits."""


def first_record(values: torch.Tensor, start: int = 2) -> tuple[int, float, str]:
    """A row ``k >= start`` and a threshold that only rows from ``k`` on cross: the first new
    maximum (direction "above") or new minimum ("below") of the scores, by at least
    :data:`RECORD_GAP`."""
    for k in range(start, len(values)):
        if values[k] > values[:k].max() + RECORD_GAP:
            return k, float((values[:k].max() + values[k]) / 2), "above"
        if values[k] < values[:k].min() - RECORD_GAP:
            return k, float((values[:k].min() + values[k]) / 2), "below"
    raise AssertionError("no new maximum or minimum; pick another prompt")


def post_json(port: int, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to a local server's ``route``; the status and the JSON answer (errors
    included, which urllib would raise)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def reference_steering() -> Any:
    """The reference engine's steering vector "up" (tests/conftest.py ``reference_llm``, the
    server's --steer file): layer 2, between the captured layers 0 and 3; norm 6."""
    from probehook import SteeringVector

    direction = torch.randn(128, generator=torch.Generator().manual_seed(5))
    return SteeringVector({2: direction / direction.norm() * 6.0}, name="up")


def corrupt_wires_past_the_front_end(
    session: Any, monkeypatch: Any, corruptions: list[tuple[str, Any]]
) -> None:
    """From now on (until ``monkeypatch.undo()``), a request whose ``SamplingParams.seed`` is
    odd reaches vLLM with ``corruptions[seed // 2]`` set in its probehook wire, a wire the
    front end would never write; the session itself keeps and reads the good one (what a path
    that skipped the front end would send the worker). Even seeds are left alone."""
    import copy

    real_tag, real_register, real_salt = session.tag, session.register, session.cache_salt
    swapped: dict[int, tuple[Any, Any]] = {}

    def tag(params: Any, stream: bool = False) -> Any:
        good = real_tag(params, stream)
        i = params.seed  # which request this is (vLLM may add them in any order)
        if i % 2 == 0:
            return good
        key, value = corruptions[i // 2]
        bad = copy.copy(good)
        bad.extra_args = {"probehook": {**good.extra_args["probehook"], key: value}}
        swapped[id(bad)] = (bad, good)  # the bad one stays alive while it is in the map
        return bad

    def good(params: Any) -> Any:
        pair = swapped.get(id(params))
        return pair[1] if pair else params

    monkeypatch.setattr(session, "tag", tag)
    monkeypatch.setattr(session, "register", lambda r, e, p: real_register(r, e, good(p)))
    monkeypatch.setattr(session, "cache_salt", lambda params: real_salt(good(params)))


COMPILED_LENS_LAYERS = [1, 3]
"""The layers ``compiled_llm``'s lenses read (3 is the last: the J and tuned lenses are the
identity there)."""


def write_random_lenses(
    out_dir: str | Path, hidden_size: int, num_layers: int, seed: int = 0
) -> dict[str, str]:
    """A random J-lens file (TransformerLens's artifact format: fp16 matrices for every layer
    but the last) and a random tuned-lens folder (the ``tuned-lens`` package's format:
    ``config.json`` and ``params.pt``, translator ``i`` reading HF ``hidden_states[i]``), for
    the model's shape: ``{"j": path, "tuned": folder}``. The maps are far enough from the
    identity that a lens applied at the wrong layer, transposed, or not at all, shows."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d = hidden_size

    def near_identity(scale: float) -> torch.Tensor:
        return torch.eye(d) + scale * torch.randn(d, d, generator=g) / d**0.5

    j_path = out / "j_lens.pt"
    torch.save(
        {
            "J": {layer: near_identity(0.5).half() for layer in range(num_layers - 1)},
            "n_prompts": 1,
            "source_layers": list(range(num_layers - 1)),
            "d_model": d,
            "metadata": {"model_name": "random-test-model"},
        },
        j_path,
    )
    tuned = out / "tuned_lens"
    tuned.mkdir(exist_ok=True)
    (tuned / "config.json").write_text(
        json.dumps({"d_model": d, "num_hidden_layers": num_layers, "bias": True})
    )
    params = {}
    for i in range(num_layers):
        params[f"{i}.weight"] = 0.5 * torch.randn(d, d, generator=g) / d**0.5
        params[f"{i}.bias"] = 0.1 * torch.randn(d, generator=g)
    torch.save(params, tuned / "params.pt")
    return {"j": str(j_path), "tuned": str(tuned)}


def write_options() -> tuple[str, ...]:
    """The request options of the interventions registered in this process, which every front
    end accepts beside the built-in keys (and lists in an unknown option's error)."""
    from probehook.outputs import OUTPUT_PROCESSORS
    from probehook.outputs.intervention import interventions

    return tuple(interventions(OUTPUT_PROCESSORS))
