"""BlockPool and KVCacheManager without a model: ref counts, LRU reuse, prefix-cache hits."""

from __future__ import annotations

import pytest

from neuron_runtime.kv_cache import BlockPool, KVCacheManager, hash_block
from neuron_runtime.request import Request
from neuron_runtime.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(), eos_token_id=None)


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> None:
    """Pretends a forward pass computed the request's tokens (all, or the first num_tokens)."""
    target = request.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate_slots(request, target - request.num_computed_tokens)
    request.num_computed_tokens = target
    kv.cache_full_blocks(request)


# hash_block


def test_hash_block_is_a_function_of_parent_and_tokens():
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, (1, 2, 3, 4))
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])
    parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 4])
    other_parent = hash_block(None, [8, 8, 8, 8])
    assert hash_block(parent, [1, 2, 3, 4]) != hash_block(other_parent, [1, 2, 3, 4])


# BlockPool


def test_pool_rejects_empty():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_allocate_takes_blocks_in_id_order_with_one_reference():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (2, 3)
    assert pool.allocate(0) == []


def test_allocate_too_many_returns_none_and_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    assert pool.allocate(3) is None
    assert pool.num_free_blocks == 2
    assert [b.block_id for b in pool.allocate(2)] == [2, 3]
    assert pool.allocate(1) is None


def test_free_order_least_recently_freed_first_tail_blocks_first():
    pool = BlockPool(6)
    pool.allocate(6)
    pool.free([0, 1, 2])  # one request's table: its tail (2) should be evicted first
    pool.free([5, 3])
    assert pool.num_free_blocks == 5
    assert [b.block_id for b in pool.allocate(5)] == [2, 1, 0, 3, 5]


def test_ref_counts_and_double_free():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.touch(block)
    assert block.ref_count == 2
    pool.free([block.block_id])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 2  # still held by one owner
    pool.free([block.block_id])
    assert block.ref_count == 0
    assert pool.num_free_blocks == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block.block_id])


def test_freed_cached_block_is_found_and_taken_off_the_free_queue():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    h = hash_block(None, [1, 2, 3, 4])
    pool.register(b, h)
    pool.free([a.block_id, b.block_id, c.block_id])
    assert pool.num_free_blocks == 3
    assert pool.lookup(h) is b
    pool.touch(b)
    assert b.ref_count == 1
    assert pool.num_free_blocks == 2
    # The touched block is no longer handed out.
    assert sorted(x.block_id for x in pool.allocate(2)) == [a.block_id, c.block_id]
    assert pool.allocate(1) is None


def test_eviction_removes_the_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block(None, [5, 6, 7, 8])
    pool.register(a, h)
    assert pool.num_cached_blocks == 1
    pool.free([a.block_id])  # a is now the oldest free block
    pool.free([b.block_id])
    (reused,) = pool.allocate(1)
    assert reused is a
    assert a.block_hash is None
    assert pool.lookup(h) is None
    assert pool.num_cached_blocks == 0


def test_register_keeps_the_first_block_for_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block(None, [1, 1, 1, 1])
    pool.register(a, h)
    pool.register(b, h)
    assert pool.lookup(h) is a
    assert b.block_hash is None


def test_register_and_lookup_disabled_without_prefix_caching():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4])
    pool.register(a, h)
    assert pool.lookup(h) is None
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.register(a, ha)
    pool.register(b, hb)
    pool.reset_prefix_cache()
    assert pool.lookup(ha) is None and pool.lookup(hb) is None
    assert a.block_hash is None and b.block_hash is None


# KVCacheManager


def test_allocate_slots_rounds_up_to_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("r", list(range(5)))
    assert kv.allocate_slots(req, 5)
    assert len(req.block_table) == 2
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3)  # 8 tokens: still 2 blocks
    assert len(req.block_table) == 2
    assert kv.allocate_slots(req, 4)  # 9 tokens: 3 blocks
    assert len(req.block_table) == 3
    assert kv.usage() == pytest.approx(3 / 8)


def test_allocate_slots_failure_allocates_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_request("r", list(range(20)))
    assert kv.allocate_slots(req, 4)
    assert not kv.allocate_slots(req, 16)  # 20 tokens need 5 blocks, 3 exist
    assert len(req.block_table) == 1
    assert kv.pool.num_free_blocks == 2


def test_cache_full_blocks_registers_only_full_computed_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    req = make_request("r", tokens)
    compute(kv, req, 7)
    h0 = hash_block(None, tokens[0:4])
    assert req.block_hashes == [h0]
    compute(kv, req)
    h1 = hash_block(h0, tokens[4:8])
    assert req.block_hashes == [h0, h1]
    assert kv.pool.num_cached_blocks == 2
    assert kv.pool.lookup(h1).block_id == req.block_table[1]


def test_match_prefix_hits_after_owner_freed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    shared = list(range(1, 9))  # two full blocks
    first = make_request("a", [*shared, 50, 51])
    compute(kv, first)
    first_blocks = list(first.block_table)
    kv.free(first)
    assert first.block_table == [] and first.block_hashes == []
    assert kv.pool.num_free_blocks == 8

    second = make_request("b", [*shared, 60, 61, 62])
    assert kv.match_prefix(second) == 8
    assert second.block_table == first_blocks[:2]
    assert kv.pool.num_free_blocks == 6  # the two hit blocks left the free queue
    assert [kv.pool.blocks[b].ref_count for b in second.block_table] == [1, 1]


def test_match_prefix_shares_blocks_of_a_live_request():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    shared = [7, 7, 7, 7]
    a = make_request("a", [*shared, 1, 2])
    compute(kv, a)
    b = make_request("b", [*shared, 3])
    assert kv.match_prefix(b) == 4
    assert b.block_table == a.block_table[:1]
    assert kv.pool.blocks[a.block_table[0]].ref_count == 2
    used = kv.pool.num_used_blocks
    kv.free(a)
    assert kv.pool.num_used_blocks == used - 1  # a's second block only
    kv.free(b)
    assert kv.pool.num_free_blocks == 8


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit"),
    [(8, 4), (9, 8), (7, 4), (4, 0), (3, 0), (12, 8), (13, 12), (20, 12)],
)
def test_match_prefix_never_covers_the_last_token(prompt_len, expected_hit):
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(1, 21))
    owner = make_request("owner", tokens[:12])
    compute(kv, owner)  # 3 full blocks cached
    req = make_request("r", tokens[:prompt_len])
    assert kv.match_prefix(req) == expected_hit
    assert len(req.block_table) == expected_hit // BS


def test_match_prefix_follows_the_hash_chain():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    compute(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the chain differs, so nothing hits.
    assert kv.match_prefix(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
    # Same first block, different second block: one block hits.
    assert kv.match_prefix(make_request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])) == 4


def test_no_hits_without_prefix_caching():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(1, 10))
    a = make_request("a", tokens)
    compute(kv, a)
    assert a.block_hashes == []
    kv.free(a)
    b = make_request("b", tokens)
    assert kv.match_prefix(b) == 0
    assert b.block_table == []
    assert kv.prefix_cache_hits == 0


def test_hit_and_query_counters_count_admissions_only():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(1, 14))

    def admit(req_id, ids):
        hit = kv.match_prefix(make_request(req_id, ids))
        kv.record_admission(len(ids), hit)
        return hit

    assert admit("a", tokens) == 0
    a = make_request("a2", tokens)
    compute(kv, a)
    assert admit("b", tokens) == 12
    assert admit("c", tokens[:6]) == 4
    # A lookup that is not admitted (the scheduler retries later) counts nothing.
    kv.match_prefix(make_request("d", tokens))
    assert kv.prefix_cache_queries == 13 + 13 + 6
    assert kv.prefix_cache_hits == 12 + 4


def test_tail_blocks_of_a_freed_request_are_evicted_first():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    tokens = list(range(1, 13))  # exactly 3 full blocks
    a = make_request("a", tokens)
    compute(kv, a)
    a_blocks = list(a.block_table)
    kv.free(a)
    filler = make_request("f", [99])
    assert kv.allocate_slots(filler, 1)  # evicts one block: a's last
    assert filler.block_table == [a_blocks[-1]]
    b = make_request("b", [*tokens, 0])
    assert kv.match_prefix(b) == 8  # the first two blocks survived


def test_least_recently_freed_request_is_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 1, 1, 1, 1, 1, 1, 1])
    b = make_request("b", [2, 2, 2, 2, 2, 2, 2, 2])
    compute(kv, a)
    compute(kv, b)
    kv.free(a)
    kv.free(b)
    filler = make_request("f", list(range(8)))
    assert kv.allocate_slots(filler, 8)  # takes both of a's blocks
    assert kv.match_prefix(make_request("a2", [1] * 9)) == 0
    assert kv.match_prefix(make_request("b2", [2] * 9)) == 8
