"""Step channels, the publishing end: one Ray message per engine step per downstream.

A downstream deployment (the ingress, the PD router) submits each request as its own routed
streaming call, which carries the request's first StepOutput. While that downstream holds a
step channel on this replica (one long-lived ``channel`` call, pinned here by the request
routers), every later step of its requests goes into its outbox instead, and the channel
carries everything the outbox holds each time it wakes: every new token of every request
that downstream owns here, in one message. Without a channel the steps come on the submit
call as before. Steps carry their index in the request (``seq``), so the downstream puts them
back in order whichever way they came (router/streams.py, the receiving end).

The submit call stays open until its request ends, so Serve's ongoing-request limits,
back-pressure and cancellation (the client gone, a stop string: the downstream cancels it and
the engine aborts the request) work as for a plain stream; an exception ends the submit call
with it. A channel takes one of the replica's ``max_ongoing_requests`` slots for as long as
its downstream lives.

    downstream                              engine replica (or PD router) R
    generate.remote(req, subscriber) -----> first StepOutput (channel=R) on the call; later
                                            steps -> outbox[subscriber] while a channel is
                                            open, else on the call
    channel.remote(ChannelRequest(          <- [] once open, then [(req_id, StepOutput), ...]
        subscriber, R)) (long-lived)           per wake-up
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from deployments.protocol import ChannelRequest, StepOutput


class _Outbox:
    def __init__(self) -> None:
        self.items: list[tuple[str, StepOutput]] = []
        self.ready = asyncio.Event()

    def put(self, request_id: str, step: StepOutput) -> None:
        self.items.append((request_id, step))
        self.ready.set()

    async def take(self) -> list[tuple[str, StepOutput]]:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        items, self.items = self.items, []
        return items


class StepPublisher:
    """One replica's outboxes, one per subscriber (a downstream replica) holding a channel."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.outboxes: dict[str, _Outbox] = {}

    async def publish(
        self, subscriber: str | None, request_id: str, steps: AsyncGenerator[StepOutput, None]
    ) -> AsyncIterator[StepOutput]:
        """A submit call's stream: the first step, then each later one either into the
        subscriber's outbox (while it has a channel open here) or on this stream."""
        async with contextlib.aclosing(steps):
            seq = 0
            async for step in steps:
                if subscriber is not None:
                    # (A PD router passes on steps that came over a decode replica's channel.)
                    step.seq = seq
                    step.channel = self.replica_id if seq == 0 and not step.finished else None
                    outbox = self.outboxes.get(subscriber) if seq else None
                    seq += 1
                    if outbox is not None:
                        outbox.put(request_id, step)
                        continue
                yield step

    async def channel(self, request: ChannelRequest) -> AsyncIterator[list[tuple[str, StepOutput]]]:
        """An empty batch once open, then the subscriber's outbox each time it fills, until
        the caller leaves; steps still in the outbox then are dropped (the subscriber ends
        the requests it had on a channel that ended)."""
        if request.replica_id != self.replica_id:
            # The pinned replica is gone and the router sent this elsewhere.
            raise ChannelMismatchError(
                f"step channel for replica {request.replica_id} reached {self.replica_id}"
            )
        if request.subscriber in self.outboxes:
            raise RuntimeError(f"{request.subscriber} already has a step channel here")
        outbox = self.outboxes[request.subscriber] = _Outbox()
        try:
            yield []
            while True:
                yield await outbox.take()
        finally:
            if self.outboxes.get(request.subscriber) is outbox:
                del self.outboxes[request.subscriber]

    def num_pending(self) -> int:
        """Steps waiting in outboxes (tests: zero once every request was read)."""
        return sum(len(outbox.items) for outbox in self.outboxes.values())


class ChannelMismatchError(RuntimeError):
    """A step channel reached a replica other than the one it was opened for."""
