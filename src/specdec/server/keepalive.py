"""Heartbeats for long streams: what a client's idle watchdog sees while the engine is silent.

A 21,000-token prompt (Claude Code's) takes minutes to prefill on a CPU, and no token streams meanwhile;
Claude Code retries a stream after 5 minutes without an event, Codex gives up after 5 minutes too. The
translation layers send their API's harmless event (Anthropic's `ping`, the Responses API's
`response.in_progress`) whenever `interval` seconds pass without a chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
DEFAULT_INTERVAL_S = 15.0  # as Anthropic's own pings, well inside any client's idle timeout


async def with_heartbeats(items: AsyncIterator[T], interval: float = DEFAULT_INTERVAL_S) -> AsyncIterator[T | None]:
    """`items`, with None after every `interval` seconds without one. Exceptions of `items` propagate; closing
    this closes `items`. Example: chunks at 0 s and 40 s with interval 15 -> chunk, None, None, chunk."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    done = object()

    async def pump() -> None:
        try:
            async for item in items:
                await queue.put((item, None))
            await queue.put((done, None))
        except Exception as e:  # handed to the reader, raised there
            await queue.put((done, e))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                item, error = await asyncio.wait_for(queue.get(), interval)
            except asyncio.TimeoutError:
                yield None
                continue
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
