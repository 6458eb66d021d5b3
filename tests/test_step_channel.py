"""Step channels without Ray: deployments/step_channel.py (publisher) and router/streams.py
(subscriber), joined by a stand-in for Serve's streaming handle.

Each request of a fake engine emits a known token sequence, one per engine step. Checked
against those sequences: every request gets exactly its tokens in order; once two requests
run on the replica a channel opens and the later steps come over it, one message per step
for all requests; with one request at a time no channel opens and the steps come on the
submit calls; a cancelled request stops its generator (the engine abort); an error raised
after the first step ends only that request; a channel that ends (its replica died) ends
every request on it with an error; afterwards no request is remembered.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncGenerator

import pytest

from deployments.protocol import ChannelRequest, SeqDelta, SocketChannel, StepOutput
from deployments.step_channel import FRAME, ChannelMismatchError, StepPublisher
from router.streams import StepSubscriber


class FakeEngine:
    """Request i emits tokens [i*100, i*100+1, ...] of its length, one per engine step."""

    def __init__(self) -> None:
        self.step_no = 0
        self.waiters: list[asyncio.Future] = []
        self.aborted: list[str] = []
        self.live: set[str] = set()

    async def steps(self, request_id: str, length: int, fail_at: int | None):  # noqa: ANN201
        base = int(request_id.split("-")[1]) * 100
        start = self.step_no
        self.live.add(request_id)
        finished = False
        try:
            for k in range(length):
                while self.step_no < start + k:
                    waiter = asyncio.get_running_loop().create_future()
                    self.waiters.append(waiter)
                    await waiter
                if k == fail_at:
                    raise RuntimeError(f"engine step failed for {request_id}")
                finished = k == length - 1
                yield StepOutput([SeqDelta(0, [base + k])], num_prompt_tokens=3, finished=finished)
        finally:
            self.live.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    def advance(self) -> None:
        self.step_no += 1
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class Call:
    """A DeploymentResponseGenerator stand-in: iterates a generator in its own task, as the
    replica runs it apart from the caller; cancel() cancels that task."""

    def __init__(self, gen: AsyncGenerator) -> None:  # noqa: ANN401
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run(gen))

    async def _run(self, gen: AsyncGenerator) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for item in gen:
                    await self.queue.put(("item", item))
            await self.queue.put(("end", None))
        except asyncio.CancelledError:  # Serve: the caller sees the call end with an error
            self.queue.put_nowait(("error", RuntimeError("the call was cancelled")))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            await self.queue.put(("error", exc))

    def __aiter__(self):  # noqa: ANN204
        return self

    async def __anext__(self):  # noqa: ANN204
        kind, value = await self.queue.get()
        if kind == "end":
            raise StopAsyncIteration
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        self.task.cancel()


class FakeHandle:
    """``handle.generate.remote(request, subscriber)`` and ``handle.channel.remote(req)``."""

    def __init__(self, publisher: StepPublisher, engine: FakeEngine) -> None:
        self.publisher, self.engine = publisher, engine
        self.channel_messages: list[list] = []
        self.channels: list[Call] = []
        handle = self

        class Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args):  # noqa: ANN002, ANN202
                return handle._call(self.name, *args)

        self.generate, self.channel = Method("generate"), Method("channel")

    def _call(self, name: str, *args) -> Call:  # noqa: ANN002
        if name == "generate":
            (request_id, length, fail_at), subscriber = args
            steps = self.engine.steps(request_id, length, fail_at)
            return Call(self.publisher.publish(subscriber, request_id, steps))
        call = Call(self._recording(self.publisher.channel(args[0])))
        self.channels.append(call)
        return call

    async def _recording(self, gen: AsyncGenerator) -> AsyncGenerator:
        async for batch in gen:
            self.channel_messages.append(batch)
            yield batch


async def open_request(
    hub: StepSubscriber,
    handle: FakeHandle,
    request_id: str,
    length: int,
    fail_at: int | None = None,
):  # noqa: ANN201
    hub.expect(request_id)
    submit = handle.generate.remote((request_id, length, fail_at), hub.subscriber)
    first = await anext(submit)
    return first, hub.follow(request_id, first, submit)


async def collect(first: StepOutput, rest, stop_after: int | None = None) -> list[int]:  # noqa: ANN001
    tokens = list(first.seqs[0].token_ids)
    async for step in rest:
        tokens += step.seqs[0].token_ids
        if stop_after is not None and len(tokens) >= stop_after:
            break
    return tokens


async def run_steps(engine: FakeEngine, until) -> None:  # noqa: ANN001
    """Runs engine steps one at a time (every live request advances together) until done."""
    for _ in range(1000):
        if until():
            return
        engine.advance()
        for _ in range(50):  # let every task of this step run
            await asyncio.sleep(0)
    raise AssertionError("not done after 1000 steps")


@pytest.fixture(params=["messages", "socket"])
def transport(request) -> str:
    """How a channel's batches travel: the call's messages, or (subscriber and publisher on
    one node) a socket on 127.0.0.1."""
    return request.param


def make(
    transport: str, min_requests: int = 2
) -> tuple[FakeEngine, StepPublisher, FakeHandle, StepSubscriber]:
    engine = FakeEngine()
    node = "node-1" if transport == "socket" else None
    publisher = StepPublisher("replica-A", node_id=node)
    handle = FakeHandle(publisher, engine)
    hub = StepSubscriber(handle, "ingress", min_requests, node_id=node)
    # What the subscriber received, one entry per message, whichever way it came.
    hub.received = []  # type: ignore[attr-defined]
    deliver = hub._deliver

    def recording(batch: list) -> None:
        hub.received.append(batch)  # type: ignore[attr-defined]
        deliver(batch)

    hub._deliver = recording  # type: ignore[method-assign]
    return engine, publisher, handle, hub


async def channel_open(publisher: StepPublisher, hub: StepSubscriber) -> None:
    for _ in range(100):
        if hub.subscriber in publisher.outboxes:
            return
        await asyncio.sleep(0)
    raise AssertionError("the channel did not open")


def test_every_request_gets_its_tokens_in_one_message_per_step(transport):
    async def main() -> None:
        engine, publisher, handle, hub = make(transport)
        lengths = {f"r-{i}": 5 + i for i in range(1, 7)}
        opened = [await open_request(hub, handle, rid, n) for rid, n in lengths.items()]
        assert all(first.channel == "replica-A" for first, _ in opened)
        await channel_open(publisher, hub)
        readers = [asyncio.create_task(collect(first, rest)) for first, rest in opened]
        await run_steps(engine, lambda: all(r.done() for r in readers))
        for (rid, n), reader in zip(lengths.items(), readers, strict=True):
            base = int(rid.split("-")[1]) * 100
            assert reader.result() == list(range(base, base + n))
        # One channel for the subscriber, one message per engine step with every live
        # request's new token (the steps after the first: max length - 1 of them).
        assert len(handle.channels) == 1
        batches = [batch for batch in hub.received if batch]
        assert len(batches) == max(lengths.values()) - 1
        # Over a socket the call itself carries only the offer.
        if transport == "socket":
            assert [type(m).__name__ for m in handle.channel_messages] == ["SocketChannel"]
        assert len(batches[0]) == len(lengths)
        assert not hub.queues and not hub.owners and publisher.num_pending() == 0
        assert not engine.aborted
        for call in handle.channels:
            call.cancel()

    asyncio.run(main())


def test_without_a_channel_the_steps_come_on_the_submit_calls(transport):
    async def main() -> None:
        engine, publisher, handle, hub = make(transport, min_requests=100)
        opened = [await open_request(hub, handle, f"r-{i}", 6) for i in (1, 2, 3)]
        readers = [asyncio.create_task(collect(first, rest)) for first, rest in opened]
        await run_steps(engine, lambda: all(r.done() for r in readers))
        assert [r.result() for r in readers] == [list(range(b, b + 6)) for b in (100, 200, 300)]
        assert not handle.channels and not hub.queues and not engine.aborted

    asyncio.run(main())


def test_cancel_aborts_only_that_request_and_errors_end_only_theirs(transport):
    async def main() -> None:
        engine, publisher, handle, hub = make(transport)
        kept = await open_request(hub, handle, "r-1", 8)
        left = await open_request(hub, handle, "r-2", 50)
        failing = await open_request(hub, handle, "r-3", 8, fail_at=3)
        await channel_open(publisher, hub)
        reader = asyncio.create_task(collect(*kept))
        leaver = asyncio.create_task(collect(*left, stop_after=3))
        failer = asyncio.create_task(collect(*failing))
        await run_steps(engine, lambda: reader.done() and leaver.done() and failer.done())
        assert reader.result() == list(range(100, 108))
        assert leaver.result() == [200, 201, 202]
        left[1].cancel()  # what Generation.events does when the client leaves
        await run_steps(engine, lambda: "r-2" not in engine.live)
        assert engine.aborted == ["r-3", "r-2"] or engine.aborted == ["r-2", "r-3"]
        with pytest.raises(RuntimeError, match="engine step failed for r-3"):
            failer.result()
        assert not hub.queues and not hub.owners and publisher.num_pending() == 0

    asyncio.run(main())


def test_a_channel_that_ends_ends_every_request_on_it_with_an_error(transport):
    async def main() -> None:
        engine, publisher, handle, hub = make(transport)
        opened = [await open_request(hub, handle, f"r-{i}", 40) for i in (1, 2)]
        await channel_open(publisher, hub)
        readers = [asyncio.create_task(collect(first, rest)) for first, rest in opened]
        await run_steps(engine, lambda: len(hub.received) >= 3)
        handle.channels[0].cancel()  # the replica went away mid-stream
        await run_steps(engine, lambda: all(r.done() for r in readers))
        for reader in readers:
            # The call's own error, passed on; over a socket the socket's end may come first.
            with pytest.raises(RuntimeError, match="the call was cancelled|channel .* ended"):
                reader.result()
        assert not hub.queues and not hub.owners and not hub.channels
        # The submit calls outlive a lost channel: each request is aborted on the replica
        # (a migrated copy must not run beside it).
        await run_steps(engine, lambda: not engine.live)
        assert sorted(engine.aborted) == ["r-1", "r-2"]

    asyncio.run(main())


def test_a_channel_reaching_another_replica_is_refused():
    async def main() -> None:
        channel = StepPublisher("replica-B").channel(ChannelRequest("ingress:x", "replica-A"))
        with pytest.raises(ChannelMismatchError):
            await anext(channel)

    asyncio.run(main())


def test_a_socket_channel_takes_only_the_subscriber_with_its_token():
    """The offer's port refuses a connection without the token (another local process) and
    still serves the subscriber; a subscriber on another node gets the call's messages."""

    async def main() -> None:
        publisher = StepPublisher("replica-A", node_id="node-1")
        other_node = publisher.channel(ChannelRequest("ingress:far", "replica-A", "node-2"))
        assert await anext(other_node) == []
        await other_node.aclose()

        channel = publisher.channel(ChannelRequest("ingress:x", "replica-A", "node-1"))
        offer = await anext(channel)
        assert isinstance(offer, SocketChannel)
        serving = asyncio.ensure_future(anext(channel, None))  # the publisher's side runs
        stranger_reader, stranger = await asyncio.open_connection("127.0.0.1", offer.port)
        stranger.write(b"0" * len(offer.token))
        assert await stranger_reader.read() == b""  # closed on it, nothing sent
        stranger.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", offer.port)
        writer.write(offer.token.encode())
        assert await reader.readexactly(len(offer.reply)) == offer.reply.encode()
        step = StepOutput([SeqDelta(0, [7])], num_prompt_tokens=3)
        publisher.outboxes["ingress:x"].put("r-1", step)
        size = FRAME.unpack(await reader.readexactly(FRAME.size))[0]
        assert pickle.loads(await reader.readexactly(size)) == [("r-1", step)]
        writer.close()  # the subscriber leaves: the call ends, the outbox goes
        assert await asyncio.wait_for(serving, 5) is None
        assert not publisher.outboxes

    asyncio.run(main())


def test_a_subscriber_reads_nothing_from_a_port_that_does_not_answer_its_reply():
    """Whatever holds the offered port must answer the offer's reply token before any frame
    is unpickled (a port freed and taken by another process)."""

    async def main() -> None:
        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(32)
            writer.write(b"0" * 32)  # not the reply
            data = pickle.dumps([("r-1", StepOutput([SeqDelta(0, [1])], 3))])
            writer.write(FRAME.pack(len(data)) + data)
            writer.close()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def open_call():  # noqa: ANN202 - a channel call with no more items
            await asyncio.Event().wait()
            yield []

        hub = StepSubscriber(None, "ingress", node_id="node-1")
        hub.expect("r-1")
        with pytest.raises(ConnectionError, match="not the step channel offered"):
            offer = SocketChannel(port, "a" * 32, "b" * 32)
            await asyncio.wait_for(hub._read_socket(offer, open_call()), 10)
        assert hub.queues["r-1"].empty()
        server.close()

    asyncio.run(main())
