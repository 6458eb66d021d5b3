"""Token bitmasks: which tokens each constrained row may sample, as a plain int32 tensor.

    bitmask: [R, ceil(V / 32)] int32; bit j of word w allows token 32 * w + j

A row of all ones (-1) allows every token, so a static-shape sampler can pass a full
[B, W] bitmask with -1 rows for unconstrained requests; the dynamic runner passes only the
constrained rows and their row indices. The scheduler hands each constrained sampling slice
its row (``ScheduledSeq.grammar_bitmask``, a ``BitmaskRow``), filled one of two ways:

- ahead, on the grammar manager's thread while the forward pass runs (a core is free for it);
- on demand, on the thread that first needs the row (the forward pass takes every core).

A greedy row needs no mask when the model's own choice is allowed: the argmax over the
allowed tokens is the unmasked argmax whenever that one is allowed. ``fix_greedy_tokens``
checks each greedy row's token (``BitmaskRow.allows``: a bit of a filled row, else mostly the
matcher's own check, with no mask) and masks only the rows whose token the grammar refuses.
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
    thread may still be filling (``filled`` completes when it is done). A row filled on demand
    carries its request's ``matcher`` (llguidance.LLMatcher) and an unstarted ``filled``: the
    first ``get`` fills it on the calling thread."""

    batch: torch.Tensor
    index: int
    filled: Future[Any]
    matcher: Any = None

    def get(self) -> torch.Tensor:
        """The row, [ceil(V / 32)] int32, once filled; raises what a failed fill raised."""
        if self.matcher is not None and not self.filled.done():
            self._fill_here()
        self.filled.result()
        return self.batch[self.index]

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next (True only where the mask allows it).

        A row not filled on demand yet asks its matcher (a few microseconds, no mask) unless
        the grammar forces bytes next: the mask then allows only the token that starts their
        canonical tokenization, while the matcher's check would also take a shorter prefix
        (``{`` where ``{"`` is forced), so the row is filled. The check refuses a few tokens
        the mask allows (EOS once the grammar has stopped): a refusal means fill and mask."""
        if (
            self.matcher is not None
            and not self.filled.done()
            and not self.matcher.compute_ff_bytes()
        ):
            return int(self.matcher.validate_tokens([token])) == 1
        return bool((int(self.get()[token // 32]) >> (token % 32)) & 1)

    def _fill_here(self) -> None:
        import llguidance.torch

        try:
            llguidance.torch.fill_next_token_bitmask(self.matcher, self.batch, self.index)
        except BaseException as exc:  # noqa: BLE001 - raised again by filled.result()
            self.filled.set_exception(exc)
        else:
            self.filled.set_result(None)


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
    """Masks each row of ``logits`` [B, V] that has a bitmask row (on the CPU; fills it or
    waits for its fill); rows with None (unconstrained requests) are left as they are."""
    rows = [row for row, bitmask in enumerate(bitmasks) if bitmask is not None]
    if not rows:
        return logits
    stacked = torch.stack([bitmasks[row].get() for row in rows])  # type: ignore[union-attr]
    return apply_token_bitmask(
        logits, stacked.to(logits.device), torch.tensor(rows, device=logits.device)
    )


def fix_greedy_tokens(
    logits: torch.Tensor, tokens: torch.Tensor, bitmasks: Sequence[BitmaskRow | None]
) -> torch.Tensor:
    """Greedy tokens picked from unmasked ``logits`` [B, V] -> the tokens masking first gives.

    tokens: [B] long, ``logits.argmax(-1)``; ``bitmasks``: a row for each greedy constrained
    row, None for the others (left as they are). A row whose token its grammar allows keeps
    it (the argmax over the allowed tokens, ties included: the first maximum is allowed); the
    others are masked and take the argmax of what is left. Returns a new tensor when a token
    changes, else ``tokens``.
    """
    picked = tokens.tolist()
    refused = [
        row
        for row, bitmask in enumerate(bitmasks)
        if bitmask is not None and not bitmask.allows(picked[row])
    ]
    if not refused:
        return tokens
    stacked = torch.stack([bitmasks[row].get() for row in refused])  # type: ignore[union-attr]
    masked = apply_token_bitmask(logits[refused], stacked.to(logits.device))  # [F, V]
    tokens = tokens.clone()
    tokens[refused] = masked.argmax(dim=-1).to(tokens.dtype)
    return tokens
