"""The prefill deployment: the engine in prefill role.

It computes a prompt's KV and first token, copies the KV out of its cache (the blocks stay in
its prefix cache for later requests) and hands it to the configured KV transport, whose ticket
goes back with the first token (deployments/kv_transport.py). With the object store the
payload lives as long as someone holds its reference: the router drops it once the decode
replica has the KV, or when the request ends. With gloo it waits in this replica's outbox until
a decode replica asks for it or it expires. If this replica dies, the payload is lost and the
decode side falls back to its policy (recompute or fail).
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

from deployments.engine_replica import EngineReplica, image_inputs, to_step_output
from deployments.kv_transport import KVTransportConfig, make_transport
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
    def __init__(
        self,
        engine_args: dict[str, Any],
        engine_cls: type | None = None,
        stall_timeout_s: float = 30.0,
        kv_transport: KVTransportConfig | None = None,
    ) -> None:
        super().__init__(engine_args, engine_cls, stall_timeout_s)
        self.transport = make_transport(kv_transport or KVTransportConfig())

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Runs the prompt; ValueError (invalid prompt or params) reaches the caller."""
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        images = await image_inputs(request.images)
        final = None
        async for out in self.engine.generate(
            prompt,
            params,
            request.request_id,
            kind=RequestOutputKind.FINAL_ONLY,
            export_kv=True,
            **images,
        ):
            final = out
        assert final is not None and final.finished
        step = to_step_output(final, with_queue_time=True)
        handoff = final.kv_handoff
        if handoff is None or handoff.payload is None:
            step.stats = self.stats()
            return PrefillResult(step, replica_id=self.replica_id)
        # The request goes on at a decode replica: to the router it has not finished.
        step.finished = False
        for seq in step.seqs:
            seq.finish_reason = None
        start = time.perf_counter()
        ticket = self.transport.export(handoff.payload)
        nbytes = handoff.payload.nbytes
        step.kv_transfer = KVTransferInfo(
            self.transport.name, "export", nbytes, time.perf_counter() - start
        )
        step.stats = self.stats()
        return PrefillResult(
            step,
            kv_ticket=ticket,
            num_kv_bytes=nbytes,
            generator_state=handoff.generator_state(0),
            replica_id=self.replica_id,
        )

    def stats(self) -> dict[str, Any]:
        """The engine's load, and the exported payloads no decode replica has asked for yet."""
        return {**super().stats(), "num_kv_outbox": self.transport.num_outbox()}

    def __del__(self) -> None:
        # Serve calls this on shutdown; __init__ may have failed before the transport existed.
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
