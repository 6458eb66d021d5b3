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

A subscriber on the publisher's own Ray node (``ChannelRequest.node_id``) gets the batches
over a TCP socket on 127.0.0.1 instead: the call's one item is a SocketChannel (a port and a
one-time token each way), the subscriber connects and sends its token, the publisher answers
with its own, and each batch is a frame on the socket while the call stays open. A Ray
message wakes several threads of both processes (receiving one at an engine step's pace
costs each side about 1.4 ms of CPU against 0.3 ms over a socket: bench/step_transport.py),
and on a small host that CPU comes out of the engine's kernel threads. Either end closing or
dying ends both the socket and the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import secrets
import struct
from collections.abc import AsyncGenerator, AsyncIterator

import ray

from deployments.protocol import ChannelRequest, SocketChannel, StepOutput

# A socket channel's frame header: the pickled batch's length.
FRAME = struct.Struct("!I")
# How long a socket channel's publisher waits for its subscriber to connect and send its token.
SOCKET_CONNECT_TIMEOUT_S = 10.0


# What a channel call yields: a batch of (request id, step), or the socket that carries them.
ChannelItem = list[tuple[str, StepOutput]] | SocketChannel


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


def this_node() -> str | None:
    """The Ray node this process runs on; None outside Ray (unit tests, the offline engine)."""
    if not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


class StepPublisher:
    """One replica's outboxes, one per subscriber (a downstream replica) holding a channel."""

    def __init__(self, replica_id: str, node_id: str | None = None) -> None:
        self.replica_id = replica_id
        self.node_id = node_id  # this replica's Ray node; None: no socket channels
        self.outboxes: dict[str, _Outbox] = {}
        self.num_opened = {"messages": 0, "socket": 0}  # channels opened, by transport

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

    async def channel(self, request: ChannelRequest) -> AsyncIterator[ChannelItem]:
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
            if self.node_id is not None and request.node_id == self.node_id:
                self.num_opened["socket"] += 1
                async for offer in _over_socket(outbox):
                    yield offer
                return
            self.num_opened["messages"] += 1
            yield []
            while True:
                yield await outbox.take()
        finally:
            if self.outboxes.get(request.subscriber) is outbox:
                del self.outboxes[request.subscriber]

    def num_pending(self) -> int:
        """Steps waiting in outboxes (tests: zero once every request was read)."""
        return sum(len(outbox.items) for outbox in self.outboxes.values())


async def _over_socket(outbox: _Outbox) -> AsyncIterator[SocketChannel]:
    """Offers a socket on 127.0.0.1 (the one item), then writes the outbox to the subscriber
    that connected with the token until it closes the socket or the call ends."""
    token, reply = secrets.token_hex(16), secrets.token_hex(16)
    connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    connected = asyncio.get_running_loop().create_future()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            got = await asyncio.wait_for(reader.readexactly(len(token)), SOCKET_CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            got = b""
        if got != token.encode() or connected.done():
            writer.close()
            return
        writer.write(reply.encode())
        connected.set_result((reader, writer))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    writer: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task] = []
    try:
        yield SocketChannel(server.sockets[0].getsockname()[1], token, reply)
        reader, subscriber = await asyncio.wait_for(connected, SOCKET_CONNECT_TIMEOUT_S)
        writer = subscriber
        server.close()  # one subscriber
        tasks = [asyncio.create_task(_send(outbox, subscriber)), asyncio.create_task(reader.read())]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:  # the subscriber gone (EOF, a failed send) ends the call quietly
            error = None if task.cancelled() else task.exception()
            if error is not None and not isinstance(error, OSError):
                raise error
    finally:
        for task in tasks:
            task.cancel()
        server.close()
        if writer is not None:
            writer.close()


async def _send(outbox: _Outbox, writer: asyncio.StreamWriter) -> None:
    while True:
        data = pickle.dumps(await outbox.take(), protocol=pickle.HIGHEST_PROTOCOL)
        writer.write(FRAME.pack(len(data)) + data)
        await writer.drain()


class ChannelMismatchError(RuntimeError):
    """A step channel reached a replica other than the one it was opened for."""
