"""Attention over the paged KV cache, GQA without expanding KV heads.

Cache layout, per layer, for keys and values alike: ``[num_kv_heads, num_blocks, block_size,
head_dim]``. Keeping the head axis outermost means that gathering a batch's blocks yields
``[num_kv_heads, B, L, head_dim]`` directly, the layout the batched matmul wants, so the
gathered keys are copied once and never transposed.

Sliding-window layers (Mistral, Gemma 3 local layers) see only the last ``sliding_window``
positions, their own included: query i sees key j iff ``i - sliding_window < j <= i``, as in
transformers' sliding-window mask. The window is a mask only: every block of a sequence stays
allocated and cached, so one block table serves sliding and global layers alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class StepMetadata:
    """Attention metadata of one step, built once by the model runner and read by every layer.

    Each backend's ops build and read their own subclass (``Ops.attention_metadata``).
    """

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each token


@dataclass
class DecodeRows:
    """The step's single-token sequences (rows ``[0, n)``), by ascending context length."""

    block_tables: list[list[int]]
    context_lens: list[int]  # the new token included


@dataclass
class PrefillSlice:
    """A run of query tokens of one sequence, at rows ``[q_start, q_start + q_len)``."""

    q_start: int
    q_len: int
    start_pos: int  # tokens of this sequence already in the cache before this slice
    block_ids: torch.Tensor  # [num_blocks_needed] long


# Decodes are split into at most this many groups by context length, each padded only to its
# own longest context: gathering and attending over padding costs as much as real keys.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8  # rows; a smaller batch is one group
MERGE_RATIO = 1.25  # adjacent groups whose longest contexts are this close become one


@dataclass
class DecodeGroup:
    """Decodes at rows ``[start, start + num)`` attending over one padded key length."""

    start: int
    num: int
    block_ids: torch.Tensor  # [num * max_blocks] long, block tables padded and flattened
    masked: torch.Tensor  # [num, 1, L] bool: key j is NOT visible to row b
    context_lens: torch.Tensor  # [num] long: tokens in each context, its own included
    # sliding_window -> ``masked`` plus the keys outside that window; built once per step.
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``masked``, with keys older than the window masked too: [num, 1, L] bool."""
        if sliding_window is None:
            return self.masked
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.masked.shape[-1], device=self.masked.device)
            first_visible = (self.context_lens - sliding_window).unsqueeze(1)  # [num, 1]
            mask = self.masked | (key_pos.unsqueeze(0) < first_visible).unsqueeze(1)
            self._window_masks[sliding_window] = mask
        return mask


def group_bounds(num_blocks: list[int]) -> list[tuple[int, int]]:
    """(start, stop) row ranges for decodes sorted by ascending ``num_blocks``.

    Equal-count groups (up to MAX_DECODE_GROUPS, at least MIN_DECODE_GROUP rows each), then
    neighbours merged where padding the shorter one to the longer costs little.
    """
    n = len(num_blocks)
    count = max(1, min(MAX_DECODE_GROUPS, n // MIN_DECODE_GROUP))
    cuts = [n * i // count for i in range(count + 1)]
    bounds = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    merged = [bounds[0]]
    for start, stop in bounds[1:]:
        first, last = merged[-1]
        if num_blocks[stop - 1] <= MERGE_RATIO * num_blocks[last - 1]:
            merged[-1] = (first, stop)
        else:
            merged.append((start, stop))
    return merged


def pad_tables(block_tables: list[list[int]], width: int) -> list[list[int]]:
    """Each table cut or zero-padded to ``width`` blocks (padding is never read unmasked)."""
    return [t[:width] + [0] * (width - len(t[:width])) for t in block_tables]


def decode_groups(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> list[DecodeGroup]:
    """Attention metadata of a batch of decodes, rows ordered by ascending context length."""
    if not context_lens:
        return []
    assert context_lens == sorted(context_lens), "decode rows must be sorted by context length"
    num_blocks = [-(-n // block_size) for n in context_lens]
    groups = []
    for start, stop in group_bounds(num_blocks):
        width = num_blocks[stop - 1]
        table = pad_tables(block_tables[start:stop], width)
        lens = torch.tensor(context_lens[start:stop], device=device)
        key_pos = torch.arange(width * block_size, device=device)
        groups.append(
            DecodeGroup(
                start=start,
                num=stop - start,
                block_ids=torch.tensor(table, device=device).flatten(),
                masked=(key_pos.unsqueeze(0) >= lens.unsqueeze(1)).unsqueeze(1),
                context_lens=lens,
            )
        )
    return groups


@dataclass
class AttentionMetadata(StepMetadata):
    """Metadata of the dynamic-shape paths (eager torch ops and the CPU kernels).

    Rows ``[0, num_decode)`` are single-token sequences (decodes), batched together in
    ``decode_groups`` (torch ops; the CPU kernels take their own tables). The rest are prefill
    slices, each attending to its cached prefix plus itself, causally.
    """

    num_decode: int
    prefills: list[PrefillSlice]
    decode_groups: list[DecodeGroup] = field(default_factory=list)


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Stores ``x`` [T, kvh, d] into ``cache`` [kvh, num_blocks, block_size, d], in the cache's
    dtype (a bfloat16 cache rounds to nearest even)."""
    kvh, num_blocks, block_size, d = cache.shape
    rows = x.transpose(0, 1).to(cache.dtype)
    cache.view(kvh, num_blocks * block_size, d).index_copy_(1, slot_mapping, rows)


def gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype
) -> torch.Tensor:
    """Reads whole blocks in ``dtype``: [kvh, num_blocks, bs, d] -> [kvh, num_seqs, L, d]."""
    kvh, _, block_size, d = cache.shape
    return cache.index_select(1, block_ids).view(kvh, num_seqs, -1, d).to(dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` with the values ``cache`` holds once ``x`` is written there: a slice attending to
    its own fresh keys sees what a later step reads back from a lower-precision cache."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, qh, d]
    k: torch.Tensor,  # [T, kvh, d]
    v: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Writes this step's K/V into the cache and attends; returns [T, qh * d].

    ``softcap`` (Gemma) squashes the scaled scores into (-softcap, softcap) with
    ``softcap * tanh(score / softcap)`` before the mask and softmax.
    """
    write_kv(k_cache, meta.slot_mapping, k)
    write_kv(v_cache, meta.slot_mapping, v)
    out = q.new_empty(q.shape)
    window = sliding_window
    attend_decode_groups(out, q, k_cache, v_cache, meta.decode_groups, scale, window, softcap)
    attend_prefills(out, q, k, v, k_cache, v_cache, meta.prefills, scale, window, softcap)
    return out.view(q.shape[0], -1)


def attend_decode_groups(
    out: torch.Tensor,  # [T, qh, d], written at the groups' rows
    q: torch.Tensor,  # [T, qh, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[DecodeGroup],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Each group's decodes over their padded, gathered keys (the cache already written)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    for g in groups:
        rows = slice(g.start, g.start + g.num)
        keys = gather_kv(k_cache, g.block_ids, g.num, q.dtype)  # [kvh, B, L, d]
        values = gather_kv(v_cache, g.block_ids, g.num, q.dtype)
        # Query heads of one KV head form a group: [B, qh, d] -> [kvh, B, group, d].
        qd = q[rows].view(g.num, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.matmul(qd, keys.transpose(-1, -2)) * scale  # [kvh, B, group, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(g.mask(sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.matmul(probs, values).transpose(0, 1).reshape(g.num, num_heads, head_dim)


def attend_prefills(
    out: torch.Tensor,  # [T, qh, d], written at the slices' rows
    q: torch.Tensor,  # [T, qh, d]
    k: torch.Tensor,  # [T, kvh, d]
    v: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSlice],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Each prefill slice over its cached prefix plus itself, causally."""
    for p in prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, qh, S, d]
        if p.start_pos == 0:
            kp = as_stored(k[rows], k_cache).transpose(0, 1).unsqueeze(0)  # [1, kvh, S, d]
            vp = as_stored(v[rows], v_cache).transpose(0, 1).unsqueeze(0)
        else:
            ctx = p.start_pos + p.q_len
            kp = gather_kv(k_cache, p.block_ids, 1, q.dtype)[:, :, :ctx].transpose(0, 1)
            vp = gather_kv(v_cache, p.block_ids, 1, q.dtype)[:, :, :ctx].transpose(0, 1)
        mask = prefill_mask(p, sliding_window, softcap is not None, q.device)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        else:
            assert mask is not None
            o = _softcapped_attention(qp, kp, vp, mask, scale, softcap)
        out[rows] = o.squeeze(0).transpose(0, 1)


def prefill_mask(
    p: PrefillSlice, sliding_window: int | None, always: bool, device: torch.device
) -> torch.Tensor | None:
    """[S, C] bool, True where query i (at position start_pos + i) may see key j.

    None when plain causal attention over the slice's own keys says the same (and ``always``
    is False), so SDPA can take its ``is_causal`` path.
    """
    ctx = p.start_pos + p.q_len
    fits = sliding_window is None or ctx <= sliding_window
    if p.start_pos == 0 and fits and not always:
        return None
    qpos = torch.arange(p.start_pos, ctx, device=device).unsqueeze(1)  # [S, 1]
    kpos = torch.arange(ctx, device=device).unsqueeze(0)  # [1, C]
    mask = kpos <= qpos
    if not fits:
        assert sliding_window is not None
        mask &= kpos > qpos - sliding_window
    return mask


def _softcapped_attention(
    q: torch.Tensor,  # [1, qh, S, d]
    k: torch.Tensor,  # [1, kvh, C, d]
    v: torch.Tensor,  # [1, kvh, C, d]
    mask: torch.Tensor,  # [S, C] bool, True = visible
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA cannot squash scores, so this one is spelled out; returns [1, qh, S, d]."""
    _, num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(num_kv_heads, num_heads // num_kv_heads, q_len, head_dim)  # [kvh, g, S, d]
    scores = torch.matmul(qg, k[0].unsqueeze(1).transpose(-1, -2)) * scale  # [kvh, g, S, C]
    scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v[0].unsqueeze(1)).view(1, num_heads, q_len, head_dim)
