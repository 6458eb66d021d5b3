"""The colocated LLM deployment: one AsyncEngine per replica, streaming token ids.

Text is the ingress's job (chat template, detokenization, stop strings): this shell takes
token ids in and streams token ids (+ logprobs and finish info) out, as plain data.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ray import serve

from deployments.engine_replica import EngineReplica, image_inputs, to_step_output
from deployments.protocol import GenerateRequest, StepOutput
from neuron_runtime import RequestOutputKind, SamplingParams, tracing
from neuron_runtime.kv_transfer import KVHandoff, KVMetadata


@serve.deployment(
    name="LLMServer",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=64,
    health_check_period_s=5,
    health_check_timeout_s=10,
)
class LLMServer(EngineReplica):
    """Serves ``generate`` streams from one engine (prefill and decode together)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lower_serving_threads()

    async def generate(
        self, request: GenerateRequest, subscriber: str | None = None
    ) -> AsyncIterator[StepOutput]:
        """Streams one StepOutput per engine step until the request finishes; with a
        ``subscriber`` only the first, the rest going over its step channel.

        ValueError (invalid prompt or params) comes out of the first iteration; a caller that
        cancels the call (client gone, stop string found) aborts the request in the engine.
        """
        steps = self._steps(request)
        async for step in self.publisher.publish(subscriber, request.request_id, steps):
            yield step

    async def _steps(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        trace = tracing.EngineTrace(
            "engine", request.trace_context, {"neuron_serve.replica": self.replica_id}
        )
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        images = await image_inputs(request.images)
        first = True
        async for out in trace.follow(
            self.engine.generate(
                prompt,
                params,
                request.request_id,
                kind=RequestOutputKind.DELTA,
                handoff=self._resumed(request),
                **images,
            )
        ):
            step = to_step_output(out, with_queue_time=first)
            first = False
            if out.finished:
                step.stats = self.stats()
            yield step

    def _resumed(self, request: GenerateRequest) -> KVHandoff | None:
        """A migrated request (router/migration.py) goes on after the tokens its lost replica
        produced: a handoff without KV, so the engine recomputes prompt and tokens."""
        if not request.resume_token_ids:
            return None
        model = self.engine.engine.config.model
        metadata = KVMetadata.describe(model, request.prompt_token_ids)
        return KVHandoff(metadata, list(request.resume_token_ids))
