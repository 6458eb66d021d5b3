"""Plain data that crosses the Ray boundaries between ingress, router and engine deployments.

Only ints, floats, strings, lists of them, numpy arrays, frozen dataclasses of those and object
refs: no torch tensors, no live engine objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deployments.kv_transport import KVTicket


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
    # Disaggregated serving: on the prefill output, how long handing the KV over took; on
    # the first decode output, how the KV arrived.
    kv_transfer: KVTransferInfo | None = None


@dataclass
class KVTransferInfo:
    transport: str  # "object_store" | "gloo" | "recompute"
    stage: str  # "export" (prefill side, before the first token returns) | "import"
    num_bytes: int
    # export: handing the KV to the transport (object store: the copy into it; gloo: the outbox);
    # import: asking for it to holding it (gloo: the whole transfer)
    seconds: float
    failed: bool = False  # the fetch failed or timed out (then the prompt was recomputed)


@dataclass
class PrefillResult:
    """A prefill replica's answer: the first token and, unless the request already ended,
    the ticket a decode replica redeems for the prompt's KV (deployments/kv_transport.py)."""

    step: StepOutput
    kv_ticket: KVTicket | None = None
    num_kv_bytes: int = 0
    generator_state: np.ndarray | None = None  # the seeded sampler's state after token 1
    replica_id: str = ""


@dataclass
class DecodeRequest:
    """Continue a prefilled request: its prompt, the tokens already sent, and its KV."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    output_token_ids: list[int]
    kv_ticket: KVTicket | None = None  # None means recompute the prompt
    num_kv_bytes: int = 0
    generator_state: np.ndarray | None = None
