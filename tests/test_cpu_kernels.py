"""The fused CPU kernels against the torch ops they replace; the engine with and without them."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from test_llama_vs_hf import hf_greedy, hf_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends import cpu, cpu_kernels
from neuron_runtime.backends.cpu_ops import CPUKernelOps, KernelAttentionMetadata
from neuron_runtime.backends.ops import TORCH_OPS
from neuron_runtime.layers.attention import (
    AttentionMetadata,
    DecodeRows,
    PrefillSlice,
    decode_groups,
)
from neuron_runtime.layers.linear import Linear
from neuron_runtime.layers.rotary import apply_rotary

# Reordered fp32 sums (vectorized dot products): this close to torch, relative to the scale.
ATOL = 1e-5


# Every tile shape (pairs of rows on a panel, groups of up to 6 on half panels), more than one
# row block, partial panels.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 15, 23, 64, 77, 130])
@pytest.mark.parametrize("width,out", [(1, 1), (7, 5), (64, 67), (129, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(k, rows, width, out, bias):
    g = torch.Generator().manual_seed(rows * 1000 + width + out)
    x = torch.randn(rows, width, generator=g)
    w = torch.randn(out, width, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    expected = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    got = k.linear(x, k.pack(w), b, out)
    torch.testing.assert_close(got, expected, atol=ATOL * width**0.5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 6, 7, 16, 23, 77])
@pytest.mark.parametrize("width,out", [(64, 8), (129, 130), (576, 100)])
def test_packed_linear_row_is_the_same_alone_or_in_a_batch(k, rows, width, out):
    # Every tile shape sums each output over the inputs in the same order, so a row's output
    # does not depend on the rows batched with it: each row alone gives the batch's bits.
    g = torch.Generator().manual_seed(rows + width + out)
    x = torch.randn(rows, width, generator=g)
    w = k.pack(torch.randn(out, width, generator=g))
    b = torch.randn(out, generator=g)
    batched = k.linear(x, w, b, out)
    alone = torch.cat([k.linear(x[i : i + 1].clone(), w, b, out) for i in range(rows)])
    assert torch.equal(batched, alone)


def test_linear_layer_on_kernels_keeps_only_the_packed_weight(k):
    torch.manual_seed(7)
    layer = Linear(48, 40, bias=True)
    x = torch.randn(2, 3, 48)  # leading dimensions are flattened and restored
    expected = F.linear(x, layer.weight, layer.bias)
    CPUKernelOps(k).attach(layer)
    assert layer.weight.numel() == 0 and layer.packed is not None
    torch.testing.assert_close(layer(x), expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_adds_in_place_and_normalizes(k, with_residual):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g) * 3
    residual = torch.randn(5, 96, generator=g) if with_residual else None
    weight = torch.randn(96, generator=g)
    summed = x + residual if residual is not None else x.clone()
    expected = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    out = k.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(x, summed, atol=0, rtol=0)  # the sum, left in x
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-5)


def test_silu_and_mul(k):
    gate_up = torch.randn(3, 2 * 77, generator=torch.Generator().manual_seed(2)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(k.silu_and_mul(gate_up), F.silu(gate) * up, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("cols", [1, 7, 16, 33, 49152])
def test_argmax_matches_torch_with_ties_at_any_column(k, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(6, cols, generator=g)
    # Ties: the maximum repeated later in the row (torch picks the first), and rows that are
    # all one value, whose first column wins.
    x[1] = x[1].round()
    x[2] = 0.5
    if cols > 3:
        x[3, cols // 3] = x[3, cols - 1] = 10.0
    x[4] = -torch.arange(cols, dtype=torch.float32)  # largest value in column 0
    x[5] = torch.arange(cols, dtype=torch.float32)  # largest value in the last column
    assert k.argmax(x).tolist() == x.argmax(dim=-1).tolist()


def test_rotary_in_place_on_a_strided_view(k):
    g = torch.Generator().manual_seed(3)
    rows, q_heads, kv_heads, d = 6, 4, 2, 16
    qkv = torch.randn(rows, q_heads + 2 * kv_heads, d, generator=g)
    angles = torch.rand(rows, 1, d // 2, generator=g) * 10
    cos, sin = angles.cos(), angles.sin()
    qk = qkv[:, : q_heads + kv_heads]  # rows strided by the whole projection, as in attention
    expected = apply_rotary(qk.clone(), cos, sin)
    values_before = qkv[:, q_heads + kv_heads :].clone()
    k.rotary_(qk, cos.view(rows, -1), sin.view(rows, -1), q_heads + kv_heads)
    torch.testing.assert_close(qk, expected, atol=ATOL, rtol=1e-5)
    assert torch.equal(qkv[:, q_heads + kv_heads :], values_before)  # values untouched


def test_write_kv_places_rows_at_their_slots(k):
    g = torch.Generator().manual_seed(4)
    kv_heads, blocks, block_size, d = 2, 5, 4, 8
    k_cache = torch.zeros(kv_heads, blocks, block_size, d)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(7, 3 * kv_heads, d, generator=g)
    keys = qkv[:, kv_heads : 2 * kv_heads].contiguous()  # k and v with different row strides
    values = qkv[:, 2 * kv_heads :]
    slots = torch.tensor([3, 17, 0, 9, 19, 4, 12])
    k.write_kv(keys, values, k_cache, v_cache, slots)
    expected_k = torch.zeros(kv_heads, blocks * block_size, d)
    expected_v = torch.zeros_like(expected_k)
    expected_k.index_copy_(1, slots, keys.transpose(0, 1))
    expected_v.index_copy_(1, slots, values.transpose(0, 1))
    assert torch.equal(k_cache.view_as(expected_k), expected_k)
    assert torch.equal(v_cache.view_as(expected_v), expected_v)


def reference_decode(q, keys, values, scale, window, softcap):
    """One query row [heads, d] over keys/values [kvh, n, d], in float64."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    if window:
        keys, values = keys[:, -window:], values[:, -window:]
    keys = keys.double().repeat_interleave(heads // kv_heads, dim=0)
    values = values.double().repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.einsum("hd,hnd->hn", q.double(), keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), values).float()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])  # kv_cache_dtype
@pytest.mark.parametrize("d", [8, 16, 64, 128, 256])  # scalar, vector and constant-size paths
@pytest.mark.parametrize(
    "heads,kv_heads,window,softcap", [(6, 2, None, None), (4, 4, None, None), (6, 3, 5, 50.0)]
)
def test_decode_attention_matches_attention_per_sequence(
    k, heads, kv_heads, window, softcap, d, cache_dtype
):
    """Against float64 attention over the cache's values (a bf16 cache's widened exactly)."""
    torch.manual_seed(5)
    rng = random.Random(5)
    bs, num_blocks = 4, 200
    k_cache = torch.randn(kv_heads, num_blocks, bs, d).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_blocks, bs, d).to(cache_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    lens = [rng.randint(1, 60) for _ in range(13)] + [1, 4, 5]
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d)
    q = qkv[:, :heads]  # strided rows, as the attention layer passes them
    scale = d**-0.5
    context_lens = torch.tensor(lens)
    out = k.decode_attention(q, k_cache, v_cache, padded, context_lens, scale, window, softcap)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        flat = torch.tensor([b * bs + j for b in table for j in range(bs)])[:n]
        keys = k_cache.view(kv_heads, -1, d)[:, flat]
        values = v_cache.view(kv_heads, -1, d)[:, flat]
        expected = reference_decode(q[i], keys, values, scale, window, softcap)
        torch.testing.assert_close(out[i], expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_with_kernels_equals_torch_path(k, cache_dtype):
    """A mixed step (decodes, a prefill after cached tokens, a prompt's first slice) through
    both paths of ``paged_attention``, on an fp32 cache and a bf16 one (kv_cache_dtype)."""
    torch.manual_seed(6)
    kvh, heads, d, bs, num_blocks = 2, 4, 16, 4, 64
    base_k = torch.randn(kvh, num_blocks, bs, d).to(cache_dtype)
    base_v = torch.randn(kvh, num_blocks, bs, d).to(cache_dtype)
    lens = [3, 9, 9, 20]  # decodes, sorted by length as the runner sorts them
    tables = [[4 * i + j for j in range(-(-n // bs))] for i, n in enumerate(lens)]
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    slots += [40 * bs + 2 + j for j in range(6)]  # 6 tokens after 2 cached ones
    slots += [50 * bs + j for j in range(5)]  # a prompt's first 5 tokens
    prefills = [
        PrefillSlice(len(lens), 6, 2, torch.tensor([40, 41, 42])),
        PrefillSlice(len(lens) + 6, 5, 0, torch.tensor([50, 51])),
    ]
    rows = len(slots)
    q, kk, vv = torch.randn(rows, heads, d), torch.randn(rows, kvh, d), torch.randn(rows, kvh, d)
    slot_mapping = torch.tensor(slots)
    outs = []
    for fused in (None, k):
        k_cache, v_cache = base_k.clone(), base_v.clone()
        if fused is None:
            groups = decode_groups(tables, lens, bs)
            meta = AttentionMetadata(slot_mapping, len(lens), prefills, decode_groups=groups)
        else:  # the prefill slices' rows attend in the decodes' kernel call
            meta = CPUKernelOps(fused).attention_metadata(
                slots, DecodeRows(tables, lens), prefills, bs, torch.device("cpu")
            )
            assert isinstance(meta, KernelAttentionMetadata) and not meta.prefills
        ops = TORCH_OPS if fused is None else CPUKernelOps(fused)
        out = ops.attention(q, kk, vv, k_cache, v_cache, meta, d**-0.5, None, None)
        outs.append((out, k_cache, v_cache))
    (torch_out, torch_k, torch_v), (fused_out, fused_k, fused_v) = outs
    assert torch.equal(torch_k, fused_k) and torch.equal(torch_v, fused_v)
    torch.testing.assert_close(fused_out, torch_out, atol=ATOL, rtol=1e-5)


def test_kernels_off_by_environment(monkeypatch):
    cpu_kernels.kernels.cache_clear()
    monkeypatch.setenv("NEURON_CPU_KERNELS", "0")
    try:
        assert cpu_kernels.kernels() is None
        assert cpu.CPUBackend().ops is TORCH_OPS
    finally:
        cpu_kernels.kernels.cache_clear()


@pytest.mark.parametrize("use_kernels", [True, False])
def test_engine_greedy_matches_transformers_with_and_without_kernels(
    k, monkeypatch, tiny_family_path, use_kernels
):
    """Both CPU paths, every family (sliding windows, soft-capping, q/k norms, biases)."""
    if not use_kernels:
        monkeypatch.setattr(cpu, "kernels", lambda: None)
    llm = LLM(
        model=str(tiny_family_path),
        max_model_len=128,
        block_size=4,
        num_kv_blocks=256,
        num_threads=k.num_threads(),  # the engine sizes the pool: keep the fixture's
    )
    assert isinstance(llm.engine.backend.ops, CPUKernelOps) == use_kernels
    ref = hf_model(tiny_family_path)
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode(p)
        for p in ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "Hi"]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 16)


def test_speculative_slice_as_decode_rows_equals_its_causal_prefill(k):
    """The runner hands the kernels a speculative slice (the last token plus drafts, after a
    cached context) as one decode row per position, row i with context ``start_pos + 1 + i``
    and the slice's block table: the same as the torch path's causal prefill slice."""
    torch.manual_seed(7)
    kvh, heads, d, bs, num_blocks = 3, 9, 64, 16, 8
    base_k = torch.randn(kvh, num_blocks, bs, d)
    base_v = torch.randn(kvh, num_blocks, bs, d)
    table = [5, 2, 7]
    start, n = 29, 5  # rows at positions 29..33 cross from block 2 into block 7
    slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
    q, kk, vv = torch.randn(n, heads, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    slot_mapping = torch.tensor(slots)
    k_cache, v_cache = base_k.clone(), base_v.clone()
    prefill = PrefillSlice(0, n, start, torch.tensor(table))
    meta = AttentionMetadata(slot_mapping, 0, [prefill])
    expected = TORCH_OPS.attention(q, kk, vv, k_cache, v_cache, meta, d**-0.5, None, None)
    assert CPUKernelOps.decode_rows_any_order
    ops, cpu_device = CPUKernelOps(k), torch.device("cpu")
    rows = DecodeRows([table] * n, [start + 1 + i for i in range(n)])
    outs = []
    for meta in (
        ops.attention_metadata(slots, rows, [], bs, cpu_device),
        ops.attention_metadata(slots, DecodeRows([], []), [prefill], bs, cpu_device),
    ):
        k_cache, v_cache = base_k.clone(), base_v.clone()
        outs.append(ops.attention(q, kk, vv, k_cache, v_cache, meta, d**-0.5, None, None))
    torch.testing.assert_close(outs[0], expected, atol=ATOL, rtol=1e-5)
    # The slice as a prompt's prefill takes the same kernel rows: the same bits.
    assert torch.equal(outs[0], outs[1])
