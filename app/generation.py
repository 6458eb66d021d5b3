"""One generation request as the ingress sees it: token streams in, text events out.

A request has one engine stream per prompt (a completions request may carry several); each
prompt yields ``n`` sequences. ``Generation.events()`` merges the streams and yields, per
engine step, the choices that have something new to send. Errors after the first step are
raised from ``events()``; the caller turns them into an SSE error event.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from app.metrics import RequestTimer
from app.request_trace import StreamTrace
from app.text import SequenceText, TokenLogprobs
from deployments.protocol import GenerateRequest, StepOutput
from router.migration import (
    MAX_MIGRATIONS,
    Chained,
    Migrating,
    migrating_sequences,
    resume_sampling,
    sequence_sampling,
)
from router.streams import merge


class EngineError(RuntimeError):
    """The engine failed this request (NaN logits, a failed step, a lost replica)."""


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class PromptStream:
    """A prompt's engine stream, its first step already received.

    With ``request`` and ``reopen`` (the ingress's submit), a request whose replica is lost
    mid-stream is resumed on another one (router/migration.py); each of ``n > 1`` sequences
    resumes on its own.
    """

    first: StepOutput
    rest: Any  # router.streams.Followed (or any async iterator, with cancel() to abort)
    request: GenerateRequest | None = None
    reopen: Callable[[GenerateRequest], Awaitable[PromptStream]] | None = None
    max_migrations: int = MAX_MIGRATIONS
    resumed: list[Any] = field(default_factory=list)  # the resumed calls' ``rest``s

    async def steps(self) -> AsyncIterator[StepOutput]:
        request = self.request
        if self.reopen is None or request is None:
            async for step in Chained(self.first, self.rest):
                yield step
            return
        n = int(request.sampling.get("n") or 1)
        max_tokens = request.sampling.get("max_tokens")
        steps: AsyncIterator[StepOutput]
        if n == 1:
            migrating = Migrating(
                Chained(self.first, self.rest),
                self._resume,
                max_tokens=max_tokens,
                max_migrations=self.max_migrations,
            )
            steps = migrating.steps()
        else:
            steps = migrating_sequences(
                Chained(self.first, self.rest),
                n,
                self._resume_sequence,
                max_tokens=max_tokens,
                max_migrations=self.max_migrations,
            )
        async with contextlib.aclosing(steps):
            async for step in steps:
                yield step

    async def _resume(self, tokens: list[int], attempt: int) -> AsyncIterator[StepOutput]:
        assert self.request is not None
        request_id = f"{self.request.request_id}.m{attempt}"
        return await self._reopen(request_id, self.request.sampling, tokens)

    async def _resume_sequence(
        self, index: int, tokens: list[int], attempt: int
    ) -> AsyncIterator[StepOutput]:
        assert self.request is not None
        request_id = f"{self.request.request_id}#{index}.m{attempt}"
        sampling = sequence_sampling(self.request.sampling, index)
        return await self._reopen(request_id, sampling, tokens)

    async def _reopen(
        self, request_id: str, sampling: dict[str, Any], tokens: list[int]
    ) -> AsyncIterator[StepOutput]:
        assert self.request is not None and self.reopen is not None
        request = dataclasses.replace(
            self.request,
            request_id=request_id,
            sampling=resume_sampling(sampling),
            resume_token_ids=tokens,
        )
        stream = await self.reopen(request)
        self.resumed.append(stream.rest)
        return Chained(stream.first, stream.rest)

    def cancel(self) -> None:
        for rest in (self.rest, *self.resumed):
            cancel = getattr(rest, "cancel", None)
            if cancel is not None:
                cancel()


class Generation:
    def __init__(
        self,
        streams: list[PromptStream],
        seq_texts: list[list[SequenceText]],
        timer: RequestTimer,
    ) -> None:
        self.streams = streams
        self.seq_texts = seq_texts  # [prompt][n]
        self.n = len(seq_texts[0])
        self.timer = timer
        self.trace = StreamTrace.start([s.first for s in streams])
        self.num_prompt_tokens = sum(s.first.num_prompt_tokens for s in streams)
        self.num_cached_tokens = sum(s.first.num_cached_tokens for s in streams)
        # Per prompt, when prompt_logprobs was asked (the first step carries them).
        self.prompt_logprobs = [s.first.prompt_logprobs for s in streams]
        timer.metrics.prompt_tokens.inc(self.num_prompt_tokens)

    @property
    def choices(self) -> list[SequenceText]:
        return [seq for per_prompt in self.seq_texts for seq in per_prompt]

    @property
    def num_completion_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.choices)

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
        }
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    async def events(self) -> AsyncIterator[list[ChoiceEvent]]:
        """Per engine step, the choices with new text, logprobs or a finish reason."""
        reported: set[int] = set()
        try:
            async for prompt_index, step in merge([s.steps() for s in self.streams]):
                self._account(step)
                events = []
                for delta in step.seqs:
                    if delta.finish_reason == "error" or step.error:
                        raise EngineError(step.error or "the engine failed this request")
                    index = prompt_index * self.n + delta.index
                    seq = self.seq_texts[prompt_index][delta.index]
                    seq.add(delta)
                    text, logprobs = seq.take()
                    finished = seq.finished and index not in reported
                    if finished:
                        reported.add(index)
                    if text or logprobs or finished:
                        events.append(
                            ChoiceEvent(
                                index,
                                text,
                                logprobs,
                                seq.finish_reason if finished else None,
                                seq.stop_reason if finished else None,
                            )
                        )
                if step.error:
                    raise EngineError(step.error)
                if events:
                    yield events
                if all(seq.finished for seq in self.choices):
                    break  # stop strings may end sequences before the engine does
            else:
                if not all(seq.finished for seq in self.choices):
                    raise EngineError("the engine stream ended before every sequence finished")
        finally:
            for stream in self.streams:
                stream.cancel()
            self.timer.finish()
            self.trace.finish(self.num_completion_tokens, [s.finish_reason for s in self.choices])

    def _account(self, step: StepOutput) -> None:
        self.trace.step(step)
        self.timer.tokens(sum(len(d.token_ids) for d in step.seqs))
        if step.migrated:
            self.timer.metrics.request_migrations.inc()
        if step.queue_time_s is not None:
            self.timer.metrics.queue_time.observe(step.queue_time_s)
        transfer = step.kv_transfer
        if transfer is not None:
            if transfer.failed:
                self.timer.metrics.kv_transfer_failures.inc()
            elif transfer.transport != "recompute":
                self.timer.metrics.observe_kv_transfer(
                    transfer.transport, transfer.stage, transfer.num_bytes, transfer.seconds
                )
        for encode in step.image_encodes or ():
            self.timer.metrics.observe_image_encode(encode)
        self.timer.metrics.update_engine_stats(step.stats)
