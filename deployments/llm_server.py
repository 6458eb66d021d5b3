"""The colocated LLM deployment: one AsyncEngine per replica, streaming token ids.

Text is the ingress's job (chat template, detokenization, stop strings): this shell takes
token ids in and streams token ids (+ logprobs and finish info) out, as plain data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve

from deployments.protocol import GenerateRequest, SeqDelta, StepOutput
from neuron_runtime import AsyncEngine, EngineArgs, RequestOutputKind, SamplingParams
from neuron_runtime.outputs import RequestOutput


@serve.deployment(
    name="LLMServer",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=64,
    health_check_period_s=5,
    health_check_timeout_s=10,
)
class LLMServer:
    """Serves ``generate`` streams from one engine; ``engine_cls`` lets tests inject a fake."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        engine_cls: type | None = None,
        stall_timeout_s: float = 30.0,
    ) -> None:
        # Several replicas, the ingress and Ray share the CPUs: oversubscribed torch thread
        # pools slow every process down (PERF.md).
        torch.set_num_threads(1)
        engine_cls = engine_cls or AsyncEngine
        self.engine = engine_cls.from_engine_args(EngineArgs(**engine_args))
        self.stall_timeout_s = stall_timeout_s
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except RuntimeError:  # constructed outside a replica (unit tests, benchmarks)
            self.replica_id = "local"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """Streams one StepOutput per engine step until the request finishes.

        ValueError (invalid prompt or params) comes out of the first iteration; a caller that
        stops iterating (client gone, stop string found) aborts the request in the engine.
        """
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        first = True
        async for out in self.engine.generate(
            prompt, params, request.request_id, kind=RequestOutputKind.DELTA
        ):
            step = to_step_output(out, with_queue_time=first)
            first = False
            if out.finished:
                step.stats = self.stats()
            yield step

    def stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, **dataclasses.asdict(self.engine.stats())}

    def check_health(self) -> None:
        """Ray Serve's health probe: raises when the engine loop died or is stuck."""
        self.engine.check_health(stall_timeout_s=self.stall_timeout_s)


def to_step_output(out: RequestOutput, with_queue_time: bool = False) -> StepOutput:
    seqs = [
        SeqDelta(
            index=c.index,
            token_ids=list(c.token_ids),
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if isinstance(c.stop_reason, int) else None,
        )
        for c in out.outputs
        if c.token_ids or c.finish_reason is not None
    ]
    queue_time = None
    scheduled = out.metrics.get("first_scheduled_time")
    if with_queue_time and scheduled is not None:
        queue_time = max(0.0, scheduled - out.metrics["arrival_time"])
    return StepOutput(
        seqs=seqs,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        finished=out.finished,
        error=out.error,
        queue_time_s=queue_time,
    )
