"""Request migration: a stream whose replica was lost goes on elsewhere.

The owner of a stream (the ingress for an LLMServer or a PD router, the PD router for a
DecodeServer) knows every token it has passed on. When the replica serving a request dies or
its stream or step channel breaks, the owner resubmits the request with those tokens as
already produced output (``resume_token_ids`` of a ``GenerateRequest``, or of a
``DecodeRequest`` without a handoff; a PD router sends the former straight to a decode
replica). An ``n > 1`` request resumes each unfinished sequence on its own. The new replica
recomputes prompt + tokens, counts the tokens as output (penalties, ``max_tokens``, stop
conditions) without sending them again, and samples the next one. Greedy requests therefore go
on with exactly the tokens they would have produced. So do seeded ones: the lost replica's
generator went with it, but its state is a function of the seed and the number of draws, one
noise row per sampled token (neuron_runtime/sampler.py), so the new replica seeds a generator
and replays that many draws (``sampler.skip_draws``) before it samples. Replaying costs what
drawing did (about 1 ms per token at a 49k vocabulary on one core), once per migration; a
counter-based generator (noise keyed by seed and position) would need no replay, but would
change every seeded stream and the speculative sampler's draws with it. With speculative
decoding the number of draws per token varies, so a seeded stream goes on differently there.

Each request migrates at most ``max_migrations`` times; a replica that cannot be reached yet
(Serve is still replacing it) is tried again until ``reopen_deadline_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.protocol import SeqDelta, StepOutput
from router.streams import ChannelLost, merge

MAX_MIGRATIONS = 3
REOPEN_DEADLINE_S = 60.0
REOPEN_RETRY_S = 0.5


class KVDeliveryLost(RuntimeError):
    """A handoff its prefill replica delivered to a decode call never reached it: that
    replica died before the delivery went out (router/pd_router.py). The request resumes on
    a decode replica like one whose replica was lost."""


_LOST = (ActorDiedError, ActorUnavailableError, RayActorError, ChannelLost, KVDeliveryLost)


class MigrationFailed(RuntimeError):
    """A request's replica was lost and the request could not be resumed elsewhere."""


def is_replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the serving replica is gone.

    A ``MigrationFailed`` from a replica that migrates its own requests (the PD router) is
    that replica's final answer, not its loss.
    """
    return _caused_by(exc, _LOST, final=(MigrationFailed,))


def _caused_by(
    exc: BaseException,
    kinds: tuple[type[BaseException], ...],
    final: tuple[type[BaseException], ...] = (),
) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or isinstance(seen, final):
            return False
        if isinstance(seen, kinds):
            return True
        seen = seen.__cause__ or getattr(seen, "cause", None)
    return False


class Migrating:
    """One single-sequence request's steps across the replicas that serve it in turn.

    ``steps`` are the first replica's; ``reopen(tokens, attempt)`` resubmits the request
    after ``tokens`` (every token passed on so far) and returns the new replica's steps.
    ``on_migrate`` is called once per migration (the counter metric).
    """

    def __init__(
        self,
        steps: AsyncIterator[StepOutput],
        reopen: Callable[[list[int], int], Awaitable[AsyncIterator[StepOutput]]],
        *,
        max_tokens: int | None,
        max_migrations: int = MAX_MIGRATIONS,
        reopen_deadline_s: float = REOPEN_DEADLINE_S,
        on_migrate: Callable[[], None] | None = None,
        cancel: Callable[[AsyncIterator[StepOutput]], None] | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        self.current = steps
        self.reopen = reopen
        self.max_tokens = max_tokens
        self.max_migrations = max_migrations
        self.reopen_deadline_s = reopen_deadline_s
        self.on_migrate = on_migrate
        self._cancel = cancel
        self.tokens: list[int] = list(tokens or [])  # passed on before ``steps``
        self.num_prompt_tokens = 0
        self.migrations = 0

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self.steps()

    async def steps(self) -> AsyncGenerator[StepOutput, None]:
        """The request's steps, whichever replica they came from."""
        try:
            async for step in self._migrating():
                yield step
        finally:
            self.cancel()
            await _close(self.current)

    async def _migrating(self) -> AsyncGenerator[StepOutput, None]:
        while True:
            try:
                resumed = self.migrations > 0
                async for step in self.current:
                    # The first step after a migration is marked (the ingress counts them);
                    # a step marked by a replica that migrates on its own keeps its mark.
                    if resumed:
                        step.migrated, resumed = True, False
                    self.num_prompt_tokens = step.num_prompt_tokens
                    for delta in step.seqs:
                        self.tokens.extend(delta.token_ids)
                    yield step
                return
            except Exception as exc:
                if not is_replica_lost(exc):
                    raise
                lost = exc
            self.cancel()
            await _close(self.current)
            if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
                # Every token came through; only the finishing step was lost.
                yield StepOutput(
                    [SeqDelta(0, [], finish_reason="length")], self.num_prompt_tokens, finished=True
                )
                return
            if self.migrations >= self.max_migrations:
                raise MigrationFailed(
                    f"the serving replica was lost {self.migrations + 1} times "
                    f"(max_migrations {self.max_migrations}): {lost!r}"
                ) from lost
            self.migrations += 1
            if self.on_migrate is not None:
                self.on_migrate()
            self.current = await self._reopen(lost)

    async def _reopen(self, lost: BaseException) -> AsyncIterator[StepOutput]:
        """The new replica's steps; a replica still unreachable is tried again until the
        deadline (Serve routes to the dead one until its controller notices)."""
        deadline = time.monotonic() + self.reopen_deadline_s
        while True:
            try:
                return await self.reopen(list(self.tokens), self.migrations)
            except Exception as exc:
                # The replicas left may be full for a moment (back-pressure): wait too.
                retry = _caused_by(exc, (*_LOST, BackPressureError))
                if not retry or time.monotonic() >= deadline:
                    raise MigrationFailed(
                        f"could not resume the request after its replica was lost ({lost!r}): "
                        f"{exc!r}"
                    ) from exc
            await asyncio.sleep(REOPEN_RETRY_S)

    def cancel(self) -> None:
        """Aborts the request on the replica serving it now (a no-op once it has ended)."""
        if self._cancel is not None:
            self._cancel(self.current)
            return
        cancel = getattr(self.current, "cancel", None)
        if cancel is not None:
            cancel()


class Chained:
    """A call's steps: its first one (already received) and ``rest``, whose ``cancel()``
    aborts the call."""

    def __init__(self, first: StepOutput, rest: AsyncIterator[StepOutput]) -> None:
        self.first = first
        self.rest = rest
        self._iterator = self._steps()

    def __aiter__(self) -> Chained:
        return self

    def __anext__(self) -> Awaitable[StepOutput]:
        return self._iterator.__anext__()

    async def aclose(self) -> None:
        await self._iterator.aclose()

    async def _steps(self) -> AsyncGenerator[StepOutput, None]:
        yield self.first
        async for step in self.rest:
            yield step

    def cancel(self) -> None:
        cancel = getattr(self.rest, "cancel", None)
        if cancel is not None:
            cancel()


async def migrating_sequences(
    steps: AsyncIterator[StepOutput],
    n: int,
    reopen: Callable[[int, list[int], int], Awaitable[AsyncIterator[StepOutput]]],
    *,
    max_tokens: int | None,
    max_migrations: int = MAX_MIGRATIONS,
    reopen_deadline_s: float = REOPEN_DEADLINE_S,
) -> AsyncGenerator[StepOutput, None]:
    """An ``n``-sequence request's steps across the replicas that serve it.

    While one replica serves all ``n`` sequences, its steps pass as they are. When it is
    lost, each sequence that has not finished resumes as a single-sequence request of its own
    (``reopen(index, tokens, attempt)``: sampled as the engine samples that sequence, see
    ``sequence_sampling``) after exactly its own tokens; from then on each migrates on its own
    (a ``Migrating`` each, ``max_migrations`` apiece), and their steps are merged back under
    their indices. Each resumed sequence's first step is marked ``migrated``.
    """
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    finished: set[int] = set()
    num_prompt_tokens = 0
    try:
        async for step in steps:
            num_prompt_tokens = step.num_prompt_tokens
            for delta in step.seqs:
                tokens[delta.index].extend(delta.token_ids)
                if delta.finish_reason is not None:
                    finished.add(delta.index)
            yield step
        return
    except Exception as exc:
        if not is_replica_lost(exc):
            raise
        lost = exc
    finally:
        cancel = getattr(steps, "cancel", None)
        if cancel is not None:
            cancel()
        await _close(steps)
    unfinished = [i for i in range(n) if i not in finished]
    if not unfinished:  # every sequence ended; only the request's last step was lost
        yield StepOutput([], num_prompt_tokens, finished=True)
        return

    def resumed(index: int) -> AsyncIterator[StepOutput]:
        async def reopen_one(seq_tokens: list[int], attempt: int) -> AsyncIterator[StepOutput]:
            return await reopen(index, seq_tokens, attempt)

        migrating = Migrating(
            raising(lost),
            reopen_one,
            max_tokens=max_tokens,
            max_migrations=max_migrations,
            reopen_deadline_s=reopen_deadline_s,
            tokens=tokens[index],
        )
        return migrating.steps()

    children = {index: resumed(index) for index in unfinished}
    async with contextlib.aclosing(merged(children)) as merged_steps:
        async for step in merged_steps:
            yield step


async def merged(
    children: Mapping[int, AsyncIterator[StepOutput]],
) -> AsyncGenerator[StepOutput, None]:
    """Single-sequence streams as one request's steps, each under its sequence index (the
    key) as they come; only the last one's final step is ``finished`` (the request's end, as
    for an engine's n > 1 request: each sequence's end is its finish reason)."""
    indices = list(children)
    remaining = len(children)
    async with contextlib.aclosing(merge(list(children.values()))) as steps:
        async for position, step in steps:
            if step.finished:
                remaining -= 1
                step.finished = remaining == 0
            yield reindexed(step, indices[position])


def reindexed(step: StepOutput, index: int) -> StepOutput:
    """``step`` of a single-sequence request, as sequence ``index`` of its parent."""
    if index:
        step.seqs = [
            SeqDelta(index, s.token_ids, s.logprobs, s.finish_reason, s.stop_reason)
            for s in step.seqs
        ]
    return step


def sequence_sampling(sampling: dict[str, Any], index: int) -> dict[str, Any]:
    """The i-th of n parallel samples as its own request (SamplingParams.child's rule)."""
    seed = sampling.get("seed")
    return {**sampling, "n": 1, "seed": None if seed is None else seed + index}


async def _close(steps: AsyncIterator[StepOutput]) -> None:
    aclose = getattr(steps, "aclose", None)
    if aclose is not None:
        await aclose()


async def raising(exc: BaseException) -> AsyncGenerator[StepOutput, None]:
    """Steps of a request whose replica was lost before its first step: ``exc`` at once."""
    raise exc
    yield  # an async generator


def resume_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """A resumed request's sampling fields: prompt logprobs came with the first step."""
    return {**sampling, "prompt_logprobs": None}
