"""The KV cache as memory regions, for block-granular transfers between two engines' caches.

Per layer the cache is a (key, value) pair of tensors ``[num_kv_heads, num_blocks, block_size,
head_dim]`` (layers/attention.py). Each tensor is one contiguous region; region ``r`` is layer
``r // 2``'s keys (even r) or values (odd r). Inside a region a block of one KV head is one
contiguous run of ``block_size * head_dim`` values:

    region r (layer r // 2, K or V):
      head 0: [block 0][block 1][block 2] ... [block num_blocks-1]
      head 1: [block 0][block 1][block 2] ... [block num_blocks-1]
      ...
    one cell = block_size * head_dim float32 = block_bytes

So one block of one layer is ``num_kv_heads`` descriptors, and a request's KV is one
descriptor per (region, head, block). Runs of blocks that are consecutive on both sides merge
into one descriptor: a transfer between two idle caches is a few hundred descriptors, one
between fragmented caches one per (region, head, block).

This module computes addresses, and backs the regions with huge pages: a transfer between two
processes on one host (cross-memory attach) pins and copies the source page by page, and with
4 KiB pages that costs as much as the copy (2 MiB pages doubled the READ's bandwidth here).
The transfer library (deployments/nixl_transport.py) registers the regions and moves the bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HUGE_PAGE_BYTES = 2 << 20
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14


@dataclass(frozen=True)
class KVLayout:
    """The shape of an engine's KV cache; two caches can exchange blocks iff these are equal
    (``num_blocks`` aside: each side addresses its own)."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    num_blocks: int
    dtype: str = "float32"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one KV head in one region."""
        return self.block_size * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers

    def compatible(self, other: KVLayout) -> bool:
        """Whether blocks of ``other``'s cache can be copied into this one as they are."""
        return (
            self.num_layers,
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
            self.dtype,
        ) == (other.num_layers, other.num_kv_heads, other.block_size, other.head_dim, other.dtype)

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field that differs (``num_blocks`` aside), or None."""
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} {theirs} vs {mine}"
        return None


def cache_layout(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
    """The layout of a model runner's cache tensors (checked contiguous and uniform)."""
    first = kv_caches[0][0]
    for k, v in kv_caches:
        for t in (k, v):
            assert t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
    kvh, num_blocks, block_size, head_dim = first.shape
    dtype = str(first.dtype).removeprefix("torch.")
    return KVLayout(len(kv_caches), kvh, block_size, head_dim, num_blocks, dtype)


def cache_regions(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The cache tensors in region order: layer 0 K, layer 0 V, layer 1 K, ..."""
    return [t for pair in kv_caches for t in pair]


def region_addresses(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in cache_regions(kv_caches))


def read_descriptors(
    layout: KVLayout,
    src_addresses: tuple[int, ...],
    src_num_blocks: int,
    src_blocks: list[int],
    dst_addresses: tuple[int, ...],
    dst_blocks: list[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor lists copying ``src_blocks`` of one cache into ``dst_blocks`` of another.

    Both caches have ``layout`` (but their own ``num_blocks``: ``layout.num_blocks`` is the
    destination's). Returns (src, dst) arrays ``[N, 3]`` uint64 of (address, length, device 0),
    row i of src copied to row i of dst; runs of blocks consecutive on both sides are merged.
    """
    assert len(src_blocks) == len(dst_blocks) and src_blocks
    assert len(src_addresses) == len(dst_addresses) == layout.num_regions
    src = np.asarray(src_blocks, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)
    # A run goes on while both sides step by the same +1 or -1 (freed blocks return to the
    # pool's queue in reverse, so descending runs are common); it breaks anywhere else.
    step_src, step_dst = np.diff(src), np.diff(dst)
    joined = (step_src == step_dst) & (np.abs(step_src) == 1)
    joined[1:] &= ~((step_src[1:] != step_src[:-1]) & joined[:-1])  # a turn starts a new run
    breaks = np.flatnonzero(~joined) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)])) - 1
    lengths = ends - starts + 1
    bb = layout.block_bytes
    heads = np.arange(layout.num_kv_heads, dtype=np.int64)
    # A run covers blocks [min, max] of each side; [regions, heads, runs] byte offsets.
    src_first = np.minimum(src[starts], src[ends])
    dst_first = np.minimum(dst[starts], dst[ends])
    src_off = (heads[:, None] * src_num_blocks + src_first[None, :]) * bb
    dst_off = (heads[:, None] * layout.num_blocks + dst_first[None, :]) * bb
    src_base = np.asarray(src_addresses, dtype=np.int64)[:, None, None]
    dst_base = np.asarray(dst_addresses, dtype=np.int64)[:, None, None]
    run_bytes = np.broadcast_to(lengths * bb, (layout.num_regions, *src_off.shape))
    return _rows(src_base + src_off, run_bytes), _rows(dst_base + dst_off, run_bytes)


def _rows(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    rows = np.zeros((addresses.size, 3), dtype=np.uint64)
    rows[:, 0] = addresses.reshape(-1)
    rows[:, 1] = lengths.reshape(-1)
    return rows


def use_huge_pages(regions: list[torch.Tensor]) -> int:
    """Backs the 2 MiB-aligned interior of each host-memory region with transparent huge pages,
    keeping its contents; returns the bytes now eligible (0 where the kernel has none).

    Pages already touched stay small after ``madvise(MADV_HUGEPAGE)``, so each interior is
    copied out, dropped and copied back: the copy back faults it in as huge pages. Call it
    before any transfer library registers the regions, while nothing else uses them.
    """
    libc = _libc()
    if libc is None or not _huge_pages_allowed():
        return 0
    total = 0
    for region in regions:
        if region.device.type != "cpu" or not region.is_contiguous():
            continue
        start = region.data_ptr()
        size = region.numel() * region.element_size()
        lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        hi = (start + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if hi <= lo:
            continue
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) != 0:
            continue
        flat = region.view(-1)
        item = region.element_size()
        interior = flat[(lo - start) // item : (hi - start) // item]
        saved = interior.clone()
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0:
            total += hi - lo
        interior.copy_(saved)
    return total


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "madvise"):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _huge_pages_allowed() -> bool:
    """Transparent huge pages on for madvised memory ("always" or "madvise"), Linux only."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False
