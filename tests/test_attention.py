"""Paged decode attention, grouped by context length, against plain attention per sequence."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from neuron_runtime.layers.attention import (
    AttentionMetadata,
    decode_groups,
    group_bounds,
    paged_attention,
)


def test_group_bounds_partition_sorted_rows_and_merge_close_lengths():
    assert group_bounds([3]) == [(0, 1)]
    assert group_bounds([2] * 7) == [(0, 7)]  # under MIN_DECODE_GROUP rows: one group
    same = group_bounds([5] * 64)
    assert same == [(0, 64)]  # nothing to gain from splitting equal lengths
    spread = list(range(1, 65))
    bounds = group_bounds(spread)
    assert len(bounds) == 4
    assert bounds[0][0] == 0 and bounds[-1][1] == 64
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


def test_grouped_decode_attention_equals_attention_per_sequence():
    torch.manual_seed(0)
    rng = random.Random(0)
    kvh, heads, d, bs, num_blocks = 2, 6, 16, 4, 200
    k_cache = torch.randn(kvh, num_blocks, bs, d)
    v_cache = torch.randn(kvh, num_blocks, bs, d)
    free = list(range(num_blocks))
    rng.shuffle(free)
    lens = sorted(rng.randint(1, 60) for _ in range(20))
    tables = []
    for n in lens:
        tables.append([free.pop() for _ in range(-(-n // bs))])
    q = torch.randn(len(lens), heads, d)
    k_new = torch.randn(len(lens), kvh, d)
    v_new = torch.randn(len(lens), kvh, d)
    # Each sequence's new token sits at position len - 1 of its context.
    slots = torch.tensor(
        [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    )
    groups = decode_groups(tables, lens, bs)
    assert len(groups) > 1  # the lengths spread enough to split
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode=len(lens), prefills=[], decode_groups=groups
    )
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, d**-0.5)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        flat = torch.tensor([b * bs + j for b in table for j in range(bs)])[:n]
        keys = k_cache.view(kvh, -1, d)[:, flat]  # [kvh, n, d], the new token included
        values = v_cache.view(kvh, -1, d)[:, flat]
        expected = F.scaled_dot_product_attention(
            q[i].view(heads, 1, d).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            enable_gqa=True,
        )
        torch.testing.assert_close(out[i], expected.reshape(heads * d), atol=1e-5, rtol=0)
