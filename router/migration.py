"""Request migration: a stream whose replica was lost goes on elsewhere.

The owner of a stream (the ingress for an LLMServer, the PD router for a DecodeServer) knows
every token it has passed on. When the replica serving a request dies or its stream or step
channel breaks, the owner resubmits the request with those tokens as already produced output
(``GenerateRequest.resume_token_ids``, or a ticketless ``KVHandoff``): the new replica
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
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.protocol import SeqDelta, StepOutput
from router.streams import ChannelLost

MAX_MIGRATIONS = 3
REOPEN_DEADLINE_S = 60.0
REOPEN_RETRY_S = 0.5

_LOST = (ActorDiedError, ActorUnavailableError, RayActorError, ChannelLost)


class MigrationFailed(RuntimeError):
    """A request's replica was lost and the request could not be resumed elsewhere."""


def is_replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the serving replica is gone."""
    return _caused_by(exc, _LOST)


def _caused_by(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
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
                async for step in self.current:
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
            self.current = _marked(await self._reopen(lost))

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


async def _marked(steps: AsyncIterator[StepOutput]) -> AsyncGenerator[StepOutput, None]:
    """``steps``, the first one marked ``migrated`` (the ingress counts migrations by it)."""
    first = True
    try:
        async for step in steps:
            step.migrated, first = first, False
            yield step
    finally:
        await _close(steps)


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
