"""N-gram (prompt lookup) proposer: no model, the sequence's own history."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from neuron_runtime.kv_transfer import DraftHidden
from neuron_runtime.request import Request


def ngram_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, trying n from ``max_n`` down to ``min_n``; [] when nothing matches.

    >>> ngram_propose([1, 2, 3, 4, 1, 2], k=2, min_n=1, max_n=2)
    [3, 4]
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence, the suffix not.
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Proposes from each request's prompt and output (prompt lookup decoding)."""

    needs_slots = False

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [
            ngram_propose(r.all_token_ids, n, self.min_n, self.max_n)
            for r, n in zip(requests, num_tokens, strict=True)
        ]

    def observe(self, step: object, hidden: object, result: object) -> None:
        pass

    def export_state(self, req_id: str) -> None:
        return None  # the tokens are all it needs

    def import_state(self, request: Request, state: DraftHidden) -> None:
        pass

    def can_draft_on_arrival(self, request: Request) -> bool:
        return True

    def release(self, req_id: str) -> None:
        pass
