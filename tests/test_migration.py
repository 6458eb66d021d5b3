"""Request migration (router/migration.py) without a cluster.

The engine half: a request resumed after some of its tokens (a handoff with no KV, as the
LLMServer and the decode replica get it) produces the tokens an unbroken run produces, with
penalties counting the resumed tokens as output. The router half: ``Migrating`` over fake
replica streams passes every token once, gives up after ``max_migrations`` with its own error,
and leaves errors that are not a lost replica alone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from ray.exceptions import ActorDiedError

from app.generation import PromptStream
from deployments.protocol import ChannelRequest, GenerateRequest, SeqDelta, StepOutput
from deployments.step_channel import StepPublisher
from neuron_runtime import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from neuron_runtime.kv_transfer import KVHandoff, KVMetadata
from router.migration import Migrating, MigrationFailed, is_replica_lost
from router.streams import ChannelLost, StepSubscriber

PROMPT = [5, 17, 230, 99, 41, 8, 64]


@pytest.fixture(scope="module")
def engine(tiny_llama_path) -> LLMEngine:
    args = EngineArgs(model=str(tiny_llama_path), max_model_len=256, num_kv_blocks=64)
    return LLMEngine.from_engine_args(args)


def run(engine: LLMEngine, request_id: str, params: SamplingParams, **kwargs) -> list[int]:  # noqa: ANN003
    engine.add_request(
        request_id, {"prompt_token_ids": PROMPT}, params, RequestOutputKind.DELTA, **kwargs
    )
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize(
    "penalties",
    # Negative penalties pull output tokens back up: they bite even on a random model.
    [{}, {"presence_penalty": -2.0, "frequency_penalty": -1.0, "repetition_penalty": 1.2}],
    ids=["greedy", "penalties"],
)
def test_a_resumed_request_continues_with_the_unbroken_tokens(engine, penalties) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)
    unbroken = run(engine, "unbroken", params)
    assert len(unbroken) == 24
    for cut in (1, 9, 23):
        metadata = KVMetadata.describe(engine.config.model, PROMPT)
        handoff = KVHandoff(metadata, unbroken[:cut])
        rest = run(engine, f"resumed-{cut}", params, handoff=handoff)
        assert unbroken[:cut] + rest == unbroken, cut
    # Counted as output, not prompt: as prompt tokens the penalties would differ.
    if penalties:
        as_prompt = SamplingParams(temperature=0, max_tokens=24 - 9, ignore_eos=True, **penalties)
        engine.add_request(
            "as-prompt", {"prompt_token_ids": PROMPT + unbroken[:9]}, as_prompt,
            RequestOutputKind.DELTA,
        )  # fmt: skip
        other: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                other.extend(out.outputs[0].token_ids)
        assert other != unbroken[9:]
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.01}],
    ids=["temperature-1", "top-p-k-min-p"],
)
def test_a_resumed_seeded_request_continues_with_the_unbroken_tokens(engine, sampling) -> None:
    """The resumed request's generator is where the lost replica's was after the cut."""
    params = SamplingParams(seed=1234, max_tokens=24, ignore_eos=True, **sampling)
    unbroken = run(engine, "seeded-unbroken", params)
    greedy = run(
        engine, "seeded-greedy", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert unbroken != greedy  # the draws decide the tokens
    metadata = KVMetadata.describe(engine.config.model, PROMPT)
    for cut in (1, 9, 23):
        rest = run(
            engine, f"seeded-resumed-{cut}", params, handoff=KVHandoff(metadata, unbroken[:cut])
        )
        assert unbroken[:cut] + rest == unbroken, cut
    # Starting the generator again from its seed (no state carried over) goes elsewhere.
    fresh = torch.Generator().manual_seed(1234).get_state().numpy()
    restarted = run(
        engine, "seeded-restarted", params,
        handoff=KVHandoff(metadata, unbroken[:9], generator_state=fresh),
    )  # fmt: skip
    assert unbroken[:9] + restarted != unbroken
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0


# -- Migrating over fake replica streams ------------------------------------------------------


def step(tokens: list[int], finished: bool = False) -> StepOutput:
    return StepOutput([SeqDelta(0, tokens, finish_reason="length" if finished else None)], 3,
                      finished=finished)  # fmt: skip


REFERENCE = list(range(100, 120))


class Replicas:
    """Serves REFERENCE from where a request resumes; each replica dies after ``die_after``
    steps (None: never); the first ``unreachable`` reopen attempts find no replica."""

    def __init__(self, die_after: list[int | None], unreachable: int = 0) -> None:
        self.die_after = list(die_after)
        self.unreachable = unreachable
        self.resumed_from: list[list[int]] = []
        self.cancelled = 0

    async def stream(self, start: int):  # noqa: ANN201
        die_after = self.die_after.pop(0)
        try:
            for i, token in enumerate(REFERENCE[start:]):
                if die_after is not None and i == die_after:
                    raise ActorDiedError()
                yield step([token], finished=start + i == len(REFERENCE) - 1)
                await asyncio.sleep(0)
        finally:
            self.cancelled += 1

    async def reopen(self, tokens: list[int], attempt: int):  # noqa: ANN201
        if self.unreachable:
            self.unreachable -= 1
            raise RuntimeError("generation failed") from ChannelLost("replica gone")
        self.resumed_from.append(tokens)
        return self.stream(len(tokens))


def collect(replicas: Replicas, max_migrations: int = 3) -> tuple[list[int], list[StepOutput]]:
    async def main() -> tuple[list[int], list[StepOutput]]:
        migrating = Migrating(
            replicas.stream(0), replicas.reopen, max_tokens=len(REFERENCE),
            max_migrations=max_migrations, reopen_deadline_s=5,
        )  # fmt: skip
        steps = [s async for s in migrating]
        return [t for s in steps for d in s.seqs for t in d.token_ids], steps

    return asyncio.run(main())


def test_every_token_once_across_migrations() -> None:
    replicas = Replicas([3, 5, None], unreachable=2)
    tokens, steps = collect(replicas)
    assert tokens == REFERENCE
    assert [len(t) for t in replicas.resumed_from] == [3, 8]
    assert replicas.resumed_from[1] == REFERENCE[:8]
    assert sum(s.migrated for s in steps) == 2 and steps[-1].finished
    assert replicas.cancelled == 3  # every replica's stream was closed


def test_after_max_migrations_the_request_fails_with_its_own_error() -> None:
    with pytest.raises(MigrationFailed, match="max_migrations 1"):
        collect(Replicas([2, 2]), max_migrations=1)


def test_a_stream_lost_after_its_last_token_finishes_without_a_new_replica() -> None:
    async def unfinished():  # noqa: ANN202
        for token in REFERENCE:
            yield step([token])
        raise ActorDiedError()

    async def main() -> list[StepOutput]:
        migrating = Migrating(unfinished(), Replicas([]).reopen, max_tokens=len(REFERENCE))
        return [s async for s in migrating]

    steps = asyncio.run(main())
    assert [t for s in steps for d in s.seqs for t in d.token_ids] == REFERENCE
    assert steps[-1].finished and steps[-1].seqs[0].finish_reason == "length"


def test_only_a_lost_replica_migrates() -> None:
    assert not is_replica_lost(RuntimeError("the engine failed this request"))
    assert is_replica_lost(ChannelLost("gone"))

    async def failing():  # noqa: ANN202
        yield step([1])
        raise ValueError("NaN logits")

    async def main() -> None:
        migrating = Migrating(failing(), Replicas([]).reopen, max_tokens=None)
        with pytest.raises(ValueError, match="NaN"):
            async for _ in migrating:
                pass

    asyncio.run(main())


# -- the colocated path without Ray: real step channels, two fake replicas ---------------------


class Replica:
    """An LLMServer stand-in: every request emits REFERENCE after its resumed tokens, one
    token per ``tick``; ``die()`` ends its calls and channels as a killed actor's do."""

    def __init__(self, name: str) -> None:
        self.publisher = StepPublisher(name)
        self.calls: list[FakeCall] = []
        self.tick = asyncio.Event()

    async def steps(self, request: GenerateRequest):  # noqa: ANN201
        start = len(request.resume_token_ids)
        for k, token in enumerate(REFERENCE[start:]):
            await self.tick.wait()
            self.tick.clear()
            yield step([token], finished=start + k == len(REFERENCE) - 1)

    def call(self, gen) -> FakeCall:  # noqa: ANN001
        call = FakeCall(gen)
        self.calls.append(call)
        return call

    def die(self) -> None:
        for call in self.calls:
            call.kill()


class FakeCall:
    """A streaming call running apart from its caller (as on a replica)."""

    def __init__(self, gen) -> None:  # noqa: ANN001
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run(gen))

    async def _run(self, gen) -> None:  # noqa: ANN001
        try:
            async for item in gen:
                await self.queue.put(("item", item))
            await self.queue.put(("end", None))
        except asyncio.CancelledError:
            pass

    def kill(self) -> None:
        self.task.cancel()
        self.queue.put_nowait(("error", ActorDiedError()))

    def cancel(self) -> None:
        self.task.cancel()

    def __aiter__(self):  # noqa: ANN204
        return self

    async def __anext__(self):  # noqa: ANN204
        kind, value = await self.queue.get()
        if kind == "end":
            raise StopAsyncIteration
        if kind == "error":
            raise value
        return value


class Handle:
    """Routes each call to the first live replica; a channel to the replica it names."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.dead: set[str] = set()
        handle = self

        class Generate:
            def remote(self, request: GenerateRequest, subscriber: str) -> FakeCall:
                replica = next(
                    r for r in handle.replicas if r.publisher.replica_id not in handle.dead
                )
                steps = replica.publisher.publish(
                    subscriber, request.request_id, replica.steps(request)
                )
                return replica.call(steps)

        class Channel:
            def remote(self, request: ChannelRequest) -> FakeCall:
                replica = next(
                    r for r in handle.replicas if r.publisher.replica_id == request.replica_id
                )
                return replica.call(replica.publisher.channel(request))

        self.generate, self.channel = Generate(), Channel()


def test_colocated_streams_migrate_over_real_step_channels() -> None:
    """Three streams on replica a (a channel open), a dies after 5 tokens: every stream
    resumes on b after exactly the tokens it had, and ends with REFERENCE."""

    async def main() -> None:
        a, b = Replica("a"), Replica("b")
        handle = Handle([a, b])
        hub = StepSubscriber(handle, "ingress", min_requests=2)

        async def submit(request: GenerateRequest) -> PromptStream:
            hub.expect(request.request_id)
            call = handle.generate.remote(request, hub.subscriber)
            first = await anext(call)
            return PromptStream(first, hub.follow(request.request_id, first, call), request, submit)

        async def ticking(replica: Replica) -> None:
            while True:
                replica.tick.set()
                await asyncio.sleep(0.002)

        tickers = [asyncio.create_task(ticking(r)) for r in (a, b)]
        sampling = {"max_tokens": len(REFERENCE), "temperature": 0.0}
        streams = [
            await submit(GenerateRequest(f"r-{i}", [1, 2, 3], dict(sampling))) for i in range(3)
        ]
        assert hub.channels, "no channel opened"
        got: list[list[StepOutput]] = [[] for _ in streams]

        async def read(i: int) -> None:
            async for s in streams[i].steps():
                got[i].append(s)
                if len([t for x in got[i] for d in x.seqs for t in d.token_ids]) == 5 and i == 0:
                    handle.dead.add("a")
                    a.die()

        await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(3))), 10)
        for ticker in tickers:
            ticker.cancel()
        for steps in got:
            assert [t for s in steps for d in s.seqs for t in d.token_ids] == REFERENCE
            assert sum(s.migrated for s in steps) == 1 and steps[-1].finished
        assert not hub.queues and not hub.owners

    asyncio.run(main())
