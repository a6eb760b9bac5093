"""One API request's way through the engine and back: `ApiRequest` (its engine requests, one `Tracker` each,
answered as one body or as SSE chunks), `SSEResponse` (cleans up however a stream ends) and `with_cancellation`
(a client that goes away aborts its request)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specdec.config import SamplingParams
from specdec.engine.outputs import RequestOutput
from specdec.fan_out import pick_best
from specdec.server.async_engine import EngineStoppedError, RequestStream
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import APIError
from specdec.server.renderers import Renderer


def sse(payload: dict) -> str:
    """One Server-Sent Event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ApiRequest:
    """The engine requests one API request runs: for each prompt, its sequences (`fan_out`). Choices are
    numbered prompt by prompt, n each: choice i * n + j is sequence j of prompt i (with best_of > n, the
    j-th best)."""

    def __init__(self, request_id: str, prompt_ids: list[list[int]], params: SamplingParams):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.trackers: list[list[Tracker]] = [[] for _ in prompt_ids]

    def _all(self) -> list["Tracker"]:
        return [t for group in self.trackers for t in group]

    async def run_to_end(self) -> list[tuple[int, RequestOutput]]:
        """(choice index, final output) of every choice, in order."""
        choices = []
        for i, group in enumerate(self.trackers):
            outs = [await tracker.run_to_end() for tracker in group]
            choices += [(i * self.params.n + out.index, out) for out in pick_best(outs, self.params)]
        return choices

    async def events(self, renderer: Renderer) -> AsyncIterator[str]:
        """SSE events of `chunks`, then `[DONE]`. An engine failure mid-stream becomes an error event (the
        status line is already sent)."""
        try:
            async for chunk in self.chunks(renderer):
                yield sse(chunk)
        except APIError as e:
            yield sse(e.to_dict())
        yield "data: [DONE]\n\n"

    async def chunks(self, renderer: Renderer) -> AsyncIterator[dict]:
        """The chunks of every choice as its sequence makes them (choices interleave), then usage if asked.
        An engine failure raises APIError (503 if the engine stopped, else 500)."""
        indexed = [(i * self.params.n + j, t) for i, group in enumerate(self.trackers) for j, t in enumerate(group)]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, tracker: Tracker) -> None:
            try:
                async for out in tracker.outputs():
                    await queue.put((index, tracker, out))
            except RuntimeError as e:  # EngineStoppedError included
                await queue.put((index, tracker, e))
            finally:
                await queue.put((index, tracker, None))

        tasks = [asyncio.ensure_future(pump(index, tracker)) for index, tracker in indexed]
        finals: list[tuple[int, RequestOutput]] = []
        try:
            for index, _ in indexed:
                first = renderer.first_chunk(index)
                if first is not None:
                    yield first
            running = len(tasks)
            while running:
                index, tracker, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, RuntimeError):
                    status = 503 if isinstance(item, EngineStoppedError) else 500
                    raise APIError(status, str(item), code="engine_unavailable" if status == 503 else "engine_error")
                else:
                    text = item.new_text  # the engine holds back a tail that may begin a stop string
                    if item.finished or text or (renderer.return_token_ids and item.new_token_ids) or \
                            item.new_logprobs:
                        chunk = renderer.chunk(item, text, index)
                        if chunk is not None:  # None: the text is held back (a possible tool call)
                            yield chunk
                    if item.finished:
                        finals.append((index, item))
            if renderer.include_usage:
                yield renderer.usage_chunk(finals)
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def close(self) -> None:
        for tracker in self._all():
            tracker.close()


class Tracker:
    """One engine request: its output stream, its timings, and its cleanup (`close`, idempotent): abort
    if unfinished, count it in the metrics."""

    def __init__(self, stream: RequestStream, started: float, metrics: ServerMetrics):
        self.stream, self.started, self.metrics = stream, started, metrics
        self.request_id = stream.request_id
        self.first_token_at: float | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._closed = False
        metrics.running.labels(metrics.model_name).inc()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        async for out in self.stream:
            if out.new_token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.num_tokens += len(out.new_token_ids)
            if out.finished:
                self.finish_reason = out.finish_reason
            yield out

    async def run_to_end(self) -> RequestOutput:
        try:
            async for out in self.outputs():
                if out.finished:
                    return out
        except EngineStoppedError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        except RuntimeError as e:
            raise APIError(500, str(e), code="engine_error") from None
        raise APIError(500, "the engine ended the request without a final output", code="engine_error")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stream.close()
        m = self.metrics
        m.running.labels(m.model_name).dec()
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        m.request_finished(self.finish_reason or "abort", self.num_tokens, ttft, time.monotonic() - self.started)


class SSEResponse(StreamingResponse):
    """Server-Sent Events whose request is cleaned up however the response ends, including a client that
    disconnects before the first event (when the event generator never even starts)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


@dataclasses.dataclass
class Handoff:
    """Whether the engine has taken a handler's request: from then on its trackers count how it ends; before,
    `with_cancellation` counts a client gone as an aborted request. One per handler task, which sees it through
    the context it copies (`_HANDOFF`); `engine_took_request` marks it."""

    reached: bool = False


_HANDOFF: contextvars.ContextVar[Handoff] = contextvars.ContextVar("specdec_handoff")


def engine_took_request() -> None:
    """Called once the engine holds the current handler's request (`_submit`); nothing outside a handler."""
    handoff = _HANDOFF.get(None)
    if handoff is not None:
        handoff.reached = True


async def with_cancellation(request: Request, handler) -> Response:
    """Run `handler` until it answers or the client disconnects (then cancel it: its request is aborted).
    A streaming answer is returned at once; its own response object watches the connection after that.
    A client gone before the engine took its request is counted here as an aborted request (499)."""
    started, handoff = time.monotonic(), Handoff()
    token = _HANDOFF.set(handoff)
    try:
        task = asyncio.ensure_future(handler)  # (copies the context: the task sees `handoff`)
    finally:
        _HANDOFF.reset(token)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if not handoff.reached:
            request.app.state.server.metrics.request_finished("abort", 0, None, time.monotonic() - started)
        return Response(status_code=499)  # nobody reads it: the client is gone
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
