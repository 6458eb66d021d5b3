"""The prefill deployment: the engine in prefill role.

It computes a prompt's KV and first token. The engine then hands the request off: its prompt
blocks stay held in the cache (outside the running batch) and the ``KVHandoff`` names them.
The configured transport (deployments/kv_transport.py) adds its ticket and takes over the
hold: with NIXL the blocks are freed when the decode replica's READ completes (a NIXL
notification) or ``hold_timeout_s`` after the export, whichever comes first; with the object
store they are copied out and freed at once. If this replica dies the KV is lost and the
decode side falls back to its policy (recompute or fail).

A request that names a ``kv_destination`` (a decode replica already waiting for it) has its
handoff delivered there by this replica after the export; the result then says so, and the
router does not pass the handoff on. A delivery that fails leaves the handoff to the router.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve

from deployments.engine_replica import EngineReplica, image_inputs, to_step_output
from deployments.kv_transport import KVTransportConfig, make_transport
from deployments.protocol import GenerateRequest, KVTransferInfo, PrefillResult
from neuron_runtime import RequestOutputKind, SamplingParams, tracing
from neuron_runtime.accuracy.online import OnlineValidationConfig

logger = logging.getLogger("ray.serve")


@serve.deployment(
    name="PrefillServer",
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=32,
    health_check_period_s=5,
    health_check_timeout_s=10,
)
class PrefillServer(EngineReplica):
    trace_role = "prefill"

    def __init__(
        self,
        engine_args: dict[str, Any],
        engine_cls: type | None = None,
        stall_timeout_s: float = 30.0,
        kv_transport: KVTransportConfig | None = None,
        tracing_config: dict[str, Any] | None = None,
        accuracy: OnlineValidationConfig | None = None,
        serving_threads_nice: int | None = None,
    ) -> None:
        super().__init__(
            engine_args, engine_cls, stall_timeout_s, tracing_config, accuracy, serving_threads_nice
        )
        self.transport = make_transport(kv_transport or KVTransportConfig())
        self.transport.attach(self.engine.engine, self.engine.abort)
        self.lower_serving_threads()

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Runs the prompt; ValueError (invalid prompt or params) reaches the caller."""
        trace = tracing.EngineTrace(
            "prefill", request.trace_context, {"neuron_serve.replica": self.replica_id}
        )
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        images = await image_inputs(request.images)
        final = None
        async for out in trace.follow(
            self.engine.generate(
                prompt,
                params,
                request.request_id,
                kind=RequestOutputKind.FINAL_ONLY,
                export_kv=True,
                **images,
            ),
            end=False,
        ):
            final = out
        assert final is not None and final.finished
        step = to_step_output(final, with_queue_time=True)
        handoff = final.kv_handoff
        if handoff is None:  # the request ended on its first token
            step.stats = self.stats()
            trace.end()
            return PrefillResult(step, replica_id=self.replica_id)
        start = time.perf_counter()
        try:
            handoff = self.transport.export(handoff)
        except BaseException:
            self.engine.abort(handoff.handoff_id)
            trace.end("the KV export failed")
            raise
        delivered = False
        if request.kv_destination is not None:
            try:
                await self.transport.deliver(handoff, request.kv_destination)
                delivered = True
            except Exception as exc:  # noqa: BLE001 - the router passes the handoff on instead
                logger.warning(
                    "KV of %s not delivered to %s (%r): returning it to the router",
                    request.request_id,
                    request.kv_destination.agent_name,
                    exc,
                )
        step.kv_transfer = KVTransferInfo(
            self.transport.name, "export", handoff.num_kv_bytes, time.perf_counter() - start
        )
        trace.kv("kv.export", step.kv_transfer, start)
        step.stats = self.stats()
        trace.end()
        return PrefillResult(step, handoff, replica_id=self.replica_id, delivered=delivered)

    def stats(self) -> dict[str, Any]:
        """The engine's load, and the handed-off prompts whose blocks are held for decode."""
        return {**super().stats(), "num_kv_handoffs_held": self.transport.num_held()}

    def __del__(self) -> None:
        # Serve calls this on shutdown; __init__ may have failed before the transport existed.
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
