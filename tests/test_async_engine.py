"""AsyncEngine: streaming, concurrency, aborts and errors, against the offline LLM's outputs."""

from __future__ import annotations

import asyncio
import time

import pytest

from neuron_runtime import (
    LLM,
    AsyncEngine,
    EngineArgs,
    EngineDeadError,
    LLMEngine,
    SamplingParams,
)
from neuron_runtime.engine import EngineStats

MAX_MODEL_LEN = 1024
PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "x",
    "In 1492, Columbus sailed across the ocean blue. He was looking for a new route",
    "def add(a, b): return a + b",
    "Roses are red, violets are blue",
]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


# Prefix caching off: an idle engine then holds no KV blocks at all.
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, num_kv_blocks=512, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def offline(tiny_llama_path) -> LLM:
    """The reference: the synchronous offline API on an identically configured engine."""
    return LLM(model=str(tiny_llama_path), **ENGINE_ARGS)


@pytest.fixture
def engine(tiny_llama_path):
    eng = AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_llama_path), **ENGINE_ARGS))
    yield eng
    eng.shutdown()


class Streamed:
    """The deltas of one request joined per sample index, plus what the last output said."""

    def __init__(self) -> None:
        self.num_outputs = 0
        self.text: dict[int, str] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.finish: dict[int, tuple[str | None, int | str | None]] = {}

    def add(self, out) -> None:
        self.num_outputs += 1
        for c in out.outputs:
            self.text[c.index] = self.text.get(c.index, "") + c.text
            self.token_ids.setdefault(c.index, []).extend(c.token_ids)
            self.finish[c.index] = (c.finish_reason, c.stop_reason)


async def stream(engine: AsyncEngine, prompt, params, request_id=None) -> Streamed:
    result = Streamed()
    finished = False
    async for out in engine.generate(prompt, params, request_id):
        assert not finished, "an output came after the finished one"
        result.add(out)
        finished = out.finished
    assert finished
    return result


def assert_matches_offline(result: Streamed, reference) -> None:
    assert sorted(result.text) == [c.index for c in reference.outputs]
    for c in reference.outputs:
        assert result.token_ids[c.index] == c.token_ids
        assert result.text[c.index] == c.text
        assert result.finish[c.index] == (c.finish_reason, c.stop_reason)


def is_idle(stats: EngineStats) -> bool:
    return (
        stats.num_running,
        stats.num_waiting,
        stats.num_kv_blocks_used,
        stats.num_unfinished_outputs,
    ) == (0, 0, 0, 0)


async def wait_idle(engine: AsyncEngine, timeout_s: float = 10.0) -> EngineStats:
    deadline = time.monotonic() + timeout_s
    while not is_idle(stats := engine.stats()):
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s}s: {stats}"
        await asyncio.sleep(0.01)
    return stats


def count_steps(engine: AsyncEngine) -> list[int]:
    """Counts the loop's engine steps (the loop thread looks ``step`` up on every call)."""
    counter = [0]
    step = engine.engine.step

    def counting_step():
        counter[0] += 1
        return step()

    engine.engine.step = counting_step
    return counter


def stop_string_from(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """4 characters of ``text`` across a token boundary past the 5th token, first occurrence."""
    for k in range(5, len(token_ids) - 2):
        boundary = len(tokenizer.decode(token_ids[:k]))
        piece = text[boundary - 2 : boundary + 2]
        if len(piece) == 4 and "\ufffd" not in piece and text.find(piece) == boundary - 2:
            return piece, boundary - 2
    raise AssertionError(f"no usable token boundary in {text!r}")


async def test_streamed_deltas_join_to_the_offline_output(engine, offline):
    tokenizer = offline.get_tokenizer()
    plain = offline.generate(PROMPTS[1], greedy(40))[0].outputs[0]
    stop, _ = stop_string_from(tokenizer, plain.token_ids, plain.text)
    cases = [
        (PROMPTS[1], greedy(40)),
        (PROMPTS[1], greedy(40).replace(stop=[stop])),
        (PROMPTS[1], greedy(40).replace(stop=[stop], include_stop_str_in_output=True)),
        (PROMPTS[0], SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30)),
        (PROMPTS[4], SamplingParams(temperature=0.8, seed=5, max_tokens=20, n=2)),
        (PROMPTS[2], greedy(25).replace(stop_token_ids=[plain.token_ids[3]])),
    ]
    for prompt, params in cases:
        reference = offline.generate(prompt, params)[0]
        result = await stream(engine, prompt, params)
        assert_matches_offline(result, reference)
        assert result.num_outputs > 1  # it really streamed
    # The stop-string cases did stop, on the string.
    assert offline.generate(PROMPTS[1], cases[1][1])[0].outputs[0].stop_reason == stop
    await wait_idle(engine)


async def test_concurrent_generates_all_finish(engine, offline):
    params = [greedy(8 + 7 * i) for i in range(len(PROMPTS))]
    references = offline.generate(PROMPTS, params)
    results = await asyncio.gather(
        *(
            stream(engine, p, sp, f"req-{i}")
            for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))
        )
    )
    for result, reference in zip(results, references, strict=True):
        assert_matches_offline(result, reference)
    await wait_idle(engine)


async def test_breaking_out_of_the_iterator_aborts_the_request(engine):
    steps = count_steps(engine)
    received = 0
    async for out in engine.generate(PROMPTS[0], greedy(900)):
        received += 1
        assert not out.finished
        if received == 3:
            break
    await wait_idle(engine)
    # Left alone, the request would have taken 900 steps.
    assert steps[0] < 300


async def test_cancelling_the_consumer_task_aborts_the_request(engine):
    steps = count_steps(engine)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPTS[3], greedy(900)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    assert steps[0] < 300


async def test_abort_by_request_id_ends_the_stream(engine):
    outputs = []
    async for out in engine.generate(PROMPTS[0], greedy(900), "victim"):
        outputs.append(out)
        if len(outputs) == 2:
            engine.abort("victim")
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs) < 300
    await wait_idle(engine)


async def test_invalid_request_raises_without_disturbing_a_concurrent_one(engine, offline):
    reference = offline.generate(PROMPTS[3], greedy(300))[0]
    valid = asyncio.create_task(stream(engine, PROMPTS[3], greedy(300), "valid"))
    await asyncio.sleep(0.05)
    too_long = {"prompt_token_ids": [5] * MAX_MODEL_LEN}
    bad_cases = [
        (PROMPTS[0], greedy(4), "already in use"),  # same id as the running request
        (too_long, greedy(1), "max_model_len"),
        ({"prompt_token_ids": [5, 10**6]}, greedy(1), "prompt_token_ids"),
        ("", greedy(1), "empty"),
        (PROMPTS[0], greedy(MAX_MODEL_LEN), "max_tokens"),
    ]
    for prompt, params, needle in bad_cases:
        with pytest.raises(ValueError, match=needle):
            async for _ in engine.generate(
                prompt, params, "valid" if needle == "already in use" else None
            ):
                pass
    assert_matches_offline(await valid, reference)
    await wait_idle(engine)
    # The id is free again once its request has finished.
    assert_matches_offline(await stream(engine, PROMPTS[3], greedy(300), "valid"), reference)


async def test_stats_snapshot_follows_the_loop(engine):
    assert is_idle(engine.stats())
    seen_running = False
    async for _ in engine.generate(PROMPTS[1], greedy(60)):
        stats = engine.stats()
        seen_running |= stats.num_running == 1 and stats.num_kv_blocks_used > 0
    assert seen_running
    await wait_idle(engine)


async def test_check_health_on_a_live_engine_and_after_shutdown(engine):
    engine.check_health()
    await stream(engine, PROMPTS[0], greedy(5))
    engine.check_health()
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate(PROMPTS[0], greedy(5)):
            pass


async def test_wrapping_an_existing_engine(offline, tiny_llama_path):
    # Prefix caching on here: the outputs must not depend on it.
    args = EngineArgs(model=str(tiny_llama_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=512)
    eng = AsyncEngine(LLMEngine.from_engine_args(args))
    try:
        reference = offline.generate(PROMPTS[5], greedy(12))[0]
        assert_matches_offline(await stream(eng, PROMPTS[5], greedy(12)), reference)
    finally:
        eng.shutdown()
