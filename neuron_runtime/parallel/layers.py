"""Sharded layers: column- and row-parallel linears, vocabulary-parallel embedding and logits.

Each keeps calling the backend's ops on its own shard (``ops.linear``, ``ops.logits``) and adds
the collective after it. With a TP group of one they are the plain layers, same parameters.

How a decoder layer splits over ``tp`` ranks (activations [T, hidden] replicated between):

    x -> qkv_proj (column: this rank's q and kv heads) -> attention on those heads
      -> o_proj (row: the same q heads' input columns) -> all-reduce -> x'
    x' -> gate_up_proj (column: a slice of intermediate) -> act*mul
      -> down_proj (row: that slice) -> all-reduce

Heads are split by whole GQA groups so every rank keeps one q-per-kv ratio: with kv_heads >=
tp the kv heads (and their q heads) are dealt out in contiguous near-equal runs (9 q / 3 kv
heads over 2 ranks: 6 q + 2 kv, then 3 q + 1 kv); with kv_heads < tp each kv head is
replicated on tp / kv_heads ranks, which split its q heads. Checkpoint tensors are read only
in the part a rank holds (``checkpoint_slice``; parallel/loading.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from neuron_runtime.layers.linear import Linear
from neuron_runtime.layers.logits import LogitsHead
from neuron_runtime.parallel.collectives import Communicator
from neuron_runtime.parallel.state import tp_group

# (dim, start, length) of a checkpoint tensor that one rank reads
Slice = tuple[int, int, int]


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part ``index`` when ``total`` is dealt into ``parts`` contiguous
    runs whose lengths differ by at most one (the first ones longer)."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The q and kv heads one rank holds: contiguous runs of the model's heads."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """This rank's heads; ValueError when the heads cannot be split over ``tp`` ranks."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of kv heads")
    q_per_kv = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv_start, kv_count = split_evenly(num_kv_heads, tp, rank)
        return HeadShard(kv_start * q_per_kv, kv_count * q_per_kv, kv_start, kv_count)
    replicas = tp // num_kv_heads
    if tp % num_kv_heads or q_per_kv % replicas:
        raise ValueError(
            f"tensor_parallel_size {tp} cannot split {num_heads} attention heads over "
            f"{num_kv_heads} kv heads: with fewer kv heads than ranks, the ranks must be a "
            "multiple of the kv heads and each kv head's query heads a multiple of its replicas"
        )
    per_rank = num_heads // tp
    return HeadShard(rank * per_rank, per_rank, rank // replicas, 1)


class ShardedLinear(Linear):
    """A ``Linear`` over this rank's part of a bigger one; ``checkpoint_slice`` says which
    part of each checkpoint tensor it holds."""

    tp: Communicator

    def checkpoint_slice(self, param: str, shard: int | None) -> Slice | None:
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Runs once the weights are in (before the backend repacks them)."""


class ColumnParallelLinear(ShardedLinear):
    """Output features split over the TP group; the output stays split (no collective).

    ``output_sizes`` are the full sizes of the fused parts (gate and up: two); each is split
    evenly, so this rank holds the concatenation of its part of each.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = True) -> None:
        tp = tp_group()
        self.parts = [split_evenly(n, tp.size, tp.rank) for n in output_sizes]
        super().__init__(in_features, sum(n for _, n in self.parts), bias)
        self.tp = tp
        self.output_sizes = [n for _, n in self.parts]  # this rank's, per fused part

    def checkpoint_slice(self, param: str, shard: int | None) -> Slice | None:
        if self.tp.size == 1:
            return None
        start, length = self.parts[shard or 0]
        return (0, start, length)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection of this rank's heads (``head_shard``)."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = tp_group()
        self.heads = head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        h = self.heads
        q = (h.q_start * head_dim, h.num_heads * head_dim)
        kv = (h.kv_start * head_dim, h.num_kv_heads * head_dim)
        Linear.__init__(self, hidden, q[1] + 2 * kv[1], bias)
        self.tp = tp
        self.parts = [q, kv, kv]
        self.output_sizes = [q[1], kv[1], kv[1]]


class RowParallelLinear(ShardedLinear):
    """Input features split over the TP group (``input_part``: this rank's (start, length));
    the partial products are summed with an all-reduce. The bias is added once (rank 0's)."""

    def __init__(self, input_part: tuple[int, int], out_features: int, bias: bool = True) -> None:
        super().__init__(input_part[1], out_features, bias)
        self.tp = tp_group()
        self.input_part = input_part

    def checkpoint_slice(self, param: str, shard: int | None) -> Slice | None:
        if self.tp.size == 1 or param == "bias":
            return None
        return (1, *self.input_part)

    def finish_loading(self) -> None:
        if self.bias is not None and self.tp.rank != 0:
            self.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.ops.linear(self, x))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; tokens outside them embed to zero, and the
    all-reduce fills every row from the rank that holds it."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        tp = tp_group()
        self.vocab_start, local = split_evenly(vocab_size, tp.size, tp.rank)
        super().__init__(local, hidden)
        self.tp = tp
        self.vocab_sizes = [split_evenly(vocab_size, tp.size, r)[1] for r in range(tp.size)]

    def checkpoint_slice(self, param: str, shard: int | None) -> Slice | None:
        return None if self.tp.size == 1 else (0, self.vocab_start, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))  # [T, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """An untied lm_head's weight: this rank's vocabulary rows (the logits head multiplies)."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__(vocab_size, hidden)


class ParallelLogitsHead(LogitsHead):
    """Logits of this rank's vocabulary rows, gathered into the full [rows, vocab]."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tp = tp_group()
        self.vocab_sizes = [
            split_evenly(vocab_size, self.tp.size, r)[1] for r in range(self.tp.size)
        ]

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = self.ops.logits(self, hidden, weight)  # [rows, this rank's vocab]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1, sizes=self.vocab_sizes)


def local_kv_heads(num_heads: int, num_kv_heads: int) -> slice:
    """The model's kv heads this rank's KV cache holds (all of them with a TP group of one)."""
    tp = tp_group()
    shard = head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
    return slice(shard.kv_start, shard.kv_start + shard.num_kv_heads)
