"""Attention per head from query rows and keys (probehook/worker/attention_rows.py; issue 51):
Hugging Face's eager ``output_attentions`` on the tiny model is the oracle (the post-RoPE
queries and keys rebuilt from its own modules); each kernel term (soft-cap, sliding window,
sinks, grouped-query heads, min_p, spans) against the formula written out."""

from __future__ import annotations

import math

import pytest
import torch

from probehook.worker.attention_rows import AttentionTerms, HeadReadings, head_readings

K = 4


def assert_readings_match(
    got, probs: torch.Tensor, spans: list[tuple[int, int]], min_p: float = 0.0
) -> None:
    """``got`` against a reference ``probs`` ``[rows, heads, keys]`` (keys at positions
    0..keys-1): top-k sets where the probabilities are more than 1e-5 apart (those under
    ``min_p`` left out), probabilities, entropy and span masses within 1e-4."""
    top, at = probs.topk(min(K, probs.shape[-1]), dim=-1)
    kept = torch.where(top >= min_p, top, 0.0)
    torch.testing.assert_close(got.probs[..., : top.shape[-1]], kept, rtol=0, atol=1e-4)
    for r, h in zip(*torch.where(torch.ones(probs.shape[:2], dtype=torch.bool)), strict=True):
        wanted = {int(p) for p, v in zip(at[r, h], top[r, h], strict=True)
                  if v > 1e-5 and v > min_p + 1e-5}  # fmt: skip
        read = {int(p) for p in got.positions[r, h] if p >= 0}
        assert all(probs[r, h, p] >= min_p - 1e-5 for p in read)
        # ties may swap: every position read is within 1e-5 of the k-th probability or above
        assert wanted - read <= {
            int(p) for p in at[r, h] if abs(probs[r, h, p] - top[r, h, -1]) < 1e-5
        }
        assert all(probs[r, h, p] >= top[r, h, -1] - 1e-5 for p in read)
    logp = probs.clamp_min(1e-30).log()
    entropy = -(probs * torch.where(probs > 0, logp, 0.0)).sum(-1)
    torch.testing.assert_close(got.entropy, entropy, rtol=0, atol=1e-4)
    for s, (lo, hi) in enumerate(spans):
        torch.testing.assert_close(got.spans[..., s], probs[..., lo:hi].sum(-1), rtol=0, atol=1e-4)


def readings_of(rows) -> HeadReadings:
    """An attention readout's rows (``AttentionRows``, or their columns by name) as
    ``head_readings`` gives them, for :func:`assert_readings_match`."""
    get = rows.__getitem__ if isinstance(rows, dict) else lambda name: getattr(rows, name)
    return HeadReadings(get("positions"), get("probs"), get("entropy"), get("span_mass"))


def test_equal_to_hugging_face_eager_attention_on_the_tiny_model() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from probehook import tiny_model_path

    path = str(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")  # fmt: skip
    ids = AutoTokenizer.from_pretrained(path)("12+34=46", return_tensors="pt").input_ids
    n = ids.shape[1]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_attentions=True)
        positions = torch.arange(n)
        spans = [(0, 2), (3, n)]
        for index, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(out.hidden_states[index])
            attn = layer.self_attn
            d = attn.head_dim
            q = attn.q_proj(x).view(1, n, -1, d).transpose(1, 2)
            k = attn.k_proj(x).view(1, n, -1, d).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, positions[None])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            got = head_readings(q[0].transpose(0, 1), positions, k[0].transpose(0, 1), positions,
                                AttentionTerms(scale=attn.scaling), K,
                                spans=torch.tensor(spans))  # fmt: skip
            assert_readings_match(got, out.attentions[index][0].transpose(0, 1), spans)


def naive(q, qpos, keys, kpos, scale, cap=None, window=None, sinks=None) -> torch.Tensor:
    """The formula written out, one row and head at a time: ``[rows, heads, keys]``."""
    rows, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(rows, heads, len(kpos))
    for r in range(rows):
        for h in range(heads):
            logits = []
            for j in range(len(kpos)):
                x = float(q[r, h] @ keys[j, h // group]) * scale
                if cap:
                    x = cap * math.tanh(x / cap)
                seen = kpos[j] <= qpos[r] and (window is None or qpos[r] - kpos[j] < window)
                logits.append(x if seen else -math.inf)
            if sinks is not None:
                logits.append(float(sinks[h]))
            p = torch.tensor(logits).softmax(0)
            out[r, h] = p[: len(kpos)]
    return out


@pytest.mark.parametrize(
    "terms",
    [dict(), dict(cap=2.0), dict(window=3), dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))],
    ids=["plain", "soft-cap", "window", "sinks"],
)
def test_each_kernel_term_with_grouped_query_heads(terms: dict) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=g)  # 4 query heads over 2 KV heads
    keys = torch.randn(9, 2, 8, generator=g)
    kpos = torch.tensor([3, 0, 8, 1, 2, 4, 6, 5, 7])  # any order
    qpos = torch.tensor([0, 2, 4, 7, 8])
    scale = 8**-0.5
    got = head_readings(q, qpos, keys, kpos, AttentionTerms(scale, terms.get("cap"),
                        terms.get("window"), terms.get("sinks")), K,
                        spans=torch.tensor([[0, 3], [5, 9]]))  # fmt: skip
    want = naive(q, qpos.tolist(), keys, kpos.tolist(), scale, **terms)
    order = kpos.argsort()
    probs = want[..., order]  # by position: the helper's keys at positions 0..8
    if "sinks" not in terms:
        assert_readings_match(got, probs, [(0, 3), (5, 9)])
    else:  # the sink's share joins the entropy; the keys' sum is below 1
        sink = 1 - probs.sum(-1)
        assert (sink > 0).all()
        whole = torch.cat([probs, sink[..., None]], -1)
        entropy = -(whole * torch.where(whole > 0, whole.clamp_min(1e-30).log(), 0.0)).sum(-1)
        torch.testing.assert_close(got.entropy, entropy, rtol=0, atol=1e-4)
        torch.testing.assert_close(got.probs, probs.topk(K, -1).values, rtol=0, atol=1e-4)
    # row 0 sees the key at position 0 alone: one position, then -1
    assert got.positions[0, :, 1:].eq(-1).all() and got.positions[0, :, 0].eq(0).all()


def test_min_p_keeps_only_keys_that_likely() -> None:
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(3, 2, 8, generator=g) * 3, torch.randn(6, 2, 8, generator=g) * 3
    positions = torch.arange(6)
    every = head_readings(q, positions[3:], keys, positions, AttentionTerms(1.0), K)
    kept = head_readings(q, positions[3:], keys, positions, AttentionTerms(1.0), K, min_p=0.2)
    assert ((kept.positions >= 0) == (every.probs >= 0.2)).all()
    assert torch.equal(kept.positions[kept.positions >= 0], every.positions[every.probs >= 0.2])
    assert (kept.probs[kept.positions < 0] == 0).all()


def test_a_request_s_heads_and_spans_keep_their_labels_in_every_form() -> None:
    """The rows the worker reads (every head, every span slot) cut to a request's heads and
    spans (``AttentionReadout.view``) carry which heads and spans they are through a cut of
    tokens, a join, the served JSON and base64 forms and back."""
    from probehook.outputs.attention import MAX_SPANS, AttentionReadout, AttentionRows
    from probehook.outputs.top_k import compact_top_k, json_top_k

    n, heads = 5, 4
    generator = torch.Generator().manual_seed(0)
    full = AttentionRows.of_columns({
        "positions": torch.randint(0, 9, (n, heads, K), generator=generator),
        "probs": torch.rand(n, heads, K, generator=generator),
        "entropy": torch.rand(n, heads, generator=generator),
        "span_mass": torch.rand(n, heads, MAX_SPANS, generator=generator)})  # fmt: skip
    readout = AttentionReadout()
    terms = readout.request_terms(
        ["3"],
        {"attention_heads": {3: [3, 1]}, "attention_spans": {"a": [0, 2], "b": [1, 9]}},
        {"3": {"layer": 3, "heads": heads, "spans": MAX_SPANS, "num_layers": 4}},
    )
    rows = readout.view(full, {"layer": 3}, terms)
    assert rows.heads == (1, 3) and list(rows.spans) == ["a", "b"]
    assert torch.equal(rows.spans["b"], full.span_mass[:, [1, 3], 1])
    assert torch.equal(rows.positions, full.positions[:, [1, 3]])
    for same in (
        AttentionRows.cat([rows.rows(0, 2), rows.rows(2)]),
        AttentionRows.from_columns(json_top_k(rows)),
        AttentionRows.from_columns(compact_top_k({"3": rows})["3"]),
    ):
        assert same.heads == (1, 3) and list(same.spans) == ["a", "b"]
        for name, column in rows.columns.items():
            torch.testing.assert_close(same.columns[name], column, rtol=0, atol=0)
    plain = readout.view(full, {"layer": 3}, None)  # no terms: every head, no span
    assert plain.heads == (0, 1, 2, 3) and plain.spans == {} and plain.span_mass.shape == (n, 4, 0)


@pytest.mark.parametrize("min_p", [1.0, -0.1, "0.1", True])
def test_a_bad_min_p_is_refused_by_name(min_p) -> None:
    from probehook.errors import CaptureConfigError
    from probehook.outputs.attention import AttentionReadout

    with pytest.raises(CaptureConfigError, match=r"attention_min_p=.* is not valid: .*\[0, 1\)"):
        AttentionReadout().instances({"layers": [0]}, {"attention_min_p": min_p}, num_layers=4,
                                     hidden_size=8, model_name=None)  # fmt: skip


@pytest.mark.parametrize(
    "terms",
    [
        AttentionTerms(scale=0.125),
        AttentionTerms(scale=0.125, soft_cap=2.0, window=5),
        AttentionTerms(scale=0.125, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    ],
    ids=["plain", "soft-cap and window", "sinks"],
)
def test_a_batch_of_decode_rows_reads_as_each_one_alone(terms: AttentionTerms) -> None:
    """``batched_head_readings`` (one row each of several requests, their keys padded to the
    longest, as the bank reads a decode step) equals ``head_readings`` of each request alone:
    padding keys are never visible, each row has its own spans."""
    from probehook.worker.attention_rows import batched_head_readings

    generator = torch.Generator().manual_seed(3)
    lengths = [1, 7, 12]
    width = max(lengths)
    queries = torch.randn(3, 4, 8, generator=generator)
    keys = torch.randn(3, width, 2, 8, generator=generator) * 3
    grid = torch.arange(width).expand(3, -1)
    newest = torch.tensor([n - 1 for n in lengths])
    key_positions = torch.where(grid <= newest[:, None], grid, -1)
    spans = torch.tensor([[[0, 1], [0, 0]], [[2, 5], [0, 7]], [[0, 0], [0, 0]]])
    got = batched_head_readings(queries, newest, keys, key_positions, terms, K, 0.01, spans)
    for r, n in enumerate(lengths):
        alone = head_readings(queries[r : r + 1], newest[r : r + 1], keys[r, :n],
                              torch.arange(n), terms, K, 0.01, spans[r])  # fmt: skip
        for name in ("positions", "probs", "entropy", "spans"):
            # two computations (a batched matmul, a request's own): last bits may differ
            torch.testing.assert_close(getattr(got, name)[r : r + 1], getattr(alone, name),
                                       rtol=0, atol=1e-5)  # fmt: skip
