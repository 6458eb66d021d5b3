"""Token bitmasks: which tokens each constrained row may sample, as a plain int32 tensor.

    bitmask: [R, ceil(V / 32)] int32; bit j of word w allows token 32 * w + j

A row of all ones (-1) allows every token, so a static-shape sampler can pass a full
[B, W] bitmask with -1 rows for unconstrained requests; the dynamic runner passes only the
constrained rows and their row indices. The scheduler hands each constrained sampling slice
its row (``ScheduledSeq.grammar_bitmask``, a ``BitmaskRow``): the manager fills the step's
bitmask on a worker thread while the forward pass runs, and the sampler waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BitmaskRow:
    """Row ``index`` of a step's bitmask ``batch`` [R, ceil(V / 32)] int32, which a worker
    thread may still be filling (``filled`` completes when it is done)."""

    batch: torch.Tensor
    index: int
    filled: Future[Any]

    def get(self) -> torch.Tensor:
        """The row, [ceil(V / 32)] int32, once filled; raises what a failed fill raised."""
        self.filled.result()
        return self.batch[self.index]


_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit j is set, -inf where it is not."""
    key = (device, dtype)
    table = _BYTE_BIAS.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))
        table = _BYTE_BIAS[key] = table.to(device)
    return table


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] additive bias: 0 allowed, -inf not allowed.

    One table lookup per byte (a bool mask and ``masked_fill`` cost ~3x more on CPU here).
    Tokens past 32 * W are not allowed. Assumes little-endian words, as on x86 and ARM.
    """
    num_rows, num_words = bitmask.shape
    table = _byte_bias(bitmask.device, dtype)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [R, 4W]
    bias = F.embedding(as_bytes, table).view(num_rows, num_words * 32)
    if num_words * 32 < vocab_size:
        pad = bias.new_full((num_rows, vocab_size - num_words * 32), float("-inf"))
        return torch.cat([bias, pad], dim=1)
    return bias[:, :vocab_size]


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Sets the logits of disallowed tokens to -inf; returns a new tensor.

    logits: [B, V] float; bitmask: [R, ceil(V / 32)] int32 on the logits' device; rows: [R]
    long, the logits row each bitmask row constrains (None: R == B, row i -> row i). Rows
    not named keep their logits bit for bit.
    """
    bias = bitmask_bias(bitmask, logits.shape[1], logits.dtype)
    if rows is None:
        return logits + bias
    return logits.index_add(0, rows, bias)


def apply_grammar_bitmasks(
    logits: torch.Tensor, bitmasks: Sequence[BitmaskRow | None]
) -> torch.Tensor:
    """Masks each row of ``logits`` [B, V] that has a bitmask row (on the CPU; waits for its
    fill); rows with None (unconstrained requests) are left as they are."""
    rows = [row for row, bitmask in enumerate(bitmasks) if bitmask is not None]
    if not rows:
        return logits
    stacked = torch.stack([bitmasks[row].get() for row in rows])  # type: ignore[union-attr]
    return apply_token_bitmask(
        logits, stacked.to(logits.device), torch.tensor(rows, device=logits.device)
    )
