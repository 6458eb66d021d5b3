"""Request migration (router/migration.py) without a cluster.

The engine half: a request resumed after some of its tokens (a handoff with no KV, as the
LLMServer and the decode replica get it) produces the tokens an unbroken run produces, greedy
or seeded, with penalties counting the resumed tokens as output. The router half: ``Migrating``
over fake replica streams passes every token once, gives up after ``max_migrations`` with its
own error, and leaves errors that are not a lost replica alone; colocated streams, n > 1 ones
too, resume over real step channels; an encode whose replica died goes to the image's next
owner in rendezvous order.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from ray.exceptions import ActorDiedError

from app.generation import PromptStream
from deployments.protocol import (
    ChannelRequest,
    EncodeRequest,
    EncodeResult,
    GenerateRequest,
    ImagePart,
    SeqDelta,
    StepOutput,
)
from deployments.step_channel import StepPublisher
from neuron_runtime import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from neuron_runtime.kv_transfer import KVHandoff, KVMetadata
from router.encoder_router import EncoderRouter
from router.migration import Migrating, MigrationFailed, is_replica_lost, sequence_sampling
from router.policies import ReplicaLoad, rendezvous_rank
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


def test_each_of_n_seeded_sequences_resumed_alone_continues_as_in_the_n_request(engine) -> None:
    """What the ingress does with an n > 1 request whose replica was lost: each sequence goes
    on as a single-sequence request with ``sequence_sampling``'s seed, after its own tokens."""
    sampling = {"n": 2, "seed": 77, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    engine.add_request(
        "n2", {"prompt_token_ids": PROMPT}, SamplingParams(**sampling), RequestOutputKind.DELTA
    )
    unbroken: list[list[int]] = [[], []]
    while engine.has_unfinished_requests():
        for out in engine.step():
            for completion in out.outputs:
                unbroken[completion.index].extend(completion.token_ids)
    assert unbroken[0] != unbroken[1]
    metadata = KVMetadata.describe(engine.config.model, PROMPT)
    for index, cut in ((0, 5), (1, 11)):
        params = SamplingParams(**sequence_sampling(sampling, index))
        handoff = KVHandoff(metadata, unbroken[index][:cut])
        rest = run(engine, f"n2#{index}.m1", params, handoff=handoff)
        assert unbroken[index][:cut] + rest == unbroken[index], index


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


def test_a_mark_from_a_replica_that_migrates_on_its_own_is_kept() -> None:
    """The ingress's Migrating over a PD router's stream passes the router's marks on."""

    async def routed():  # noqa: ANN202
        for i, token in enumerate(REFERENCE):
            s = step([token], finished=i == len(REFERENCE) - 1)
            s.migrated = i == 4  # the router resumed this stream on another decode replica
            yield s

    async def main() -> list[StepOutput]:
        migrating = Migrating(routed(), Replicas([]).reopen, max_tokens=len(REFERENCE))
        return [s async for s in migrating]

    assert [s.migrated for s in asyncio.run(main())] == [i == 4 for i in range(len(REFERENCE))]


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
    # A replica that migrates its own requests (the PD router) gave up: its answer stands.
    gave_up = MigrationFailed("the serving replica was lost 4 times")
    gave_up.__cause__ = ActorDiedError()
    assert not is_replica_lost(RuntimeError("generation failed")) and not is_replica_lost(gave_up)

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


def sequence_reference(seed: int) -> list[int]:
    """The tokens the fake replicas sample for a sequence seeded ``seed``: odd seeds end after
    4 tokens, even ones after 20."""
    return [1000 * seed + k for k in range(4 if seed % 2 else 20)]


class SeededReplica(Replica):
    """Samples ``n`` sequences (seeds seed + i, the engine's rule), each its
    ``sequence_reference`` after the tokens a resumed request brings; records what it got."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.requests: list[GenerateRequest] = []

    async def steps(self, request: GenerateRequest):  # noqa: ANN201
        self.requests.append(request)
        n, seed = request.sampling.get("n", 1), request.sampling["seed"]
        assert n == 1 or not request.resume_token_ids
        refs = [sequence_reference(seed + i) for i in range(n)]
        start = len(request.resume_token_ids)
        assert request.resume_token_ids == refs[0][:start]  # a sequence resumes after its own
        sent = [start] * n
        while any(sent[i] < len(refs[i]) for i in range(n)):
            await self.tick.wait()
            self.tick.clear()
            deltas = []
            for i in range(n):
                if sent[i] < len(refs[i]):
                    last = sent[i] == len(refs[i]) - 1
                    deltas.append(SeqDelta(i, [refs[i][sent[i]]], None, "length" if last else None))
                    sent[i] += 1
            done = all(sent[i] == len(refs[i]) for i in range(n))
            yield StepOutput(deltas, 3, finished=done)


def test_colocated_n_sequences_migrate_each_after_its_own_tokens() -> None:
    """An n=3 request (seed 10) and an n=1 one on replica a, a dies once sequence 0 has 5
    tokens (sequence 1, seed 11, has ended by then): sequences 0 and 2 resume on b as requests
    of their own, seeded 10 and 12, each after exactly its tokens; every sequence ends with its
    own reference tokens and only the request's last step is finished."""

    async def main() -> None:
        a, b = SeededReplica("a"), SeededReplica("b")
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
        requests = [
            GenerateRequest("r-0", [1, 2, 3], {"n": 3, "seed": 10, "max_tokens": 20}),
            GenerateRequest("r-1", [1, 2, 3], {"n": 1, "seed": 20, "max_tokens": 20}),
        ]
        streams = [await submit(r) for r in requests]
        assert hub.channels, "no channel opened"
        got: list[list[StepOutput]] = [[], []]

        async def read(i: int) -> None:
            async for s in streams[i].steps():
                got[i].append(s)
                seq0 = [t for x in got[i] for d in x.seqs if d.index == 0 for t in d.token_ids]
                if i == 0 and len(seq0) == 5:
                    handle.dead.add("a")
                    a.die()

        await asyncio.wait_for(asyncio.gather(read(0), read(1)), 10)
        for ticker in tickers:
            ticker.cancel()
        for steps, seeds in ((got[0], [10, 11, 12]), (got[1], [20])):
            for index, seed in enumerate(seeds):
                tokens = [t for s in steps for d in s.seqs if d.index == index for t in d.token_ids]
                assert tokens == sequence_reference(seed), (seed, tokens)
            assert [s.finished for s in steps].count(True) == 1 and steps[-1].finished
        assert sum(s.migrated for s in got[0]) == 2
        resumed = {r.request_id: r for r in b.requests}
        assert set(resumed) == {"r-0#0.m1", "r-0#2.m1", "r-1.m1"}
        sampling = {"n": 1, "seed": 12, "max_tokens": 20, "prompt_logprobs": None}
        assert resumed["r-0#2.m1"].sampling == sampling
        assert resumed["r-0#0.m1"].resume_token_ids == sequence_reference(10)[:5]
        assert not hub.queues and not hub.owners

    asyncio.run(main())


# -- encoder retry: a replica lost mid-encode, rendezvous order ----------------------------------


class FakeEncoders:
    """VisionEncoder replicas behind a handle that routes as Serve does with RendezvousRouter:
    the policy's ranks over the replicas, a replica that does not answer its probe (dead)
    passed over. A replica listed in ``die_on`` dies while encoding that image."""

    def __init__(self, replica_ids: list[str], die_on: dict[str, str]) -> None:
        self.replica_ids = replica_ids
        self.die_on = die_on  # content hash -> the replica that dies encoding it
        self.dead: set[str] = set()
        self.encoded: list[tuple[str, str]] = []  # (replica, content hash) of finished encodes
        self.encode = self

    def remote(self, request: EncodeRequest):  # noqa: ANN201
        loads = [ReplicaLoad(replica_id) for replica_id in self.replica_ids]
        ranks = rendezvous_rank(request.content_hash, loads)
        replica = next(r[0].replica_id for r in ranks if r[0].replica_id not in self.dead)
        return FakeResponse(self._encode(replica, request))

    async def _encode(self, replica: str, request: EncodeRequest) -> EncodeResult:
        await asyncio.sleep(0.01)
        if self.die_on.get(request.content_hash) == replica:
            self.dead.add(replica)
        if replica in self.dead:  # it died while this call was on it
            raise ActorDiedError()
        self.encoded.append((replica, request.content_hash))
        return EncodeResult(request.content_hash, f"features of {request.content_hash}", 4,
                            False, 0.0, 0.01, replica)  # fmt: skip


class FakeResponse:
    def __init__(self, coro) -> None:  # noqa: ANN001
        self.task = asyncio.ensure_future(coro)

    def __await__(self):  # noqa: ANN204
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


def test_an_encoder_lost_mid_encode_is_retried_on_the_next_owner() -> None:
    replica_ids = ["enc-a", "enc-b", "enc-c"]
    hashes = [f"{i:064x}" for i in range(1, 7)]
    order = {
        key: [r[0].replica_id for r in rendezvous_rank(key, [ReplicaLoad(i) for i in replica_ids])]
        for key in hashes
    }
    # The owner of the first image dies while encoding it; the others are encoded on the way.
    victim = order[hashes[0]][0]
    encoders = FakeEncoders(replica_ids, die_on={hashes[0]: victim})
    router = EncoderRouter(encoders, retry_s=0.01)  # type: ignore[arg-type]
    images = [ImagePart(10 * i, 4, key, data=b"png") for i, key in enumerate(hashes)]

    parts, results = asyncio.run(router.encode(images))

    assert victim in encoders.dead
    by_hash = {r.content_hash: r.replica_id for r in results}
    assert by_hash[hashes[0]] == order[hashes[0]][1]  # the next owner in rendezvous order
    for key in hashes[1:]:  # the others: their owner, unless that was the dead replica
        assert by_hash[key] == next(r for r in order[key] if r not in encoders.dead)
    assert sorted(key for _, key in encoders.encoded) == sorted(hashes)  # each once
    assert [p.features for p in parts] == [f"features of {key}" for key in hashes]


def test_encoders_lost_past_the_retries_fail_the_request() -> None:
    key = f"{7:064x}"
    replica_ids = ["enc-a", "enc-b"]
    owner = rendezvous_rank(key, [ReplicaLoad(i) for i in replica_ids])[0][0].replica_id
    encoders = FakeEncoders(replica_ids, die_on={key: owner})
    router = EncoderRouter(encoders, encode_retries=0, retry_s=0.01)  # type: ignore[arg-type]
    with pytest.raises(ActorDiedError):
        asyncio.run(router.encode([ImagePart(0, 4, key, data=b"png")]))
