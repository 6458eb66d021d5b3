"""Paged KV cache bookkeeping: a pool of ref-counted blocks and a hash-chain prefix cache.

Each layer's cache is one tensor of fixed-size blocks; a request owns a list of block ids (its
block table) and token ``i`` of the request lives in slot ``i % block_size`` of block
``block_table[i // block_size]``:

    request tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_table:     [   7       ,   2         ,  11  ]      (block_size = 4)
    cache:  block 2 = [t4 t5 t6 t7]  block 7 = [t0 t1 t2 t3]  block 11 = [t8 t9 -- --]

A full block is named by a hash of its tokens chained with the previous block's hash, so equal
prefixes map to equal hashes. A block holding image placeholders also mixes in each such
image's content hash: the same placeholder tokens with another image are another prefix.
Freed blocks keep their hash and content until the pool reuses them (least recently freed
first): a later request with the same prefix takes them back without recomputing.

Blocks can also be held outside any request (``KVCacheManager.hold``): a prefill engine holds
a handed-off prompt's blocks until the decode side has read them, and a decode engine holds
the blocks a transfer is writing into until it has finished, whatever became of the request.
A held block is one more reference, so it is neither freed nor reused meanwhile.

This module holds no tensors; the model runner owns the cache memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from neuron_runtime.multimodal import images_in_range
from neuron_runtime.request import Request


def hash_block(
    parent_hash: int | None, token_ids: Sequence[int], images: tuple[tuple[str, int], ...] = ()
) -> int:
    """Hash of one full block, chained to its parent so it names the whole prefix.

    ``images``: (content hash, offset) of each image whose placeholders the block holds.
    """
    if images:
        return hash((parent_hash, tuple(token_ids), images))
    return hash((parent_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class BlockPool:
    """Fixed set of blocks with reference counts, an LRU free queue and a hash index."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first. Cached ones stay findable by hash.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[Block] | None:
        """Takes ``count`` free blocks (evicting cached content), or None if too few."""
        if count > len(self._free):
            return None
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, block: Block) -> None:
        """Adds a reference to a block found by hash (taking it off the free queue if idle)."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def register(self, block: Block, block_hash: int) -> None:
        """Names a full block by its hash so later requests can share it."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays anonymous
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference from each block. Freed tail blocks are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()


class KVCacheManager:
    """Gives requests the blocks their tokens need, sharing cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found cached
        self.held: dict[str, list[int]] = {}  # hold key -> blocks it references

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks referenced by holds."""
        return len({b for blocks in self.held.values() for b in blocks})

    def hold(self, key: str, block_ids: Sequence[int]) -> None:
        """Adds one reference to each block, kept under ``key`` until ``release(key)``."""
        assert key not in self.held, f"hold {key!r} exists"
        for block_id in block_ids:
            self.pool.touch(self.pool.blocks[block_id])
        self.held[key] = list(block_ids)

    def release(self, key: str) -> bool:
        """Drops the hold ``key`` (blocks no request uses become free); False if unknown."""
        block_ids = self.held.pop(key, None)
        if block_ids is None:
            return False
        self.pool.free(block_ids)
        return True

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def match_prefix(self, request: Request) -> int:
        """Attaches cached blocks of the request's prompt; returns the number of tokens hit.

        The last prompt token is always recomputed: its logits are needed to sample.
        """
        assert not request.block_table
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent: int | None = None
        hits: list[tuple[int, Block]] = []
        for i in range(max_blocks):
            block_hash = self._block_hash(request, parent, i)
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append((block_hash, block))
            parent = block_hash
        for block_hash, block in hits:
            self.pool.touch(block)
            request.block_table.append(block.block_id)
            request.block_hashes.append(block_hash)
        return len(hits) * self.block_size

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted lookup (retries of a request that did not fit are not counted)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_prompt_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Ensures blocks for ``num_computed_tokens + num_new_tokens`` tokens; False if full."""
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        missing = needed - len(request.block_table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        # In id order: a prompt's blocks then form runs of consecutive ids in both engines of
        # a KV handoff, and a run is one transfer descriptor (kv_layout.py), not one per
        # block. The pool's eviction order (which blocks are taken) is unchanged.
        request.block_table.extend(sorted(b.block_id for b in blocks))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past those ``num_tokens`` tokens need (the slots of
        rejected draft tokens)."""
        keep = -(-num_tokens // self.block_size)
        if len(request.block_table) > keep:
            self.pool.free(request.block_table[keep:])
            del request.block_table[keep:]

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            block_hash = self._block_hash(request, parent, i)
            request.block_hashes.append(block_hash)
            self.pool.register(self.pool.blocks[request.block_table[i]], block_hash)

    def _block_hash(self, request: Request, parent: int | None, i: int) -> int:
        start, end = i * self.block_size, (i + 1) * self.block_size
        images = images_in_range(request.mm_inputs, start, end) if request.mm_inputs else ()
        return hash_block(parent, request.all_token_ids[start:end], images)

    def free(self, request: Request) -> None:
        self.pool.free(request.block_table)
        request.block_table = []
        request.block_hashes = []
