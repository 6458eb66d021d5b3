"""The orchestration deployment of disaggregated serving: prefill -> KV handoff -> decode.

It speaks the LLMServer protocol to the ingress (``generate`` streams StepOutputs, plus
``stats`` and ``check_health``), so the ingress does not know whether the engine behind it is
colocated or split. Per request:

    prefill replica (PrefixAffinityRouter)  -> first token, KVHandoff -> streamed at once
    decode replica (KVCapacityRouter)       <- prompt, the same KVHandoff
                                            -> the other tokens      -> streamed

Passing the handoff on, the first token goes to the client before the KV moves, so the
handoff adds to the second token's latency, not to TTFT. With ``decode_first`` (NIXL) the
decode call is opened before the prefill call: the decode replica answers at once with where
to deliver the handoff, the prefill replica delivers it there itself
(deployments/nixl_transport.py) and returns the first token, and the decode replica reads the
KV meanwhile: the handoff never waits for this router. The first token is then held until
the decode replica says the KV is in and its first step starts (``kv_arrived``; at most
``KV_ARRIVAL_WAIT_S``), so the second token follows it by one decode step, as from a
colocated engine: the read adds to TTFT (a few ms against a prefill's hundreds) instead of
stalling the stream after its first token. A decode call that cannot be opened, or a
delivery that fails, falls back to passing the handoff on. A delivery the prefill replica
sent but the decode replica never got (the prefill replica died before its notification
went out) is taken as lost after ``KV_DELIVERY_WAIT_S`` without a word from the decode
call (``kv_arrived``, or ``kv_received`` when the KV is slow to come): the call is closed
and the request resumes on a decode replica, as after a lost one (router/migration.py).

``n > 1`` is split into n single-sequence pipelines (child i gets seed + i, as in the engine)
whose streams are merged.

Tokens after the first travel over step channels (deployments/step_channel.py) on both hops:
from each decode replica to this router, one message per engine step for all of this
router's requests there, and from this router to each ingress replica likewise.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable
from typing import Any, cast

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deployments.protocol import (
    ChannelRequest,
    DecodeRequest,
    GenerateRequest,
    KVDestination,
    PrefillResult,
    StepOutput,
)
from deployments.step_channel import ChannelItem, StepPublisher, this_node
from deployments.thread_priority import lower_priority, thread_ids
from neuron_runtime import tracing
from neuron_runtime.kv_transfer import KVHandoff
from router.encoder_router import EncoderRouter
from router.migration import (
    MAX_MIGRATIONS,
    KVDeliveryLost,
    Migrating,
    is_replica_lost,
    merged,
    raising,
    resume_sampling,
    sequence_sampling,
)
from router.streams import Followed, StepSubscriber

logger = logging.getLogger("ray.serve")

# How long an engine replica's last stats snapshot is kept without a newer one.
STATS_TTL_S = 300.0
# How long ``stats`` waits for the engine replicas' own snapshots (the ingress gives it 2 s).
STATS_TIMEOUT_S = 1.0

# A replica that died or became unreachable mid-call; the request may be retried elsewhere.
REPLICA_LOST = (ActorDiedError, ActorUnavailableError)

# How long a delivered request's first token waits, at most, for its decode replica to say
# the KV is in (a decode engine with a full batch may admit it much later: the token goes
# out then without waiting further).
KV_ARRIVAL_WAIT_S = 0.5

# How long after the prefill returned a delivered handoff the decode call may say nothing
# (it says ``kv_received`` within decode.RECEIPT_QUIET_S of the handoff coming) before the
# delivery is taken as lost.
KV_DELIVERY_WAIT_S = 5.0


@serve.deployment(name="PDRouter", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class PDRouter:
    def __init__(
        self,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        prefill_retries: int = 1,
        encoder: DeploymentHandle | None = None,
        step_channels: bool = True,
        tracing_config: dict[str, Any] | None = None,
        max_migrations: int = MAX_MIGRATIONS,
        decode_first: bool = False,
        serving_threads_nice: int | None = None,
        max_local_prefill_tokens: int = 0,
        max_prefill_queue: int = 0,
        step_channel_sockets: bool = True,
    ) -> None:
        tracing.configure(tracing_config, "router")
        self.prefill = prefill
        # Images go to vision encoder replicas first; without them the prefill replica
        # encodes a request's images itself.
        self.encoder = None if encoder is None else EncoderRouter(encoder)
        self.decode_unary = decode
        self.decode = decode.options(stream=True)
        self.prefill_retries = prefill_retries
        self.replica_stats: dict[str, dict[str, Any]] = {}  # latest snapshot per engine replica
        self.num_kv_refs_held = 0
        self.max_migrations = max_migrations
        self.num_migrations = 0  # requests resumed after their decode replica was lost
        self.decode_first = decode_first
        self.num_handoffs_delivered = 0  # handoffs the prefill replica sent to decode itself
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.num_local_prefills = 0  # requests prefilled by their decode replica
        self.max_prefill_queue = max_prefill_queue
        self.num_prefilling = 0  # this router's requests at prefill replicas now
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except (RuntimeError, RayServeException):  # constructed outside a replica (unit tests)
            self.replica_id = "local"
        self._span_attributes = {"neuron_serve.replica": self.replica_id}
        node = this_node()
        self.publisher = StepPublisher(self.replica_id, node)
        self.decode_steps = StepSubscriber(
            self.decode,
            f"pd:{self.replica_id}",
            min_requests=2 if step_channels else None,
            node_id=node if step_channel_sockets else None,
        )
        # No thread ahead of the engines' (deployments/thread_priority.py).
        lower_priority(thread_ids(), serving_threads_nice)

    async def generate(
        self, request: GenerateRequest, subscriber: str | None = None
    ) -> AsyncIterator[StepOutput]:
        """Streams the request's StepOutputs (with a ``subscriber``, the first only and the
        rest over its step channel); errors propagate like LLMServer's."""
        steps = self._generate(request)
        async for step in self.publisher.publish(subscriber, request.request_id, steps):
            yield step

    async def channel(self, request: ChannelRequest) -> AsyncIterator[ChannelItem]:
        """An ingress replica's step channel (deployments/step_channel.py)."""
        async for batch in self.publisher.channel(request):
            yield batch

    async def _generate(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        encodes = None
        if request.images and self.encoder is not None:
            images, encodes = await self.encoder.encode(request.images, request.trace_context)
            request = dataclasses.replace(request, images=images)
        span = tracing.start_span("pd_router", request.trace_context, self._span_attributes)
        request = dataclasses.replace(request, trace_context=tracing.inject(span))
        n = int(request.sampling.get("n") or 1)
        if n == 1:
            steps = self._pipeline(request)
        else:
            children = {
                i: self._pipeline(
                    GenerateRequest(
                        f"{request.request_id}#{i}",
                        request.prompt_token_ids,
                        sequence_sampling(request.sampling, i),
                        request.images,
                        request.trace_context,
                    )
                )
                for i in range(n)
            }
            steps = merged(children)
        async with contextlib.aclosing(steps), tracing.ending(span):
            async for step in steps:
                if encodes:
                    step.image_encodes, encodes = encodes, None
                yield step

    async def _pipeline(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        """One sequence: prefill, then decode, migrating when a decode replica is lost.

        A request that carries ``resume_token_ids`` resumes after them (its ingress migrated
        it here when the router serving it was lost): it goes straight to a decode replica,
        which recomputes prompt + those tokens, as a migrated decode does. So does a short
        prompt (``max_local_prefill_tokens``), or one that finds ``max_prefill_queue`` of this
        router's requests at the prefill replicas, with no tokens to resume after: its decode
        replica prefills it in its running batch, as a colocated engine would.
        """
        opening: asyncio.Task[AsyncGenerator[StepOutput, None]] | None = None
        waiting: Followed | None = None  # the decode call the prefill replica delivered to
        arrival: _Ahead | None = None  # its next step: kv_arrived (or its error, its end)
        tokens = list(request.resume_token_ids)
        if not tokens and self._prefills_at_decode(request):
            # No prefill call: the decode call below (reopen with no tokens) runs all of it.
            self.num_local_prefills += 1
        elif not tokens:
            self.num_prefilling += 1
            try:
                result, waiting, request = await self._prefill(request)
            finally:
                self.num_prefilling -= 1
            self._note(result.step.stats)
            if result.handoff is None:
                yield result.step
                return  # the request ended on its first token
            if waiting is None:
                decode_request = _decode_request(request, result.handoff)
                # The decode call goes out before the first token is passed on: the decode
                # replica reads the KV while that token travels to the client.
                opening = asyncio.ensure_future(self._open_decode(decode_request))
                # Refs in the ticket (the object store's KV, NIXL's agent info): Ray keeps
                # them alive until the decode call ends.
                del decode_request
            else:
                self.num_handoffs_delivered += 1
            tokens = [t for delta in result.step.seqs for t in delta.token_ids]
            try:
                if waiting is not None:
                    arrival = _Ahead(waiting)
                    await asyncio.wait({arrival.next}, timeout=KV_ARRIVAL_WAIT_S)
                yield result.step
            except BaseException:  # the caller left before or after the first token
                if waiting is not None:
                    if arrival is not None:
                        arrival.drop()
                    waiting.cancel()
                else:
                    assert opening is not None
                    await _close_opening(opening)
                raise
            del result

        # A decode replica lost mid-stream: the request resumes on another one, which
        # recomputes prompt + the tokens passed on so far (no handoff, resume_token_ids).
        async def reopen(resume_tokens: list[int], attempt: int) -> AsyncIterator[StepOutput]:
            suffix = f".m{attempt}" if attempt else ""
            resumed = dataclasses.replace(
                request,
                request_id=f"{request.request_id}{suffix}",
                resume_token_ids=resume_tokens,
                # No token yet (prefilled at decode, or lost before its first): all of it,
                # prompt logprobs included.
                sampling=resume_sampling(request.sampling) if resume_tokens else request.sampling,
            )
            return await self._open_decode(DecodeRequest.whole(resumed))

        self.num_kv_refs_held += 1
        try:
            first_steps: AsyncIterator[StepOutput]
            try:
                if waiting is not None:
                    first_steps = self._followed(None, waiting, arrival)
                elif opening is None:
                    first_steps = await reopen(tokens, 0)
                else:
                    first_steps = await opening
            except Exception as exc:
                if not is_replica_lost(exc):
                    raise
                first_steps = raising(exc)
            migrating = Migrating(
                first_steps,
                reopen,
                max_tokens=request.sampling.get("max_tokens"),
                max_migrations=self.max_migrations,
                on_migrate=self._migrated,
                tokens=tokens,
            )
            async with contextlib.aclosing(migrating.steps()) as steps:
                async for step in steps:
                    yield step
        finally:
            self.num_kv_refs_held -= 1

    async def _open_decode(self, request: DecodeRequest) -> AsyncGenerator[StepOutput, None]:
        """Submits a decode call and waits for its first step; the call's steps."""
        first, rest = await self._submit_decode(request)
        return self._followed(first, rest)

    async def _submit_decode(self, request: DecodeRequest) -> tuple[StepOutput, Followed]:
        """Submits a decode call; its first step, once it has come, and the steps after."""
        steps = self.decode_steps
        steps.expect(request.request_id)
        # A stream=True handle: remote() returns a DeploymentResponseGenerator. It carries the
        # first decode step; the others come over the decode replica's step channel.
        stream = cast(
            DeploymentResponseGenerator,
            self.decode.generate.remote(request, steps.subscriber),
        )
        try:
            first = await anext(stream, None)
        except BaseException:
            steps.forget(request.request_id)
            stream.cancel()
            raise
        if first is None:
            steps.forget(request.request_id)
            stream.cancel()
            raise RuntimeError("the decode replica returned no output")
        return first, steps.follow(request.request_id, first, stream)

    async def _followed(
        self, first: StepOutput | None, rest: Followed, ahead: _Ahead | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        """A decode call's steps: ``first`` (if any), then ``ahead``'s (if any, a
        ``kv_arrived`` step dropped), then the rest."""
        try:
            if first is not None:
                self._note(first.stats)
                yield first
            steps = aiter(rest) if ahead is None else ahead.steps
            if ahead is not None:
                try:
                    step = await ahead.within(KV_DELIVERY_WAIT_S)
                    if step.kv_received:
                        step = await anext(steps)
                except StopAsyncIteration:
                    return
                except KVDeliveryLost:
                    logger.warning(
                        "the KV delivered for %s never reached its decode call: resuming it",
                        rest.request_id,
                    )
                    raise
                if not step.kv_arrived:
                    self._note(step.stats)
                    yield step
            async for step in steps:
                self._note(step.stats)
                yield step
        finally:
            rest.cancel()  # a no-op once the request has ended

    def _prefills_at_decode(self, request: GenerateRequest) -> bool:
        """Whether the request's decode replica prefills it: a prompt without images that is
        short, or that would find ``max_prefill_queue`` of this router's requests already at
        the prefill replicas (Dynamo's conditional disaggregation)."""
        if request.images:
            return False
        if len(request.prompt_token_ids) <= self.max_local_prefill_tokens:
            return True
        return 0 < self.max_prefill_queue <= self.num_prefilling

    def _migrated(self) -> None:
        self.num_migrations += 1

    async def _prefill(
        self, request: GenerateRequest
    ) -> tuple[PrefillResult, Followed | None, GenerateRequest]:
        """One prefill call, retried once on another replica if the replica was lost; the
        request as the attempt that returned sent it (a retry goes under an id of its own,
        ``.r1``...: calls of the lost attempt may still hold the first on a decode replica).

        With ``decode_first`` each attempt first opens a decode call that waits for the
        handoff, and the prefill call names it as the destination; returned with the result
        when the handoff was delivered to it (else closed, and None).
        """
        first_id = request.request_id
        for attempt in range(self.prefill_retries + 1):
            if attempt:
                request = dataclasses.replace(request, request_id=f"{first_id}.r{attempt}")
            waiting = await self._await_handoff(request) if self.decode_first else None
            call = request
            if waiting is not None:
                call = dataclasses.replace(request, kv_destination=waiting[0])
            response = self.prefill.prefill.remote(call)
            try:
                result = await response
            except BaseException as exc:
                if waiting is not None:
                    waiting[1].cancel()
                if isinstance(exc, asyncio.CancelledError):
                    response.cancel()
                if not isinstance(exc, REPLICA_LOST) or attempt == self.prefill_retries:
                    raise
                logger.warning(
                    "prefill replica lost for %s (%r); retrying", request.request_id, exc
                )
                continue
            if waiting is None:
                return result, None, request
            if result.handoff is None or not result.delivered:
                waiting[1].cancel()
                return result, None, request
            return result, waiting[1], request
        raise AssertionError("unreachable")

    async def _await_handoff(
        self, request: GenerateRequest
    ) -> tuple[KVDestination, Followed] | None:
        """A decode call opened before the prefill, waiting for its handoff: where the prefill
        replica is to deliver it, and the call's steps. None when it cannot be opened (the
        handoff then comes through here)."""
        decode_request = _decode_request(request, await_handoff=True)
        try:
            ready, rest = await self._submit_decode(decode_request)
        except Exception as exc:  # noqa: BLE001 - a decode replica lost or refusing
            logger.warning(
                "no decode call opened before the prefill of %s (%r): passing the handoff on",
                request.request_id,
                exc,
            )
            return None
        if ready.kv_destination is None:
            rest.cancel()
            return None
        return ready.kv_destination, rest

    def _note(self, stats: dict[str, Any] | None) -> None:
        if not stats:
            return
        now = time.time()
        self.replica_stats[str(stats.get("replica_id"))] = {**stats, "seen_at": now}
        # Replicas replaced or scaled away stop reporting: forget them after a while.
        for replica_id, seen in list(self.replica_stats.items()):
            if now - seen["seen_at"] > STATS_TTL_S:
                del self.replica_stats[replica_id]

    async def stats(self) -> list[dict[str, Any]]:
        """The load snapshot of every prefill and decode replica, taken now (one call to each,
        at once), and this router's own (``own_stats``).

        Steps carry snapshots only when a request ends, so one seen on a stream is stale once
        requests were aborted or went over another router; a replica that does not answer
        within STATS_TIMEOUT_S keeps the last one seen (for STATS_TTL_S)."""
        calls = [
            handle.broadcast("stats").results_async(
                timeout_s=STATS_TIMEOUT_S, return_exceptions=True
            )
            for handle in (self.prefill, self.decode_unary)
        ]
        for answers in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(answers, BaseException):  # none answered in time
                continue
            for answer in answers:
                if isinstance(answer, dict):
                    self._note(answer)
        return [*self.replica_stats.values(), self.own_stats()]

    def own_stats(self) -> dict[str, Any]:
        """This router's counters: KV tickets held, migrations, handoffs, local prefills."""
        return {
            "replica_id": f"router:{self.replica_id}",
            "num_kv_refs_held": self.num_kv_refs_held,
            "num_migrations": self.num_migrations,
            "num_handoffs_delivered": self.num_handoffs_delivered,
            "num_local_prefills": self.num_local_prefills,
            "num_prefilling": self.num_prefilling,
        }

    async def check_health(self) -> None:
        """Healthy when a prefill and a decode replica (and an encoder) answer their probe."""
        probes: list[Awaitable[Any]] = [
            self.prefill.check_health.remote(),
            self.decode.options(stream=False).check_health.remote(),
        ]
        if self.encoder is not None:
            probes.append(self.encoder.check_health())
        await asyncio.gather(*probes)


def _decode_request(
    request: GenerateRequest, handoff: KVHandoff | None = None, await_handoff: bool = False
) -> DecodeRequest:
    """The decode call of ``request``. The prompt's logprobs come with the prefill output:
    decode does not redo them."""
    return DecodeRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=resume_sampling(request.sampling),
        handoff=handoff,
        images=request.images,
        trace_context=request.trace_context,
        await_handoff=await_handoff,
    )


class _Ahead:
    """A stream's next item, already asked for (``next``) when the stream was taken, and
    the stream after it."""

    def __init__(self, stream: AsyncIterable[StepOutput]) -> None:
        self.steps = aiter(stream)
        self.next: asyncio.Future[StepOutput] = asyncio.ensure_future(anext(self.steps))
        self.since = time.monotonic()

    async def within(self, seconds: float) -> StepOutput:
        """The next item, if it comes within ``seconds`` of the stream being taken; else
        KVDeliveryLost (the item is dropped)."""
        left = self.since + seconds - time.monotonic()
        done, _ = await asyncio.wait({self.next}, timeout=max(0.0, left))
        if not done:
            self.drop()
            raise KVDeliveryLost(f"the decode call said nothing for {seconds} s after delivery")
        return self.next.result()

    def drop(self) -> None:
        """Nobody will take the item: stop asking, or mark its error as seen."""
        if not self.next.done():
            self.next.cancel()
        elif not self.next.cancelled():
            self.next.exception()


async def _close_opening(opening: asyncio.Task[AsyncGenerator[StepOutput, None]]) -> None:
    """Ends a decode call opened for a caller that left: cancelled while it waits for its
    first step (``_open_decode`` then cancels the call), or its steps closed once it has one."""
    if not opening.done():
        opening.cancel()
        with contextlib.suppress(BaseException):
            await opening
        return
    if opening.cancelled() or opening.exception() is not None:
        return
    steps = opening.result()
    with contextlib.suppress(Exception):
        await anext(steps)  # enters the generator: closing it then ends the call's stream
    await steps.aclose()
