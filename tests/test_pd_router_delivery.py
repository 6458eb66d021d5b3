"""The PD router's decode-first path without a cluster: fake prefill and decode deployments.

The decode deployment answers a call opened before the prefill (``await_handoff``) with its
destination, then waits until the fake prefill delivers the handoff under that key; a call
that carries a handoff continues from it at once. Checked: the tokens the client gets (the
prefill's first token, then the decode tokens, each once), which decode calls were opened and
which were closed, for a delivered handoff, a delivery that failed (the router passes the
handoff on and closes the waiting call), a prefill replica lost mid-call (the waiting call is
closed and the retry opens a new one), a request that ends on its first token, and the
handoff through the router when ``decode_first`` is off. Delivered, the first token waits
for the decode replica's ``kv_arrived`` step (at most ``KV_ARRIVAL_WAIT_S``), which the
client never sees. A delivery the prefill reported but the decode call never got (its
sender died) resumes the request on a decode replica after ``KV_DELIVERY_WAIT_S``, unless
the decode call said ``kv_received``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError

from deployments.protocol import (
    DecodeRequest,
    GenerateRequest,
    KVDestination,
    PrefillResult,
    SeqDelta,
    StepOutput,
)
from neuron_runtime.kv_transfer import KVHandoff, KVMetadata
from router.pd_router import PDRouter

PROMPT = [5, 6, 7, 8]
FIRST = 100  # the prefill's token
REST = [101, 102, 103]  # what decode produces after it


class Call:
    """A streaming call running apart from its caller (as on a replica); ``cancel`` ends it."""

    def __init__(self, steps) -> None:  # noqa: ANN001 - an async generator
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.task = asyncio.create_task(self._run(steps))

    async def _run(self, steps) -> None:  # noqa: ANN001
        try:
            async for step in steps:
                await self.queue.put(step)
            await self.queue.put(None)
        except asyncio.CancelledError:
            pass

    def cancel(self) -> None:
        self.cancelled = True
        self.task.cancel()

    def __aiter__(self):  # noqa: ANN204
        return self

    async def __anext__(self) -> StepOutput:
        step = await self.queue.get()
        if step is None:
            raise StopAsyncIteration
        return step


class Decode:
    """The decode deployment: every call it got, and the handoffs waiting calls expect.
    A delivered handoff's KV is in ``arrival_s`` after it came (then the ``kv_arrived`` step
    goes out; ``events`` records when), a ``kv_received`` step first if ``received``."""

    def __init__(self, arrival_s: float = 0.0, received: bool = False) -> None:
        self.calls: list[tuple[DecodeRequest, Call]] = []
        self.expected: dict[str, asyncio.Future] = {}
        self.arrival_s = arrival_s
        self.received = received
        self.events: list[str] = []
        decode = self

        class Generate:
            def remote(self, request: DecodeRequest, subscriber: str) -> Call:
                call = Call(decode.steps(request))
                decode.calls.append((request, call))
                return call

        self.generate = Generate()

    def options(self, **_) -> Decode:  # noqa: ANN003
        return self

    async def steps(self, request: DecodeRequest):  # noqa: ANN201
        handoff = request.handoff
        if request.await_handoff:
            key = f"{request.request_id}@{len(self.calls)}"
            self.expected[key] = asyncio.get_running_loop().create_future()
            yield StepOutput([], len(PROMPT), kv_destination=KVDestination("decode", None, key))
            handoff = await self.expected[key]
            if self.received:
                yield StepOutput([], len(PROMPT), kv_received=True)
            await asyncio.sleep(self.arrival_s)
            self.events.append("kv arrived")
            yield StepOutput([], len(PROMPT), kv_arrived=True)
        # With a handoff, or resumed after the first token (recomputed here), or from the
        # start (a short prompt prefilled here: the first token comes from here too).
        done = request.resume_token_ids if handoff is None else handoff.output_token_ids
        if handoff is None and not done:
            yield StepOutput([SeqDelta(0, [FIRST])], len(PROMPT))
            done = [FIRST]
        assert done == [FIRST]
        for i, token in enumerate(REST):
            last = i == len(REST) - 1
            yield StepOutput(
                [SeqDelta(0, [token], finish_reason="length" if last else None)],
                len(PROMPT),
                finished=last,
            )


class Response:
    """A unary call's response."""

    def __init__(self, coro) -> None:  # noqa: ANN001
        self.task = asyncio.ensure_future(coro)
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.task.cancel()

    def __await__(self):  # noqa: ANN204
        return self.task.__await__()


class Prefill:
    """The prefill deployment: ``outcomes`` says what each call does in turn: "deliver" (to
    the destination it names), "keep" (its delivery failed: the handoff returns), "lost"
    (the replica died), "end" (the request ends on its first token), "vanish" (it says
    delivered, but the delivery never reaches the decode call)."""

    def __init__(self, decode: Decode, outcomes: list[str]) -> None:
        self.requests: list[GenerateRequest] = []
        prefill = self

        class Call:
            def remote(self, request: GenerateRequest) -> Response:
                prefill.requests.append(request)
                return Response(prefill.run(request, outcomes.pop(0)))

        self.prefill = Call()
        self.decode = decode
        self.hold: asyncio.Event | None = None  # set: every call waits for it first

    async def run(self, request: GenerateRequest, outcome: str) -> PrefillResult:
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0.01)
        if outcome == "lost":
            raise ActorDiedError()
        finished = outcome == "end"
        step = StepOutput(
            [SeqDelta(0, [FIRST], finish_reason="stop" if finished else None)],
            len(PROMPT),
            finished=finished,
        )
        if finished:
            return PrefillResult(step)
        handoff = KVHandoff(KVMetadata("m", "h", "float32", 1, 1, 1, len(PROMPT), ()), [FIRST])
        delivered = outcome in ("deliver", "vanish") and request.kv_destination is not None
        if delivered and outcome == "deliver":
            self.decode.expected[request.kv_destination.key].set_result(handoff)
        return PrefillResult(step, handoff, delivered=delivered)


def router(
    prefill: Prefill,
    decode: Decode,
    decode_first: bool = True,
    max_local_prefill_tokens: int = 0,
    max_prefill_queue: int = 0,
) -> PDRouter:
    return PDRouter.func_or_class(
        prefill,
        decode,
        step_channels=False,
        decode_first=decode_first,
        max_local_prefill_tokens=max_local_prefill_tokens,
        max_prefill_queue=max_prefill_queue,
    )


async def tokens_of(pd: PDRouter, events: list[str] | None = None) -> list[int]:
    """The tokens the client gets; every step it gets carries some (``events``: when the
    first came)."""
    request = GenerateRequest("r", PROMPT, {"max_tokens": 4, "temperature": 0.0})
    tokens = []
    async for step in pd.generate(request):
        assert step.seqs and not step.kv_arrived
        if events is not None and not tokens:
            events.append("first token")
        tokens.extend(t for seq in step.seqs for t in seq.token_ids)
    return tokens


@pytest.mark.parametrize(
    ("outcomes", "decode_first", "calls", "delivered"),
    [
        # The handoff delivered to the call opened first: one decode call, never closed.
        (["deliver"], True, [True], 1),
        # The delivery failed: the waiting call is closed, a call with the handoff opened.
        (["keep"], True, [True, False], 0),
        # The prefill replica lost: its waiting call closed, the retry opens its own.
        (["lost", "deliver"], True, [True, True], 1),
        # decode_first off: the handoff comes back and goes out with the decode call.
        (["deliver"], False, [False], 0),
    ],
)
def test_the_client_gets_each_token_once_whichever_way_the_handoff_went(
    outcomes: list[str], decode_first: bool, calls: list[bool], delivered: int
) -> None:
    async def main() -> None:
        decode = Decode()
        prefill = Prefill(decode, list(outcomes))
        pd = router(prefill, decode, decode_first)
        assert await asyncio.wait_for(tokens_of(pd), 10) == [FIRST, *REST]
        assert [request.await_handoff for request, _ in decode.calls] == calls
        # Every call but the last was closed by the router; the last ran to its end.
        assert [call.cancelled for _, call in decode.calls] == [True] * (len(calls) - 1) + [False]
        waiting = [r.kv_destination is not None for r in prefill.requests]
        assert waiting == [decode_first] * len(outcomes)
        own = pd.own_stats()
        assert own["num_handoffs_delivered"] == delivered
        assert own["num_kv_refs_held"] == 0
        assert not pd.decode_steps.queues and not pd.decode_steps.owners

    asyncio.run(main())


@pytest.mark.parametrize("local", [True, False])
def test_a_prompt_up_to_the_local_limit_is_prefilled_by_its_decode_replica(local: bool) -> None:
    """No prefill call: one decode call with no handoff, the request's own sampling (prompt
    logprobs included, which only a prefill computes). One token longer: a prefill replica."""

    async def main() -> None:
        decode = Decode()
        prefill = Prefill(decode, [] if local else ["deliver"])
        pd = router(prefill, decode, max_local_prefill_tokens=len(PROMPT) - (not local))
        sampling = {"max_tokens": 4, "temperature": 0.0, "prompt_logprobs": 1}
        request = GenerateRequest("r", PROMPT, sampling)
        tokens = []
        async for step in pd.generate(request):
            tokens.extend(t for seq in step.seqs for t in seq.token_ids)
        assert tokens == [FIRST, *REST]
        assert len(prefill.requests) == (not local)
        [(call, _)] = decode.calls
        if local:
            assert call.handoff is None and not call.await_handoff
            assert call.resume_token_ids == [] and call.sampling == sampling
        else:
            assert call.await_handoff and call.sampling["prompt_logprobs"] is None
        own = pd.own_stats()
        assert own["num_local_prefills"] == local
        assert own["num_kv_refs_held"] == 0

    asyncio.run(main())


def test_a_long_prompt_that_finds_the_prefill_queue_full_is_prefilled_at_decode() -> None:
    """max_prefill_queue 1: while one request is at the prefill replica, the next (longer
    than max_local_prefill_tokens) is prefilled by its decode replica; once the first is
    back, the third goes to the prefill replica again."""

    async def run(pd: PDRouter, request_id: str) -> list[int]:
        request = GenerateRequest(request_id, PROMPT, {"max_tokens": 4, "temperature": 0.0})
        tokens = []
        async for step in pd.generate(request):
            tokens.extend(t for seq in step.seqs for t in seq.token_ids)
        return tokens

    async def main() -> None:
        decode = Decode()
        prefill = Prefill(decode, ["deliver", "deliver"])
        prefill.hold = asyncio.Event()
        pd = router(prefill, decode, max_prefill_queue=1)
        first = asyncio.create_task(run(pd, "a"))
        while not prefill.requests:
            await asyncio.sleep(0.001)
        assert pd.own_stats()["num_prefilling"] == 1
        assert await asyncio.wait_for(run(pd, "b"), 10) == [FIRST, *REST]
        prefill.hold.set()
        assert await asyncio.wait_for(first, 10) == [FIRST, *REST]
        assert await asyncio.wait_for(run(pd, "c"), 10) == [FIRST, *REST]
        assert [r.request_id for r in prefill.requests] == ["a", "c"]
        local = [r for r, _ in decode.calls if r.request_id == "b"]
        assert len(local) == 1 and local[0].handoff is None and not local[0].await_handoff
        own = pd.own_stats()
        assert own["num_local_prefills"] == 1 and own["num_prefilling"] == 0
        assert own["num_kv_refs_held"] == 0

    asyncio.run(main())


def test_a_prefill_retry_goes_under_an_id_of_its_own() -> None:
    """The lost attempt's waiting call may still hold the request's id on the decode replica
    (its cancel is on its way): the retry's prefill and decode calls use ``r.r1``."""

    async def main() -> None:
        decode = Decode()
        prefill = Prefill(decode, ["lost", "deliver"])
        pd = router(prefill, decode)
        assert await asyncio.wait_for(tokens_of(pd), 10) == [FIRST, *REST]
        assert [r.request_id for r in prefill.requests] == ["r", "r.r1"]
        assert [r.request_id for r, _ in decode.calls] == ["r", "r.r1"]

    asyncio.run(main())


def test_a_request_that_ends_on_its_first_token_closes_the_waiting_call() -> None:
    async def main() -> None:
        decode = Decode()
        pd = router(Prefill(decode, ["end"]), decode)
        assert await asyncio.wait_for(tokens_of(pd), 10) == [FIRST]
        ((request, call),) = decode.calls
        assert request.await_handoff and call.cancelled
        assert pd.own_stats()["num_handoffs_delivered"] == 0
        assert not pd.decode_steps.queues

    asyncio.run(main())


def test_a_caller_gone_during_the_prefill_closes_both_calls() -> None:
    async def main() -> None:
        decode = Decode()
        prefill = Prefill(decode, ["deliver"])
        pd = router(prefill, decode)
        task = asyncio.create_task(tokens_of(pd))
        while not prefill.requests:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ((_, call),) = decode.calls
        assert call.cancelled
        assert not pd.decode_steps.queues

    asyncio.run(main())


def test_the_first_token_waits_for_the_decode_replica_to_have_the_kv() -> None:
    """Delivered: the first token goes out once the decode replica says the KV is in (so the
    second follows it by one decode step), not as soon as the prefill returns it."""

    async def main() -> None:
        decode = Decode(arrival_s=0.2)
        pd = router(Prefill(decode, ["deliver"]), decode)
        assert await asyncio.wait_for(tokens_of(pd, decode.events), 10) == [FIRST, *REST]
        assert decode.events == ["kv arrived", "first token"]

    asyncio.run(main())


def test_the_first_token_waits_for_the_kv_no_longer_than_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode replica that takes longer (its batch full, a slow read) than the bound: the
    first token goes out at the bound, and every token still comes once, in order."""
    monkeypatch.setattr("router.pd_router.KV_ARRIVAL_WAIT_S", 0.05)

    async def main() -> None:
        decode = Decode(arrival_s=0.5)
        pd = router(Prefill(decode, ["deliver"]), decode)
        assert await asyncio.wait_for(tokens_of(pd, decode.events), 10) == [FIRST, *REST]
        assert decode.events == ["first token", "kv arrived"]
        assert not pd.decode_steps.queues and pd.own_stats()["num_kv_refs_held"] == 0

    asyncio.run(main())


def test_a_delivery_that_never_came_resumes_the_request_on_a_decode_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill replica said delivered, then died before the delivery went out: the
    waiting call is closed after KV_DELIVERY_WAIT_S and the request resumes after its first
    token on a decode replica (which recomputes it); the client gets every token once."""
    monkeypatch.setattr("router.pd_router.KV_DELIVERY_WAIT_S", 0.2)

    async def main() -> None:
        decode = Decode()
        pd = router(Prefill(decode, ["vanish"]), decode)
        assert await asyncio.wait_for(tokens_of(pd), 10) == [FIRST, *REST]
        (waited, first_call), (resumed, second_call) = decode.calls
        assert waited.await_handoff and first_call.cancelled
        assert not resumed.await_handoff and resumed.handoff is None
        assert resumed.resume_token_ids == [FIRST] and not second_call.cancelled
        own = pd.own_stats()
        assert own["num_migrations"] == 1 and own["num_kv_refs_held"] == 0
        assert not pd.decode_steps.queues and not pd.decode_steps.owners

    asyncio.run(main())


def test_a_decode_call_that_said_kv_received_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KV comes later than KV_DELIVERY_WAIT_S, but the decode call said it has the
    handoff: no migration, one decode call, every token once."""
    monkeypatch.setattr("router.pd_router.KV_DELIVERY_WAIT_S", 0.1)
    monkeypatch.setattr("router.pd_router.KV_ARRIVAL_WAIT_S", 0.05)

    async def main() -> None:
        decode = Decode(arrival_s=0.4, received=True)
        pd = router(Prefill(decode, ["deliver"]), decode)
        assert await asyncio.wait_for(tokens_of(pd), 10) == [FIRST, *REST]
        ((_, call),) = decode.calls
        assert not call.cancelled
        assert pd.own_stats()["num_migrations"] == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("arrival_s", "first_output_s", "marks"),
    [
        # The KV in at once: kv_arrived only, then the outputs.
        (0.0, 0.3, ["kv_arrived"]),
        # Slower than RECEIPT_QUIET_S: kv_received goes first.
        (0.4, 0.6, ["kv_received", "kv_arrived"]),
        # No arrival signal (a failed read ends in an output): the output ends the wait.
        (None, 0.4, ["kv_received", "kv_arrived"]),
    ],
)
def test_the_decode_replica_says_kv_received_only_when_the_kv_is_slow(
    arrival_s: float | None, first_output_s: float, marks: list[str]
) -> None:
    from deployments import decode

    async def outputs():  # noqa: ANN202
        await asyncio.sleep(first_output_s)
        yield "out 1"
        yield "out 2"

    async def main() -> list:
        loop = asyncio.get_running_loop()
        arrived = loop.create_future()
        if arrival_s is not None:
            loop.call_later(arrival_s, arrived.set_result, None)
        quiet_until = time.monotonic() + decode.RECEIPT_QUIET_S
        return [out async for out in decode._announcing(outputs(), arrived, quiet_until)]

    seen = asyncio.run(main())
    assert [getattr(out, "value", out) for out in seen] == [*marks, "out 1", "out 2"]
