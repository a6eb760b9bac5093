"""The app's ASGI middleware beside the limits (`specdec.server.limits`): the API key, internal errors
answered as OpenAI errors, and every answer counted in the metrics."""

from __future__ import annotations

import hmac
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.limits import TrackedSend
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import APIError, new_id

logger = logging.getLogger(__name__)


class ApiKeyAuth:
    """401 unless `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (Anthropic's header), compared
    in constant time, on every path but `open_paths`: a route added later is covered without naming it."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]):
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), open_paths
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            if not (bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)):
                error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` (or "
                                      "`x-api-key: <key>`).", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class InternalErrors:
    """A bug answering a request: the client gets a generic 500 with an id to quote (also in X-Request-Id), the
    log the traceback under that id. Not re-raised (as Starlette's handler of Exception would, making the
    server drop the connection), unless the response had begun: then only cutting it short is left."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked_send = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            error_id = new_id("err")
            logger.exception("internal error %s answering %s %s", error_id, scope["method"], scope["path"])
            if tracked_send.started:
                raise
            error = APIError(500, f"The server had an error while processing your request. Quote {error_id} to "
                                  f"its operator, whose log has the details.", code="internal_error",
                             headers={"X-Request-Id": error_id})
            await error.response()(scope, receive, send)


class CountAnswers:
    """Counts every HTTP answer in `specdec:http_requests_total{method, path, status}`."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, known_paths: set[str]):
        self.app, self.metrics, self.known_paths = app, metrics, known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def tracked_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            path = scope["path"] if scope["path"] in self.known_paths else "other"
            self.metrics.http_answer(scope["method"], path, status)
