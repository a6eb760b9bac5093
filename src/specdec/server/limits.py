"""What bounds one client's hold on the server: deadlines for reading a request, and requests in flight.

uvicorn alone left two holes (issue 36): a connection that sends nothing, or only part of its headers, is
never closed (its keep-alive timer starts only after a first response), and `limit_concurrency` counts open
connections, so that 256 idle sockets had every request, /health included, answered a plain-text 503. Here:

- `DeadlineHttpToolsProtocol`: uvicorn's httptools protocol, closing a connection whose request head has not
  fully arrived `timeout_headers` seconds after the server began waiting for it (the connection opened, or the
  previous response ended), and refusing a head over 16 KB. Idleness between requests stays uvicorn's
  `timeout_keep_alive`.
- `BodyDeadline` (ASGI): a body that has not fully arrived `timeout_body` seconds after its head is answered
  408 (an OpenAI error object) and its connection closed.
- `BodyLimit` (ASGI): a body over N bytes is answered 413, at once from its Content-Length, or while a chunked
  body streams in.
- `InFlightLimit` (ASGI): at most N requests being answered at once, /health exempt; past it, 503 with an
  OpenAI error object of code `server_overloaded` and a Retry-After. An open connection costs no slot.
- `uvicorn_config(app, ...)`: uvicorn's Config serving `app` with the deadlines.

Example: 300 sockets that never send a byte hold no slot and are closed after `timeout_headers`; meanwhile
/health, and a chat request while fewer than N are in flight, are answered as usual.
"""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specdec.server import DEFAULT_TIMEOUT_HEADERS, DEFAULT_TIMEOUT_KEEP_ALIVE
from specdec.server.protocol import APIError

OVERLOADED_RETRY_AFTER_S = 1
EXEMPT_PATHS = frozenset({"/health"})  # answered however many requests are in flight
MAX_HEAD_BYTES = 16 * 1024  # a request's target and headers, as h11's bound (uvicorn's default parser before)


class DeadlineHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp: a 3 MB body parsed and gathered in ~1.1 ms, against h11's 1.7-2.3 ms,
    of the ~8 ms a refused 3 MB /tokenize call costs the server) with a deadline for each request's head
    (`timeout_headers`, set by `uvicorn_config`) and a bound on its size (`MAX_HEAD_BYTES`, h11's 16 KB:
    llhttp keeps no bound of its own, uvicorn gathers the headers in a list). It relies on HttpToolsProtocol's
    `cycle`, `transport`, `loop` and its parser callbacks (`on_message_begin`, `on_url`, `on_header`,
    `on_headers_complete`) and `on_response_complete`, as uvicorn 0.55 has them (`tests/test_server_limits.py`)."""

    timeout_headers = DEFAULT_TIMEOUT_HEADERS
    _headers_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_headers_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_headers_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is None or self.cycle.response_complete:  # no later head has arrived (pipelined)
            self._arm_headers_deadline()  # the next request's head: from now

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_headers_deadline()
        super().connection_lost(exc)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:  # raised through llhttp: uvicorn answers 400 and closes
            raise ValueError(f"a request head over {MAX_HEAD_BYTES} bytes")

    def _arm_headers_deadline(self) -> None:
        self._disarm_headers_deadline()
        if not self.transport.is_closing():
            self._headers_timer = self.loop.call_later(self.timeout_headers, self._headers_deadline_passed)

    def _disarm_headers_deadline(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_deadline_passed(self) -> None:
        self._headers_timer = None
        # no complete head since the server began waiting (a head makes a new cycle, not yet answered)
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request head in %g s",
                             self.timeout_headers)
            self.transport.close()


def uvicorn_config(app: ASGIApp, host: str, port: int, *, timeout_headers: float = DEFAULT_TIMEOUT_HEADERS,
                   timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE, **options) -> uvicorn.Config:
    """uvicorn's Config for `app` on `host:port` with the head deadline and keep-alive; `options` are
    uvicorn's (log_level, access_log, timeout_graceful_shutdown, ...). No `limit_concurrency`: the app's
    `InFlightLimit` counts requests, not sockets."""
    protocol = type("DeadlineHttpToolsProtocol", (DeadlineHttpToolsProtocol,), {"timeout_headers": timeout_headers})
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=timeout_keep_alive, **options)


class _BodyTimedOut(Exception):
    pass


class BodyDeadline:
    """408 for a request whose body has not fully arrived `timeout` seconds after its head; the connection is
    closed (`Connection: close`), so that what the client sends after is not read as a new request."""

    def __init__(self, app: ASGIApp, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done, tracked_send = False, TrackedSend(send)

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # later receives wait for a disconnect, for as long as the answer takes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimedOut() from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        try:
            await self.app(scope, timed_receive, tracked_send)
        except _BodyTimedOut:
            if tracked_send.started:
                raise
            error = APIError(408, f"The request body did not arrive within {self.timeout:g} seconds of its "
                                  f"headers.", code="request_timeout", headers={"Connection": "close"})
            await error.response()(scope, receive, send)


class InFlightLimit:
    """503 (an OpenAI error object, code `server_overloaded`, with Retry-After) for a request that finds
    `limit` requests already being answered; a request counts from its head to the end of its answer (a
    stream's last event). Paths in `exempt` are always answered and count nothing."""

    def __init__(self, app: ASGIApp, limit: int, exempt: frozenset[str] = EXEMPT_PATHS):
        self.app, self.limit, self.exempt = app, limit, exempt
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            error = APIError(503, f"The server is answering {self.limit} requests, its limit; retry shortly.",
                             code="server_overloaded", headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})
            return await error.response()(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class TrackedSend:
    """An ASGI `send` that remembers whether the response has begun (past that, an error can no longer be
    answered: the connection can only be cut)."""

    def __init__(self, send: Send):
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, or while a chunked body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen, tracked_send = 0, TrackedSend(send)

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not tracked_send.started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body is larger than the limit of {self.max_bytes} bytes.",
                         code="request_too_large")
        await error.response()(scope, receive, send)
