"""Merging async streams: items of several iterators as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

_END = object()


async def merge(
    iterators: Sequence[AsyncIterator[Any]],
) -> AsyncGenerator[tuple[int, Any], None]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    An exception in any iterator ends the merge with that exception; leaving early cancels
    every pump (and so the streams behind them).
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[Any]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item, None))
            await queue.put((index, _END, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
