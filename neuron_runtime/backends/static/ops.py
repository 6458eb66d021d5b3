"""Torch ops in fixed shapes, for graphs compiled per bucket: no data-dependent shapes, no
host round-trip, no in-place tricks on the weights.

A step (or part of one) is a grid of ``num_seqs`` rows by ``num_tokens`` query tokens, every
row attending over its own block table of ``context_blocks`` blocks::

    tokens  [S * Q]      row s, query i at flat index s * Q + i
    tables  [S, B]       block ids; padding is the reserved null block
    keys    [kvh, S, B * block_size, d]   gathered from the paged cache per row

Query i of row s at position p sees key j iff ``j <= p`` (and ``j > p - window`` on sliding
layers): keys past a row's context are either in the null block or not written yet, and the
position mask hides both. Padding tokens sit at position 0 and write their K/V into the null
block, so they never touch a real sequence's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from neuron_runtime.backends.ops import Ops
from neuron_runtime.layers.attention import DecodeRows, PrefillSlice, StepMetadata, write_kv

if TYPE_CHECKING:
    from neuron_runtime.layers.logits import LogitsHead


@dataclass
class StaticAttentionMetadata(StepMetadata):
    positions: torch.Tensor  # [S, Q] long
    block_tables: torch.Tensor  # [S, B] long
    num_seqs: int
    num_tokens: int  # per row


class StaticOps(Ops):
    """``Ops`` whose every shape is fixed by the bucket (the model is compiled around them)."""

    name = "static"

    def logits(self, head: LogitsHead, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return hidden @ weight.t()  # the compiler picks the layout; no cached copies

    def attention_metadata(
        self,
        slot_mapping: list[int],
        decodes: DecodeRows,
        prefills: list[PrefillSlice],
        block_size: int,
        device: torch.device,
    ) -> StepMetadata:
        raise NotImplementedError("the static runner builds its metadata per bucket")

    def attention(
        self,
        q: torch.Tensor,  # [S * Q, qh, d]
        k: torch.Tensor,  # [S * Q, kvh, d]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [kvh, num_blocks, block_size, d]
        v_cache: torch.Tensor,
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        assert isinstance(meta, StaticAttentionMetadata)
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
        num_seqs, num_tokens = meta.num_seqs, meta.num_tokens
        num_heads, head_dim = q.shape[1:]
        kv_heads, _, block_size, _ = k_cache.shape
        group = num_heads // kv_heads
        context = meta.block_tables.shape[1] * block_size
        table = meta.block_tables.reshape(-1)
        shape = (kv_heads, num_seqs, 1, context, head_dim)
        keys = k_cache.index_select(1, table).view(shape).to(q.dtype)
        values = v_cache.index_select(1, table).view(shape).to(q.dtype)
        # [S*Q, qh, d] -> [kvh, S, group, Q, d]
        qg = q.view(num_seqs, num_tokens, kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [kvh, S, group, Q, C]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos = torch.arange(context, device=q.device)
        qpos = meta.positions.unsqueeze(-1)  # [S, Q, 1]
        visible = key_pos <= qpos  # [S, Q, C]
        if sliding_window is not None:
            visible = visible & (key_pos > qpos - sliding_window)
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [kvh, S, group, Q, d]
        return out.permute(1, 3, 0, 2, 4).reshape(num_seqs * num_tokens, num_heads * head_dim)


STATIC_OPS = StaticOps()
