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
from ray.exceptions import ActorDiedError

from deployments.protocol import SeqDelta, StepOutput
from neuron_runtime import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from neuron_runtime.kv_transfer import KVHandoff, KVMetadata
from router.migration import Migrating, MigrationFailed, is_replica_lost
from router.streams import ChannelLost

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
