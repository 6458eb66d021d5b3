"""Speculative decoding counters, exported under vLLM's metric names."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's names (vllm/v1/spec_decode/metrics.py); Prometheus adds ``_total`` to counters.
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeStats:
    """Totals since the engine started: verify steps with drafts, draft tokens proposed,
    of those accepted, and accepted per draft position (index 0: the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """(vLLM metric name, labels, value) for every counter."""
        out: list[tuple[str, dict[str, str], float]] = [
            (NUM_DRAFTS, {}, self.num_drafts),
            (NUM_DRAFT_TOKENS, {}, self.num_draft_tokens),
            (NUM_ACCEPTED_TOKENS, {}, self.num_accepted_tokens),
        ]
        for pos, count in enumerate(self.num_accepted_tokens_per_pos):
            out.append((NUM_ACCEPTED_TOKENS_PER_POS, {"position": str(pos)}, count))
        return out


class SpecDecodeCounters:
    """The engine's running totals; ``snapshot`` freezes them into ``SpecDecodeStats``."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.per_pos = [0] * num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.per_pos[pos] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.per_pos),
        )
