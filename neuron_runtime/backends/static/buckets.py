"""Shape buckets of the static runner, and picking the bucket a step runs in.

A compiled graph serves one input shape. Decodes run as ``[num_seqs, 1]`` token grids,
prefill slices one at a time as ``[1, num_tokens]``; both attend over a block table of
``context_blocks`` blocks. With speculative decoding a step's short slices (a verify slice:
the last token and up to k drafts; a decode; a prompt of at most k + 1 tokens) run together
as one ``[num_seqs, k + 1]`` verify grid, each row padded to k + 1 tokens (one weight read
for the whole batch). Each dimension takes the smallest bucket that holds it: padding wastes
at most half of a power-of-two bucket, and the number of graphs grows with the log of the
limits.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Literal

from neuron_runtime.config import EngineConfig

Phase = Literal["decode", "verify", "prefill"]

MIN_TOKEN_BUCKET = 16
MIN_CONTEXT_BUCKET = 4  # blocks


def powers_of_two(limit: int, start: int = 1) -> tuple[int, ...]:
    """``start, 2 * start, ...`` below ``limit``, then ``limit`` itself."""
    values = []
    v = max(1, min(start, limit))
    while v < limit:
        values.append(v)
        v *= 2
    return (*values, limit)


@dataclass(frozen=True)
class Bucket:
    """One compiled shape: ``num_seqs`` rows of ``num_tokens`` tokens, ``context_blocks`` blocks."""

    phase: Phase
    num_seqs: int
    num_tokens: int
    context_blocks: int

    def __str__(self) -> str:
        return f"{self.phase} {self.num_seqs}x{self.num_tokens} ctx {self.context_blocks}"


@dataclass(frozen=True)
class Buckets:
    seqs: tuple[int, ...]
    tokens: tuple[int, ...]
    context_blocks: tuple[int, ...]
    block_size: int
    # Tokens per row of the verify grids: k + 1 with speculative decoding; 1 means none.
    verify_tokens: int = 1

    @classmethod
    def from_config(cls, config: EngineConfig) -> Buckets:
        """The configured buckets; each list left empty is generated from the limits."""
        graph, sched, spec = config.graph, config.scheduler, config.speculative
        max_blocks = -(-config.model.max_model_len // config.cache.block_size)
        max_slice = min(sched.max_num_batched_tokens, config.model.max_model_len)
        buckets = cls(
            seqs=graph.seq_buckets or powers_of_two(sched.max_num_seqs),
            tokens=graph.token_buckets or powers_of_two(max_slice, MIN_TOKEN_BUCKET),
            context_blocks=graph.context_buckets or powers_of_two(max_blocks, MIN_CONTEXT_BUCKET),
            block_size=config.cache.block_size,
            verify_tokens=1 + (spec.num_speculative_tokens if spec is not None else 0),
        )
        for name, values, need in (
            ("seq_buckets", buckets.seqs, sched.max_num_seqs),
            ("token_buckets", buckets.tokens, max_slice),
            ("context_buckets", buckets.context_blocks, max_blocks),
        ):
            if values[-1] < need:
                raise ValueError(
                    f"{name} end at {values[-1]}, below what a step can need ({need}): "
                    "add a larger bucket"
                )
        return buckets

    def decode(self, num_seqs: int, context_blocks: int) -> Bucket:
        return Bucket(
            "decode", fit(self.seqs, num_seqs), 1, fit(self.context_blocks, context_blocks)
        )

    def verify(self, num_seqs: int, context_blocks: int) -> Bucket:
        assert self.verify_tokens > 1, "no verify buckets without speculative decoding"
        return Bucket(
            "verify",
            fit(self.seqs, num_seqs),
            self.verify_tokens,
            fit(self.context_blocks, context_blocks),
        )

    def rows(self, num_seqs: int, max_tokens: int, context_blocks: int) -> Bucket:
        """The grid for ``num_seqs`` short slices of at most ``max_tokens`` tokens each: the
        decode grid when each has one token, else the verify grid."""
        if max_tokens == 1:
            return self.decode(num_seqs, context_blocks)
        return self.verify(num_seqs, context_blocks)

    def prefill(self, num_tokens: int, context_blocks: int) -> Bucket:
        tokens = fit(self.tokens, num_tokens)
        # The slice's own keys live in the table too: at least ceil(tokens / block_size).
        need = max(context_blocks, -(-tokens // self.block_size))
        return Bucket("prefill", 1, tokens, fit(self.context_blocks, need))

    def all(self) -> list[Bucket]:
        """Every bucket a step can select: the warm-up list."""
        decodes = [self.decode(s, c) for s in self.seqs for c in self.context_blocks]
        if self.verify_tokens > 1:
            decodes += [self.verify(s, c) for s in self.seqs for c in self.context_blocks]
        prefills = {self.prefill(t, c) for t in self.tokens for c in self.context_blocks}
        return decodes + sorted(prefills, key=lambda b: (b.num_tokens, b.context_blocks))


def fit(values: tuple[int, ...], n: int) -> int:
    i = bisect_left(values, n)
    if i == len(values):
        raise ValueError(f"no bucket holds {n} (largest {values[-1]})")
    return values[i]
