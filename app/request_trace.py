"""The ingress's part of a request's trace: ``gen_ai.*`` attributes and latencies on the root
span (the middleware's), and the detokenize-and-stream span.

Attribute names follow the OpenTelemetry GenAI conventions where they exist
(``gen_ai.operation.name``, ``gen_ai.request.*``, ``gen_ai.usage.input_tokens``, ...) and vLLM's
request span for the latencies (``gen_ai.latency.*``, seconds):

- ``time_in_queue``: the prefill (or colocated) engine's queue, arrival to first schedule;
- ``time_in_model_prefill``: that engine's first schedule to first token;
- ``time_to_first_token`` and ``e2e``: measured here, from the root span's start (the request
  reaching the ingress) to the first token's arrival and to the end of the stream;
- ``time_in_model_decode``: here, from the first token's arrival to the last's (in the
  disaggregated app this includes the KV handoff to the decode replica).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import Span

from deployments.protocol import StepOutput
from neuron_runtime import tracing


def request_attributes(
    request: Any,
    model: str,
    response_id: str,
    sampling: dict[str, Any],
    num_prompts: int = 1,
) -> None:
    """The request's model and sampling settings on the current root span (if traced);
    ``request`` is the chat or completion request model, ``sampling`` its SamplingParams
    fields."""
    operation = "chat" if hasattr(request, "messages") else "text_completion"
    root = tracing.current_span()
    if root is None:
        return
    tracing.set_attributes(
        root,
        {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.request.id": response_id,
            "gen_ai.response.id": response_id,
            "gen_ai.request.max_tokens": sampling.get("max_tokens"),
            "gen_ai.request.temperature": sampling.get("temperature"),
            "gen_ai.request.top_p": sampling.get("top_p"),
            "gen_ai.request.top_k": sampling.get("top_k"),
            "gen_ai.request.seed": sampling.get("seed"),
            "gen_ai.request.choice.count": sampling.get("n"),
            "neuron_serve.num_prompts": num_prompts,
        },
    )


class StreamTrace:
    """Follows one generation's engine steps at the ingress; every method is a no-op when the
    request is not traced.

    ``start`` once the first step of every prompt is in, ``step`` per engine step, ``finish``
    once, from the ``finally`` clause around the stream (an exception propagating through it
    marks the root span as failed; a cancelled stream is noted as such).
    """

    def __init__(self, root: Span | None, firsts: Sequence[StepOutput]) -> None:
        self.root = root
        self.first_token: int | None = None
        self.last_token: int | None = None
        self.num_steps = 0
        self.num_tokens = 0
        self.stream: Span | None = None
        if root is None:
            return
        # ns since the epoch: when the request reached the ingress (the root span's start)
        self.started: int = getattr(root, "start_time", None) or time.time_ns()
        self.stream = tracing.start_span("ingress.detokenize_stream", root)
        queue = [s.queue_time_s for s in firsts if s.queue_time_s is not None]
        prefill = [s.prefill_time_s for s in firsts if s.prefill_time_s is not None]
        tracing.set_attributes(
            root,
            {
                "gen_ai.latency.time_in_queue": max(queue) if queue else None,
                "gen_ai.latency.time_in_model_prefill": max(prefill) if prefill else None,
                "gen_ai.usage.input_tokens": sum(s.num_prompt_tokens for s in firsts),
                "gen_ai.usage.cached_input_tokens": sum(s.num_cached_tokens for s in firsts),
            },
        )

    @classmethod
    def start(cls, firsts: Sequence[StepOutput]) -> StreamTrace:
        return cls(tracing.current_span(), firsts)

    def step(self, step: StepOutput) -> None:
        if self.root is None:
            return
        num_tokens = sum(len(d.token_ids) for d in step.seqs)
        self.num_steps += 1
        if num_tokens:
            now = time.time_ns()
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.num_tokens += num_tokens

    def finish(self, num_output_tokens: int, finish_reasons: Sequence[str | None]) -> None:
        if self.root is None:
            return
        root, self.root = self.root, None
        error = sys.exc_info()[1]
        end = time.time_ns()
        attributes: dict[str, Any] = {
            "gen_ai.usage.output_tokens": num_output_tokens,
            "gen_ai.response.finish_reasons": [reason or "none" for reason in finish_reasons],
            "gen_ai.latency.e2e": (end - self.started) / 1e9,
        }
        if self.first_token is not None and self.last_token is not None:
            ttft = (self.first_token - self.started) / 1e9
            attributes["gen_ai.latency.time_to_first_token"] = ttft
            decode = (self.last_token - self.first_token) / 1e9
            attributes["gen_ai.latency.time_in_model_decode"] = decode
        tracing.set_attributes(root, attributes)
        tracing.set_attributes(
            self.stream,
            {"neuron_serve.num_steps": self.num_steps, "neuron_serve.num_tokens": self.num_tokens},
        )
        if isinstance(error, GeneratorExit | asyncio.CancelledError):
            # The consumer stopped early: the client left, or every sequence hit a stop string.
            tracing.set_attributes(self.stream, {"neuron_serve.closed_early": True})
            error = None
        if error is not None:
            tracing.set_error(root, error)
        tracing.end(self.stream, error)
