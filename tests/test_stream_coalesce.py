"""router/streams.py coalesce: SSE strings sent to the HTTP proxy at most once per interval.

A source emits strings at scripted times (asyncio sleeps); checked against the script: the
concatenation of what goes out equals the input in order (nothing lost, nothing reordered);
no two sends are closer than the interval; a string that comes after a quiet interval goes
out at once (the first token is never held); strings that come within one interval of a send
go out together once the interval has passed; closing the result mid-wait closes the source.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from router.streams import coalesce

INTERVAL = 0.1


async def scripted(gaps: list[float], closed: list[bool]) -> AsyncGenerator[str, None]:
    """Emits "s0", "s1", ... each after its gap (seconds) from the previous one."""
    try:
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            yield f"s{i};"
    finally:
        closed.append(True)


async def timed(gaps: list[float], interval: float) -> tuple[list[tuple[float, str]], list[bool]]:
    loop = asyncio.get_running_loop()
    closed: list[bool] = []
    start = loop.time()
    sends = [
        (loop.time() - start, text) async for text in coalesce(scripted(gaps, closed), interval)
    ]
    return sends, closed


def test_zero_interval_sends_every_string_as_it_comes():
    sends, closed = asyncio.run(timed([0.0, 0.01, 0.0, 0.02], 0.0))
    assert [text for _, text in sends] == ["s0;", "s1;", "s2;", "s3;"]
    assert closed == [True]


def test_a_burst_goes_out_together_and_sends_keep_the_interval():
    # s0 at 0 (sent at once), s1..s4 within 40 ms of it (held to 100 ms, one send), a gap of
    # 200 ms, then s5 (sent at once: the interval has long passed), s6 5 ms after it (held to
    # an interval after s5's send) and s7 300 ms later (at once).
    gaps = [0.0, 0.01, 0.01, 0.01, 0.01, 0.2, 0.005, 0.3]
    sends, closed = asyncio.run(timed(gaps, INTERVAL))
    texts = [text for _, text in sends]
    assert "".join(texts) == "".join(f"s{i};" for i in range(len(gaps)))
    assert texts == ["s0;", "s1;s2;s3;s4;", "s5;", "s6;", "s7;"]
    times = [at for at, _ in sends]
    assert times[0] < 0.05  # the first string is not held
    for before, after in zip(times, times[1:], strict=False):
        assert after - before >= INTERVAL * 0.95
    # s5 came at ~0.24 s, more than an interval after the send at ~0.1 s: out at once.
    assert times[2] - sum(gaps[:6]) < 0.05
    assert times[4] - sum(gaps) < 0.05
    assert closed == [True]


def test_a_source_that_ends_while_a_send_waits_flushes_what_it_held():
    sends, closed = asyncio.run(timed([0.0, 0.01, 0.01], INTERVAL))
    assert [text for _, text in sends] == ["s0;", "s1;s2;"]
    assert closed == [True]


def test_closing_the_stream_while_a_read_is_pending_closes_the_source():
    async def main() -> list[bool]:
        closed: list[bool] = []
        stream = coalesce(scripted([0.0, 0.01, 5.0], closed), INTERVAL)
        assert await anext(stream) == "s0;"
        # s1 arrives at 10 ms and waits for the interval; the read of s2 (5 s away) is pending
        # when the interval ends, and the caller leaves right after s1 goes out.
        assert await anext(stream) == "s1;"
        await stream.aclose()
        return closed

    assert asyncio.run(main()) == [True]


def test_an_error_in_the_source_reaches_the_caller_after_what_came_before():
    async def failing() -> AsyncGenerator[str, None]:
        yield "a;"
        await asyncio.sleep(0.01)
        yield "b;"
        raise RuntimeError("engine failed")

    async def main() -> tuple[list[str], str]:
        got: list[str] = []
        try:
            async for text in coalesce(failing(), INTERVAL):
                got.append(text)
        except RuntimeError as exc:
            return got, str(exc)
        return got, ""

    got, error = asyncio.run(main())
    assert got == ["a;", "b;"] and error == "engine failed"
