"""Keys read back from a layer's paged KV cache (probehook/worker/paged_keys.py; issue 51's
attention readout reads the keys a query sees from the cache after the forward pass): every
layout vLLM's CPU kernel writes, written by vLLM's own cache write and read back bit-equal;
a layout probehook has not classified, or one whose packing moved, refused by name."""

from __future__ import annotations

import pytest
import torch

from probehook.adapter.worker import kv_cache
from probehook.adapter.worker.kv_cache import check_cpu_layout, key_layout
from probehook.errors import UnsupportedModelError
from probehook.worker.paged_keys import key_slots, read_keys

CASES = [
    ("vec", torch.float32, 4, 64, 128),  # the tiny model's: float32, blocks of 128
    ("vec", torch.float16, 2, 128, 32),
    ("vec", torch.bfloat16, 1, 64, 64),  # bfloat16 where the CPU has no AMX
    ("vec16", torch.float32, 2, 48, 32),  # a head size of 16 x odd
    ("amx", torch.bfloat16, 2, 64, 128),  # bfloat16 with AMX: the write is plain C++
]


@pytest.mark.parametrize(("isa", "dtype", "heads", "head_size", "block_size"), CASES)
def test_vllm_s_cpu_cache_write_reads_back_bit_equal(isa, dtype, heads, head_size, block_size):
    check_cpu_layout(isa, dtype, heads, head_size, block_size)


def test_a_layout_that_reads_wrong_is_refused_by_name(monkeypatch) -> None:
    """The check is what stands between a moved packing and wrong attention: read the AMX
    cache as the column-major one and it refuses."""
    monkeypatch.setitem(kv_cache.CPU_ISA_LAYOUTS, "amx", "vec")
    with pytest.raises(UnsupportedModelError, match=r"ISA 'amx' .* does not store keys in the "
                       r"'vec' layout .* keys read back wrong"):  # fmt: skip
        check_cpu_layout("amx", torch.bfloat16, 2, 64, 128)


def _layer(impl: str, isa: str | None = None, **fields: object) -> object:
    """A vLLM ``Attention`` (not built: its fields set directly) with an impl of class
    ``impl``."""
    from vllm.model_executor.layers.attention import Attention

    layer = Attention.__new__(Attention)
    layer.__dict__.update({"layer_name": "model.layers.3.self_attn.attn",
                           "impl": type(impl, (), {})(), **fields})  # fmt: skip
    if isa is not None:
        layer.__dict__["isa"] = isa
    return layer


def test_each_backend_and_isa_is_classified_or_refused() -> None:
    assert key_layout(_layer("CPUAttentionBackendImpl", isa="vec16")) == "vec"
    assert key_layout(_layer("CPUAttentionBackendImpl", isa="amx")) == "amx"
    assert key_layout(_layer("FlashAttentionImpl")) == "token_major"
    with pytest.raises(UnsupportedModelError, match=r"with the 'neon' kernel, whose key cache"):
        key_layout(_layer("CPUAttentionBackendImpl", isa="neon"))
    with pytest.raises(UnsupportedModelError, match=r"runs vLLM's FlashInferImpl, whose key"):
        key_layout(_layer("FlashInferImpl"))


def test_the_token_major_layout_reads_each_token_s_key() -> None:
    """FlashAttention's pages: each token's key, then its value."""
    cache = torch.randn(3, 2, 16, 2 * 8)
    blocks, offsets = torch.tensor([2, 0, 2]), torch.tensor([5, 15, 0])
    got = read_keys(cache, "token_major", blocks, offsets)
    assert got.shape == (3, 2, 8)
    for i in range(3):
        assert torch.equal(got[i], cache[blocks[i], :, offsets[i], :8])
    with pytest.raises(ValueError, match=r"unknown key layout 'nhd'; the layouts are"):
        read_keys(cache, "nhd", blocks, offsets)


@pytest.mark.parametrize("kernel_block_size", [16, 8])
def test_key_slots_follow_the_block_table(kernel_block_size: int) -> None:
    """A request's keys written through vLLM's slot mapping (block id x block size + offset)
    are read back at its positions, whole blocks or split into kernel blocks."""
    block_size, heads, dim = 16, 2, 32
    row = torch.tensor([5, 2, 7])  # the request's blocks, in position order
    positions = torch.arange(40)
    ratio = block_size // kernel_block_size
    cache = torch.zeros(8 * ratio, heads, kernel_block_size, 2 * dim)
    keys = torch.randn(len(positions), heads, dim)
    for p in positions.tolist():  # as a token-major kernel writes its kernel blocks
        block = int(row[p // block_size]) * ratio + (p % block_size) // kernel_block_size
        cache[block, :, p % kernel_block_size, :dim] = keys[p]
    blocks, offsets = key_slots(row, positions, block_size, kernel_block_size)
    assert torch.equal(read_keys(cache, "token_major", blocks, offsets), keys)
    with pytest.raises(ValueError, match="do not split into kernel blocks of 12"):
        key_slots(row, positions, block_size, 12)


@pytest.mark.engine
def test_a_running_engine_s_keys_read_back_equal_hugging_face_s(monkeypatch) -> None:
    """In the recorder window of every step (the worker's, in this process), each request's
    keys of every position computed so far, read from every layer's paged cache through its
    block table, equal Hugging Face's post-RoPE keys of the same tokens: two requests of
    different lengths in one batch, prompt and generated positions, blocks of 32 so that a
    request spans several."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from probehook import LLM, SamplingParams, tiny_model_path
    from probehook.adapter.worker import runner_v1
    from probehook.adapter.worker.kv_cache import attention_of, request_keys
    from probehook.adapter.worker.surgery import locate_layers
    from probehook.testing import _hf_model

    seen: dict[str, list[torch.Tensor]] = {}
    record_step = runner_v1.record_step

    def reading(runner, recorders, defer=False):  # noqa: ANN001, ANN202
        batch = runner.input_batch
        starts = runner.query_start_loc.np
        layers = locate_layers(runner.get_model())[1]
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            end = int(batch.num_computed_tokens_cpu[i]) + int(starts[i + 1] - starts[i])
            seen[req_id] = [request_keys(runner, attention_of(layer), i, torch.arange(end))
                            for layer in layers]  # fmt: skip
        return record_step(runner, recorders, defer)

    monkeypatch.setattr(runner_v1, "record_step", reading)
    llm = LLM(str(tiny_model_path()), layers=[1], block_size=32, enforce_eager=True,
              max_model_len=64, seed=0, dtype="float32")  # fmt: skip
    try:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        outs = llm.generate(["12+34=", "1+2+3+4+5+6+7+8+9+10="], params, use_tqdm=False)
    finally:
        llm.shutdown()
    model = _hf_model(str(tiny_model_path()), torch.float32)
    assert len(seen) == 2
    for out in outs:
        ids = [*out.prompt_token_ids, *out.outputs[0].token_ids[:-1]]
        # the request's last step read every position fed, over more than one block
        keys = next(k for k in seen.values() if len(k[0]) == len(ids))
        assert len(ids) > 32
        with torch.no_grad():
            hf = model(torch.tensor([ids]), output_hidden_states=True)
            positions = torch.arange(len(ids))[None]
            for index, layer in enumerate(model.model.layers):
                x = layer.input_layernorm(hf.hidden_states[index])
                attn = layer.self_attn
                k = attn.k_proj(x).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
                q = torch.zeros_like(k)
                cos, sin = model.model.rotary_emb(x, positions)
                _, k = apply_rotary_pos_emb(q, k, cos, sin)
                torch.testing.assert_close(keys[index].float(), k[0].transpose(0, 1),
                                           rtol=1e-4, atol=1e-4)  # fmt: skip


def test_the_kernel_s_terms_come_from_vllm_s_impl() -> None:
    """What the kernel applies (vLLM's impl: the CPU impl's -1 and 0 mean none, FlashAttention
    keeps its window as (window - 1, 0)); ALiBi and anything but a decoder's self-attention
    refused by name."""
    from probehook.adapter.worker.kv_cache import attention_terms

    def layer(impl: str, attn_type: str = "decoder", isa: str | None = None,
              **terms: object) -> object:  # fmt: skip
        made = _layer(impl, isa, attn_type=attn_type)
        made.impl.__dict__.update({"scale": 0.125, "logits_soft_cap": 0, "sliding_window": -1,
                                   "alibi_slopes": None, "sinks": None, **terms})  # fmt: skip
        return made

    plain = attention_terms(layer("CPUAttentionBackendImpl", isa="vec"))
    assert (plain.scale, plain.soft_cap, plain.window, plain.sinks) == (0.125, None, None, None)
    capped = attention_terms(layer("CPUAttentionBackendImpl", isa="vec", logits_soft_cap=50.0,
                                   sliding_window=4096))  # fmt: skip
    assert (capped.soft_cap, capped.window) == (50.0, 4096)
    assert attention_terms(layer("FlashAttentionImpl", sliding_window=(4095, 0))).window == 4096
    assert attention_terms(layer("FlashAttentionImpl", sliding_window=(-1, -1))).window is None
    with pytest.raises(UnsupportedModelError, match=r"\{'alibi_slopes': True\}"):
        attention_terms(layer("FlashAttentionImpl", alibi_slopes=torch.ones(4)))
    with pytest.raises(UnsupportedModelError, match=r"\{'attn_type': 'encoder_decoder'\}"):
        attention_terms(layer("FlashAttentionImpl", attn_type="AttentionType.ENCODER_DECODER"))
