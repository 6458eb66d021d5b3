"""Async streams: merging several as their items come, and the receiving end of step channels."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from deployments.protocol import ChannelRequest, SocketChannel, StepOutput
from deployments.step_channel import FRAME

logger = logging.getLogger("ray.serve")

_END = object()

# A channel the upstream refused (back-pressure, the replica gone) is tried again after this.
CHANNEL_RETRY_S = 1.0


class ChannelLost(RuntimeError):
    """A step channel ended while requests were on it: their replica died or the channel
    broke. The requests' owner may resume them elsewhere (router/migration.py)."""


async def merge(
    iterators: Sequence[AsyncIterator[Any]],
) -> AsyncGenerator[tuple[int, Any], None]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    An exception in any iterator ends the merge with that exception; leaving early cancels
    every pump (and so the streams behind them).
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[Any]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item, None))
            await queue.put((index, _END, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def coalesce(items: AsyncIterator[str], interval_s: float) -> AsyncGenerator[str, None]:
    """The strings of ``items`` joined so that at most one goes out per ``interval_s``.

    A string that comes ``interval_s`` or more after the last one sent goes out at once (the
    first token is never held); one that comes sooner waits until ``interval_s`` after it, and
    whatever else came meanwhile goes out with it. 0 sends every string as it comes. Closing
    the result closes ``items``.
    """
    if interval_s <= 0:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    iterator = aiter(items)
    sent_at = -float("inf")
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            try:
                batch = [await pending]
            except StopAsyncIteration:
                return
            pending = None
            due = sent_at + interval_s
            while loop.time() < due:
                pending = asyncio.ensure_future(anext(iterator))
                done, _ = await asyncio.wait({pending}, timeout=due - loop.time())
                if not done:
                    break  # it stays pending for the next batch
                finished, pending = pending, None
                try:
                    batch.append(finished.result())
                except StopAsyncIteration:
                    yield "".join(batch)
                    return
                except Exception:  # after what came before it
                    yield "".join(batch)
                    raise
            sent_at = loop.time()
            yield "".join(batch)
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()  # the source's own cleanup (the engine streams' cancel) runs now


class StepSubscriber:
    """The receiving end of step channels (deployments/step_channel.py) in one downstream
    replica, demultiplexed into per-request queues.

    ``follow`` turns a submit call whose first step already came into the request's later
    steps, in order, whichever way each came (the submit call or a channel). A channel to an
    upstream replica is opened once ``min_requests`` of this replica's requests run there at
    the same time (below that, a channel saves no messages; None: never) and kept while
    both live: it takes one of the upstream's ongoing-request slots. A request ends with its
    finished step, or with the error its submit call raised, or with the error that ended the
    channel it was on (its replica died).
    """

    def __init__(
        self, handle: Any, name: str, min_requests: int | None = 2, node_id: str | None = None
    ) -> None:
        # A stream=True DeploymentHandle of the upstream deployment.
        self.handle = handle
        self.subscriber = f"{name}:{uuid.uuid4().hex[:12]}"
        self.min_requests = min_requests
        # This replica's Ray node: upstream replicas on it send over a socket (None: never).
        self.node_id = node_id
        self.queues: dict[str, asyncio.Queue] = {}
        self.owners: dict[str, str] = {}  # request id -> the replica serving it
        self.channels: dict[str, asyncio.Task] = {}  # replica id -> its channel's reader
        self.retry_at: dict[str, float] = {}  # replica id -> when to try a refused channel again

    def expect(self, request_id: str) -> None:
        """Before the submit call: later steps may come on an open channel before its first."""
        if request_id in self.queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.queues[request_id] = asyncio.Queue()

    def forget(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.owners.pop(request_id, None)

    def follow(self, request_id: str, first: Any, submit: Any) -> Followed:
        """The steps after ``first`` of the request submitted as ``submit``."""
        queue = self.queues[request_id]
        if first.finished or first.channel is None:
            self.forget(request_id)
            return Followed(self, request_id, first, submit, queue)
        replica = self.owners[request_id] = first.channel
        if self.min_requests is None:
            return Followed(self, request_id, first, submit, queue)
        if replica not in self.channels and time.monotonic() >= self.retry_at.get(replica, 0.0):
            running = sum(1 for owner in self.owners.values() if owner == replica)
            if running >= self.min_requests:
                self.channels[replica] = asyncio.create_task(self._read(replica))
        return Followed(self, request_id, first, submit, queue)

    async def _read(self, replica_id: str) -> None:
        opened = False
        error: BaseException = ChannelLost(f"the step channel of replica {replica_id} ended")
        try:
            request = ChannelRequest(self.subscriber, replica_id, self.node_id)
            channel = self.handle.channel.remote(request)
            async for batch in channel:
                opened = True
                if isinstance(batch, SocketChannel):
                    await self._read_socket(batch, channel)
                    break
                self._deliver(batch)
        except Exception as exc:  # noqa: BLE001 - the replica died, refused or was full
            error = ChannelLost(f"the step channel of replica {replica_id} ended: {exc}")
            error.__cause__ = exc
        finally:
            if self.channels.get(replica_id) is asyncio.current_task():
                del self.channels[replica_id]
        if not opened:
            # Refused (back-pressure, the replica gone): nothing went over it; the requests
            # there go on over their submit calls. Try again later.
            self.retry_at[replica_id] = time.monotonic() + CHANNEL_RETRY_S
            return
        for request_id, owner in list(self.owners.items()):
            if owner == replica_id:
                queue = self.queues.get(request_id)
                self.forget(request_id)
                if queue is not None:
                    queue.put_nowait(error)

    def _deliver(self, batch: list[tuple[str, StepOutput]]) -> None:
        for request_id, step in batch:
            queue = self.queues.get(request_id)
            if queue is not None:  # else aborted here; the engine is dropping it too
                queue.put_nowait(step)

    async def _read_socket(self, offer: SocketChannel, channel: Any) -> None:
        """A channel's batches over its socket (deployments/step_channel.py) until the socket
        or the call ends: either is the channel ending."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", offer.port)
        except OSError:
            # The publisher's loopback is not this process's (another network namespace on
            # the same Ray node): later channels come as the call's messages.
            logger.warning(
                "step channel socket 127.0.0.1:%d refused; using Ray messages", offer.port
            )
            self.node_id = None
            raise
        # The call has no more items; it ends when the publisher's side does.
        call_end = asyncio.ensure_future(anext(aiter(channel), None))
        call_end.add_done_callback(lambda _: writer.close())
        try:
            writer.write(offer.token.encode())
            await writer.drain()
            if await reader.readexactly(len(offer.reply)) != offer.reply.encode():
                raise ConnectionError(f"port {offer.port} is not the step channel offered")
            while True:
                try:
                    size = FRAME.unpack(await reader.readexactly(FRAME.size))[0]
                    data = await reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    break
                self._deliver(pickle.loads(data))
        finally:
            writer.close()
            call_end.cancel()
            await asyncio.wait({call_end})
        error = None if call_end.cancelled() else call_end.exception()
        if error is not None:
            raise error


class Followed:
    """One request's steps after its first (an async iterator, in ``seq`` order), and how to
    abort it."""

    def __init__(
        self, hub: StepSubscriber, request_id: str, first: Any, submit: Any, queue: asyncio.Queue
    ) -> None:
        self.hub = hub
        self.request_id = request_id
        self.submit = submit
        self.queue = queue
        self.done = first.finished
        self.next_seq = None if first.seq is None else first.seq + 1
        # Steps the submit call carries (no channel, or none yet) and its error, if any.
        self.watch = None if self.done else asyncio.create_task(self._watch())

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._steps()

    async def _steps(self) -> AsyncGenerator[Any, None]:
        early: dict[int, Any] = {}  # steps that overtook an earlier one
        while not self.done:
            if self.next_seq is not None and self.next_seq in early:
                item = early.pop(self.next_seq)
            else:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    # A lost channel leaves the submit call (and the request on its replica)
                    # alive: abort it there, since its steps can no longer arrive.
                    self.cancel()
                    raise item
                if self.next_seq is not None and item.seq != self.next_seq:
                    early[item.seq] = item
                    continue
            if self.next_seq is not None:
                self.next_seq += 1
            if item.finished:
                self.done = True
                self.hub.forget(self.request_id)
            yield item

    async def _watch(self) -> None:
        try:
            async for step in self.submit:
                self.queue.put_nowait(step)
        except Exception as exc:  # noqa: BLE001 - the request's own error
            self.queue.put_nowait(exc)

    def cancel(self) -> None:
        """Aborts the request unless it has ended (the client left, a stop string matched)."""
        self.hub.forget(self.request_id)
        if not self.done:
            self.done = True
            self.submit.cancel()
            if self.watch is not None:
                self.watch.cancel()
