"""Attention over the paged KV cache, GQA without expanding KV heads.

Cache layout, per layer, for keys and values alike: ``[num_kv_heads, num_blocks, block_size,
head_dim]``. Keeping the head axis outermost means that gathering a batch's blocks yields
``[num_kv_heads, B, L, head_dim]`` directly, the layout the batched matmul wants, so the
gathered keys are copied once and never transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSlice:
    """A run of query tokens of one sequence, at rows ``[q_start, q_start + q_len)``."""

    q_start: int
    q_len: int
    start_pos: int  # tokens of this sequence already in the cache before this slice
    block_ids: torch.Tensor  # [num_blocks_needed] long


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer.

    Rows ``[0, num_decode)`` are single-token sequences (decodes), batched together. The rest
    are prefill slices, each attending to its cached prefix plus itself, causally.
    """

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each token
    num_decode: int
    decode_block_ids: torch.Tensor  # [B * max_blocks] long, block tables flattened
    decode_masked: torch.Tensor  # [B, 1, L] bool: key j is NOT visible to sequence b
    prefills: list[PrefillSlice]


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Stores ``x`` [T, kvh, d] into ``cache`` [kvh, num_blocks, block_size, d]."""
    kvh, num_blocks, block_size, d = cache.shape
    cache.view(kvh, num_blocks * block_size, d).index_copy_(1, slot_mapping, x.transpose(0, 1))


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Reads whole blocks: [kvh, num_blocks, bs, d] -> [kvh, num_seqs, L, d]."""
    kvh, _, block_size, d = cache.shape
    return cache.index_select(1, block_ids).view(kvh, num_seqs, -1, d)


def paged_attention(
    q: torch.Tensor,  # [T, qh, d]
    k: torch.Tensor,  # [T, kvh, d]
    v: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's K/V into the cache and attends; returns [T, qh * d]."""
    write_kv(k_cache, meta.slot_mapping, k)
    write_kv(v_cache, meta.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads, head_dim)

    nd = meta.num_decode
    if nd:
        keys = gather_kv(k_cache, meta.decode_block_ids, nd)  # [kvh, B, L, d]
        values = gather_kv(v_cache, meta.decode_block_ids, nd)
        # Query heads of one KV head form a group: [B, qh, d] -> [kvh, B, group, d].
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.matmul(qd, keys.transpose(-1, -2)) * scale  # [kvh, B, group, L]
        scores.masked_fill_(meta.decode_masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:nd] = torch.matmul(probs, values).transpose(0, 1).reshape(nd, num_heads, head_dim)

    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, qh, S, d]
        if p.start_pos == 0:
            kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kvh, S, d]
            vp = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            ctx = p.start_pos + p.q_len
            kp = gather_kv(k_cache, p.block_ids, 1)[:, :, :ctx].transpose(0, 1)  # [1, kvh, C, d]
            vp = gather_kv(v_cache, p.block_ids, 1)[:, :, :ctx].transpose(0, 1)
            # Query i sits at position start_pos + i and sees keys 0..start_pos + i.
            qpos = torch.arange(p.start_pos, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [S, C]
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
