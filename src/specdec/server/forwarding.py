"""An HTTP request carried from the ingress to an engine replica and answered there by the replica's own app.

The ingress buffers the request (`ForwardedRequest`), the replica runs its single-process app on it in
memory (`call_app`, ASGI) and yields the app's ASGI messages as they come, which travel back over a Ray
Serve streaming call; the ingress replays them to the client (`ReplayedResponse`). So every route,
status, header and streamed event is the single-process server's, byte for byte. If the replica dies before
the status line, the client gets a 503 (`replica_failed`); after it, an SSE stream ends with an error event
and `[DONE]`, and any other body is cut short.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.streams import sse
from specdec.server.protocol import APIError

logger = logging.getLogger(__name__)

REPLICA_FAILED = ("The engine replica serving this request stopped before it finished; the other replicas "
                  "were not affected and Ray Serve restarts this one. Retry the request.")


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    @classmethod
    def of(cls, scope: Scope, body: bytes) -> "ForwardedRequest":
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), tuple(scope["headers"]), body)

    def scope(self) -> Scope:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": list(self.headers), "client": None, "server": None}


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """Run `app` on `request`, yielding what it sends. Closing the iterator early (the client went away,
    so Ray Serve cancelled the call) cancels the app, which aborts the engine request."""
    sent: asyncio.Queue = asyncio.Queue()
    body = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if body:
            return body.pop()
        await asyncio.Event().wait()  # no disconnect is ever reported: it comes as cancellation
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            yield message
        task.result()
    finally:
        task.cancel()


class ReplayedResponse(Response):
    """The replica's ASGI messages (`start` was the first; `rest` the others) sent to the client."""

    def __init__(self, start: Message, rest: AsyncIterator[Message]):
        super().__init__(status_code=start["status"])
        self.raw_headers = list(start.get("headers", []))
        self.rest = rest
        self.is_sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                          for k, v in self.raw_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for message in self.rest:
                await send(message)
                if not message.get("more_body", False):
                    return
        except Exception as e:  # the replica died mid-answer
            logger.warning("replica failed mid-answer: %r", e)
            if self.is_sse:
                event = replica_failed().to_dict()
                await send({"type": "http.response.body", "body": sse(event).encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def replica_failed() -> APIError:
    return APIError(503, REPLICA_FAILED, code="replica_failed", headers={"Retry-After": "1"})
