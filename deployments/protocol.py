"""Plain data that crosses the Ray boundary between the ingress and the LLM deployment.

Only ints, floats, strings and lists of them: no torch tensors, no live engine objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    """A tokenized prompt and its SamplingParams fields (vLLM names)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]


@dataclass
class SeqDelta:
    """New tokens of one of the ``n`` sequences since the previous step."""

    index: int
    token_ids: list[int]
    # Per new token: {token id: logprob} for the sampled token and the top-N, when asked.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    seqs: list[SeqDelta]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    # Engine-side timings in seconds (set once known): waiting before the first schedule.
    queue_time_s: float | None = None
    # The serving replica's load after this step, on the last output only.
    stats: dict[str, Any] | None = field(default=None)
