"""The decode deployment: the engine in decode role.

It redeems a prefilled request's KV ticket through the configured transport (object store or
gloo, deployments/kv_transport.py), imports the KV (the engine checks the metadata against its
model and the prompt), and continues the request in its running batch, streaming token ids. A
fetch that fails or times out follows ``on_kv_failure``: "recompute" (run the prompt here) or
"fail" (end the request with an error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from ray import serve

from deployments.engine_replica import EngineReplica, image_inputs, to_step_output
from deployments.kv_transport import KVTransportConfig, make_transport
from deployments.protocol import DecodeRequest, KVTransferInfo, StepOutput
from neuron_runtime import RequestOutputKind, SamplingParams
from neuron_runtime.kv_transfer import KVHandoff, KVPayload

logger = logging.getLogger("ray.serve")


class KVFetchError(RuntimeError):
    """The prompt's KV could not be fetched and the policy says fail."""


@serve.deployment(
    name="DecodeServer",
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=64,
    health_check_period_s=5,
    health_check_timeout_s=10,
)
class DecodeServer(EngineReplica):
    def __init__(
        self,
        engine_args: dict[str, Any],
        engine_cls: type | None = None,
        stall_timeout_s: float = 30.0,
        kv_fetch_timeout_s: float = 10.0,
        on_kv_failure: Literal["recompute", "fail"] = "recompute",
        kv_transport: KVTransportConfig | None = None,
    ) -> None:
        super().__init__(engine_args, engine_cls, stall_timeout_s)
        self.kv_fetch_timeout_s = kv_fetch_timeout_s
        self.on_kv_failure = on_kv_failure
        self.transport = make_transport(kv_transport or KVTransportConfig())

    async def generate(self, request: DecodeRequest) -> AsyncIterator[StepOutput]:
        """Streams the request's tokens after ``request.output_token_ids``."""
        payload, transfer = await self._fetch(request)
        handoff = KVHandoff(payload, [request.output_token_ids], [request.generator_state])
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        images = await image_inputs(request.images)
        first = True
        async for out in self.engine.generate(
            prompt,
            params,
            request.request_id,
            kind=RequestOutputKind.DELTA,
            handoff=handoff,
            **images,
        ):
            step = to_step_output(out)
            if first:
                step.kv_transfer, first = transfer, False
            if out.finished:
                step.stats = self.stats()
            yield step

    async def _fetch(self, request: DecodeRequest) -> tuple[KVPayload | None, KVTransferInfo]:
        ticket = request.kv_ticket
        if ticket is None:
            return None, KVTransferInfo("recompute", "import", 0, 0.0)
        start = time.perf_counter()
        try:
            payload = await self.transport.fetch(ticket, self.kv_fetch_timeout_s)
        except Exception as exc:  # noqa: BLE001 - timeout, owner died, payload lost or expired
            seconds = time.perf_counter() - start
            if self.on_kv_failure == "fail":
                raise KVFetchError(f"the prompt's KV could not be fetched: {exc!r}") from exc
            logger.warning("KV fetch for %s failed (%r): recomputing", request.request_id, exc)
            return None, KVTransferInfo(self.transport.name, "import", 0, seconds, failed=True)
        seconds = time.perf_counter() - start
        return payload, KVTransferInfo(self.transport.name, "import", request.num_kv_bytes, seconds)

    def __del__(self) -> None:
        # Serve calls this on shutdown; __init__ may have failed before the transport existed.
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
