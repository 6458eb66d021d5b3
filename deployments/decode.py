"""The decode deployment: the engine in decode role.

It turns a prefilled request's handoff into what its engine imports, through the configured
transport (deployments/kv_transport.py): a block read (NIXL: the engine allocates the prompt's
blocks and reads the prefill blocks straight into them before the request runs) or a payload
(the object store, or NIXL between caches of unequal layouts). The engine checks the metadata
against its model and the prompt, then continues the request in its running batch, streaming
token ids. A transfer that fails or times out follows ``on_kv_failure``: "recompute" (run the
prompt here) or "fail" (end the request with an error).

A call opened before its prefill (``DecodeRequest.await_handoff``, NIXL) first streams where
the prefill replica is to deliver the handoff, then waits for it (``kv_delivery_timeout_s``
at most: the prompt's prefill, queueing included, runs meanwhile) and goes on as above, with
one more step before its tokens: ``kv_arrived``, as soon as the blocks are in and the
engine's first step for the request starts (at once for a payload or a recompute). The
router holds the first token until then, so the client sees the second one step after it,
as from a colocated engine; the read's time goes to the first token instead, as when a
decode engine produces the first token itself (vLLM's and Dynamo's PD). When ``kv_arrived``
is slow to come (``RECEIPT_QUIET_S`` after the handoff came: a full batch), a
``kv_received`` step goes before it: the router, which takes a delivery that says nothing
for long as lost with its prefill replica, then knows this one is here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from ray import serve

from deployments.engine_replica import EngineReplica, image_inputs, to_step_output
from deployments.kv_transport import KVTransportConfig, make_transport
from deployments.protocol import DecodeRequest, KVTransferInfo, StepOutput
from neuron_runtime import RequestOutput, RequestOutputKind, SamplingParams, tracing
from neuron_runtime.kv_transfer import KVBlockSource, KVHandoff, KVMetadata, KVPayload

logger = logging.getLogger("ray.serve")

# How long after a delivered handoff came its ``kv_arrived`` step may take before a
# ``kv_received`` step goes out first (well under the router's KV_DELIVERY_WAIT_S).
RECEIPT_QUIET_S = 0.25


class _Mark(enum.Enum):
    """What ``_announcing`` puts among a delivered request's outputs."""

    RECEIVED = "kv_received"
    ARRIVED = "kv_arrived"


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
    trace_role = "decode"

    def __init__(
        self,
        engine_args: dict[str, Any],
        engine_cls: type | None = None,
        stall_timeout_s: float = 30.0,
        kv_fetch_timeout_s: float = 10.0,
        on_kv_failure: Literal["recompute", "fail"] = "recompute",
        kv_transport: KVTransportConfig | None = None,
        tracing_config: dict[str, Any] | None = None,
        kv_delivery_timeout_s: float = 600.0,
        serving_threads_nice: int | None = None,
    ) -> None:
        super().__init__(
            engine_args,
            engine_cls,
            stall_timeout_s,
            tracing_config,
            serving_threads_nice=serving_threads_nice,
        )
        self.kv_fetch_timeout_s = kv_fetch_timeout_s
        self.kv_delivery_timeout_s = kv_delivery_timeout_s
        self.on_kv_failure = on_kv_failure
        self.transport = make_transport(kv_transport or KVTransportConfig())
        self.transport.attach(self.engine.engine, self.engine.abort)
        self.lower_serving_threads()

    async def generate(
        self, request: DecodeRequest, subscriber: str | None = None
    ) -> AsyncIterator[StepOutput]:
        """Streams the request's tokens after ``request.handoff.output_token_ids``; with a
        ``subscriber`` only the first step, the rest going over its step channel."""
        steps = self._steps(request)
        async for step in self.publisher.publish(subscriber, request.request_id, steps):
            yield step

    async def _steps(self, request: DecodeRequest) -> AsyncGenerator[StepOutput, None]:
        delivered = request.await_handoff
        received_at = 0.0
        if request.await_handoff:
            key = f"{request.request_id}@{uuid.uuid4().hex[:12]}"
            destination = self.transport.expect(key)
            try:
                yield StepOutput([], len(request.prompt_token_ids), kv_destination=destination)
                handoff = await self.transport.wait(key, self.kv_delivery_timeout_s)
            except TimeoutError as exc:
                raise KVFetchError(
                    f"no prefill replica delivered the prompt's KV within "
                    f"{self.kv_delivery_timeout_s} s"
                ) from exc
            finally:
                self.transport.forget(key)
            received_at = time.monotonic()
            request = dataclasses.replace(request, handoff=handoff, await_handoff=False)
        start = time.perf_counter()
        kv, transfer = await self._receive(request)
        attributes = {"neuron_serve.replica": self.replica_id}
        trace = tracing.EngineTrace("decode", request.trace_context, attributes, start)
        continued = self._handoff(request)
        if continued is not None:
            continued = dataclasses.replace(continued, kv=kv)
        params = SamplingParams(**request.sampling)
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        images = await image_inputs(request.images)
        outputs = trace.follow(
            self.engine.generate(
                prompt,
                params,
                request.request_id,
                kind=RequestOutputKind.DELTA,
                handoff=continued,
                **images,
            )
        )
        if delivered:
            quiet_until = received_at + RECEIPT_QUIET_S
            outputs = _announcing(outputs, self._arrival(kv), quiet_until)
        first = True
        try:
            async for out in outputs:
                if isinstance(out, _Mark):
                    arrived = out is _Mark.ARRIVED
                    num_prompt = len(request.prompt_token_ids)
                    yield StepOutput([], num_prompt, kv_arrived=arrived, kv_received=not arrived)
                    continue
                step = to_step_output(out)
                if first and continued is not None:  # none moved for a prompt prefilled here
                    first = False
                    if isinstance(kv, KVBlockSource):
                        transfer = self._read_info(request.request_id, kv, start)
                        if transfer.failed and self.on_kv_failure == "fail":
                            raise KVFetchError(f"the prompt's KV could not be read: {step.error}")
                    step.kv_transfer = transfer
                    trace.kv("kv.transfer", transfer, start)
                if out.finished:
                    step.stats = self.stats()
                yield step
        finally:
            if isinstance(kv, KVBlockSource):
                kv.abandon()

    @staticmethod
    def _arrival(kv: KVPayload | KVBlockSource | None) -> asyncio.Future[None]:
        """Resolves when the request's first step here starts: a block read's blocks are in
        (the engine's thread says so); a payload or a recompute has nothing to wait for."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Future[None] = loop.create_future()
        if not isinstance(kv, KVBlockSource):
            arrived.set_result(None)
            return arrived

        def resolve() -> None:
            if not arrived.done():
                arrived.set_result(None)

        def notify() -> None:  # on the engine's thread
            loop.call_soon_threadsafe(resolve)

        kv.on_first_step = notify
        return arrived

    def _handoff(self, request: DecodeRequest) -> KVHandoff | None:
        """The request's handoff; a migrated request (router/migration.py) goes on after the
        tokens it already produced: a handoff without KV, so the engine recomputes them. None
        for a request with no tokens yet (a short prompt the router sent here to prefill):
        the engine runs it whole, as a colocated one does."""
        if request.handoff is not None:
            return request.handoff
        if not request.resume_token_ids:
            return None
        model = self.engine.engine.config.model
        metadata = KVMetadata.describe(model, request.prompt_token_ids)
        return KVHandoff(metadata, list(request.resume_token_ids))

    async def _receive(
        self, request: DecodeRequest
    ) -> tuple[KVPayload | KVBlockSource | None, KVTransferInfo]:
        handoff = request.handoff
        if handoff is None or handoff.ticket is None:
            return None, KVTransferInfo("recompute", "import", 0, 0.0)
        start = time.perf_counter()
        try:
            kv = await self.transport.receive(handoff, self.kv_fetch_timeout_s)
        except Exception as exc:  # noqa: BLE001 - timeout, owner died, KV lost or expired
            seconds = time.perf_counter() - start
            if self.on_kv_failure == "fail":
                raise KVFetchError(f"the prompt's KV could not be fetched: {exc!r}") from exc
            logger.warning("KV fetch for %s failed (%r): recomputing", request.request_id, exc)
            return None, KVTransferInfo(self.transport.name, "import", 0, seconds, failed=True)
        seconds = time.perf_counter() - start
        if isinstance(kv, KVBlockSource):
            kv.recompute_on_failure = self.on_kv_failure == "recompute"
            # Filled in once the engine has read the blocks (_read_info).
            return kv, KVTransferInfo(self.transport.name, "import", 0, seconds)
        # A payload: the object store's array, or NIXL's tokens between unequal layouts.
        name = self.transport.name if self.transport.name == "object_store" else "nixl_tokens"
        return kv, KVTransferInfo(name, "import", handoff.num_kv_bytes, seconds)

    def _read_info(self, request_id: str, read: KVBlockSource, start: float) -> KVTransferInfo:
        """How a block read went, once the request produced its first output here."""
        if read.done_at is None:
            seconds = time.perf_counter() - start
            logger.warning("KV read for %s failed: %s", request_id, read.error)
            return KVTransferInfo(self.transport.name, "import", 0, seconds, failed=True)
        return KVTransferInfo(self.transport.name, "import", read.num_bytes, read.done_at - start)

    def __del__(self) -> None:
        # Serve calls this on shutdown; __init__ may have failed before the transport existed.
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()


async def _announcing(
    outputs: AsyncIterator[RequestOutput], arrived: asyncio.Future[None], quiet_until: float
) -> AsyncGenerator[RequestOutput | _Mark, None]:
    """``outputs`` after ``_Mark.ARRIVED``, which comes once ``arrived`` resolves or the
    first output is there, whichever is first (a read that failed ends in an output); a
    ``_Mark.RECEIVED`` before it if neither came by ``quiet_until`` (monotonic). Closing this
    closes ``outputs``."""
    iterator = aiter(outputs)
    ahead = asyncio.ensure_future(anext(iterator))
    try:
        either: set[asyncio.Future[Any]] = {ahead, arrived}
        quiet_s = max(0.0, quiet_until - time.monotonic())
        done, _ = await asyncio.wait(either, timeout=quiet_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            yield _Mark.RECEIVED
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        yield _Mark.ARRIVED
        try:
            out = await ahead
        except StopAsyncIteration:
            return
        yield out
        async for out in iterator:
            yield out
    finally:
        if not ahead.done():
            ahead.cancel()
            await asyncio.wait({ahead})
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
