"""N-gram (prompt lookup) proposer: no model, the sequence's own history."""

from __future__ import annotations

from array import array

from neuron_runtime.kv_transfer import DraftHidden
from neuron_runtime.request import Request


def ngram_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, trying n from ``max_n`` down to ``min_n``; [] when nothing matches.

    >>> ngram_propose([1, 2, 3, 4, 1, 2], k=2, min_n=1, max_n=2)
    [3, 4]
    """
    # A byte search over the ids as fixed-width integers runs in C: it runs every decode
    # step of every request, so it must cost microseconds, not a numpy pipeline's ~0.1 ms.
    data = array("I", token_ids).tobytes()
    width = len(data) // max(len(token_ids), 1)
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * width :]
        # Occurrences inside the first length - 1 tokens: every earlier one, the suffix not.
        end = (length - 1) * width
        pos = data.rfind(pattern, 0, end)
        while pos > 0 and pos % width:  # a match across token boundaries
            pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0:
            start = pos // width + n
            return list(token_ids[start : start + k])
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
