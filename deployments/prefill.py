"""The prefill deployment: the engine in prefill role.

It computes a prompt's KV and first token, copies the KV out of its cache (the blocks stay in
its prefix cache for later requests) and puts it in Ray's object store as numpy, zero-copy for
the reader. The payload lives as long as someone holds its reference: the router drops it once
the decode replica has the KV, or when the request ends; if this replica dies, the payload is
lost and the decode side falls back to its policy (recompute or fail).
"""

from __future__ import annotations

import time

import ray
from ray import serve

from deployments.engine_replica import EngineReplica, to_step_output
from deployments.protocol import GenerateRequest, KVTransferInfo, PrefillResult
from neuron_runtime import RequestOutputKind, SamplingParams


@serve.deployment(
    name="PrefillServer",
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=32,
    health_check_period_s=5,
    health_check_timeout_s=10,
)
class PrefillServer(EngineReplica):
    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Runs the prompt; ValueError (invalid prompt or params) reaches the caller."""
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        final = None
        async for out in self.engine.generate(
            prompt, params, request.request_id, kind=RequestOutputKind.FINAL_ONLY, export_kv=True
        ):
            final = out
        assert final is not None and final.finished
        step = to_step_output(final, with_queue_time=True)
        step.stats = self.stats()
        handoff = final.kv_handoff
        if handoff is None or handoff.payload is None:
            return PrefillResult(step, replica_id=self.replica_id)
        # The request goes on at a decode replica: to the router it has not finished.
        step.finished = False
        for seq in step.seqs:
            seq.finish_reason = None
        start = time.perf_counter()
        kv_ref = ray.put(handoff.payload)
        nbytes = handoff.payload.nbytes
        step.kv_transfer = KVTransferInfo(
            "object_store", "export", nbytes, time.perf_counter() - start
        )
        return PrefillResult(
            step,
            kv_ref=kv_ref,
            num_kv_bytes=nbytes,
            generator_state=handoff.generator_state(0),
            replica_id=self.replica_id,
        )
