"""What the engine returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from neuron_runtime.kv_transfer import KVHandoff


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Per output token: {token id: logprob} for the sampled token and the top-N (if asked).
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Per prompt token: None for the first, then {token id: logprob} (prompt_logprobs asked).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prefill role: the prompt's KV and the first token, for a decode engine to continue.
    kv_handoff: KVHandoff | None = None
