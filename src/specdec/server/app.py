"""The OpenAI-compatible HTTP app: `build_app(engine_client, served_model_name, api_key=None)`.

    POST /v1/chat/completions, POST /v1/completions   (JSON, or Server-Sent Events with "stream": true)
    GET  /v1/models, /health, /version, /metrics

Each request: validate (pydantic, strict) -> tokenize (in a worker thread) -> check the context fits ->
`AsyncEngine.add_request` -> read the engine's per-step outputs, answering them as one JSON body or as SSE
chunks of the text each step made decodable (`RequestOutput.new_text`, never the whole text re-decoded).
A client that goes away aborts its request; every error is an OpenAI error object with its status. A request
that finds the engine's queue full (`AsyncEngine(max_waiting_requests=N)`) is answered 503, code `queue_full`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.config import SamplingParams
from specdec.outputs import RequestOutput
from specdec.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from specdec.server.metrics import CONTENT_TYPE, ServerMetrics
from specdec.server.protocol import (
    APIError, ChatCompletionRequest, ChatRenderer, CompletionRequest, CompletionRenderer, Renderer, new_id,
    validation_error,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
QUEUE_FULL_RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full queue: a hint, the queue moves each step


def build_app(
    engine_client: AsyncEngine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: ServerMetrics | None = None,
    model_root: str | None = None,
) -> FastAPI:
    """The app serving `engine_client` under `served_model_name` (the first of a list is the name answers
    carry; requests may use any). Starts the engine thread on startup and stops it on shutdown.
    `api_key` protects /v1/*; /health, /version and /metrics stay open, as in vLLM."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    metrics = metrics or ServerMetrics(names[0])
    engine_client.add_step_listener(metrics.on_step)
    server = _Server(engine_client, names, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_client.shutdown)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        return await _with_cancellation(request, server.chat(req))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        return await _with_cancellation(request, server.completion(req))

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(server.started)
        cards = [{"id": n, "object": "model", "created": created, "owned_by": "specdec", "root": model_root or names[0],
                  "parent": None, "max_model_len": engine_client.max_model_len} for n in names]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health() -> Response:
        if not engine_client.healthy:
            return _error_response(APIError(503, "the engine is not running", code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"version": version("specdec")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    known_paths = {route.path for route in app.routes}
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(_ApiKeyAuth, api_key=api_key)
    app.add_middleware(_CountAnswers, metrics=metrics, known_paths=known_paths)
    return app


# ---- serving a request --------------------------------------------------------------------------------


class _Server:
    def __init__(self, engine: AsyncEngine, names: list[str], metrics: ServerMetrics):
        self.engine, self.names, self.metrics = engine, names, metrics
        self.started = time.time()

    async def chat(self, req: ChatCompletionRequest) -> Response:
        self._check(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids = await asyncio.to_thread(_chat_prompt_ids, self.engine.tokenizer, messages)
        params = self._params(req, req.output_limit(), len(prompt_ids), "messages")
        tracker = await self._submit(new_id("chatcmpl"), prompt_ids, params, "messages", req.cache_salt)
        return await self._answer(req, tracker, ChatRenderer)

    async def completion(self, req: CompletionRequest) -> Response:
        self._check(req)
        prompt = req.single_prompt()
        prompt_ids = await asyncio.to_thread(_completion_prompt_ids, self.engine.tokenizer, prompt)
        params = self._params(req, req.output_limit(), len(prompt_ids), "prompt")
        tracker = await self._submit(new_id("cmpl"), prompt_ids, params, "prompt", req.cache_salt)
        return await self._answer(req, tracker, CompletionRenderer)

    async def _answer(self, req, tracker: "_Tracker", renderer_type: type[Renderer]) -> Response:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        renderer = renderer_type(tracker.request_id, self.names[0], include_usage=include_usage,
                                 return_token_ids=req.return_token_ids)
        if req.stream:
            return _SSEResponse(tracker.events(renderer), tracker.close)
        with contextlib.closing(tracker):
            return JSONResponse(renderer.response(await tracker.run_to_end()))

    # -- steps shared by both endpoints

    def _check(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"The model `{req.model}` does not exist. This server serves "
                                f"{', '.join(f'`{n}`' for n in self.names)}.", param="model", code="model_not_found")
        error = req.unsupported_parameter()
        if error is not None:
            raise error

    def _params(self, req, limit: int | None, prompt_len: int, prompt_param: str) -> SamplingParams:
        """SamplingParams, once the prompt and the requested completion are known to fit the context.
        Without a limit the completion may take the rest of the context (vLLM's default for chat)."""
        context = self.engine.max_model_len
        if prompt_len >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, your {prompt_param} "
                                f"has {prompt_len} tokens: at most {context - 1} prompt tokens fit, leaving room for "
                                f"one completion token.", param=prompt_param, code="context_length_exceeded")
        if limit is not None and prompt_len + limit > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{prompt_len + limit} tokens ({prompt_len} in the {prompt_param}, {limit} in the "
                                f"completion): at most {context - prompt_len} completion tokens fit after this "
                                f"{prompt_param}.", param=prompt_param, code="context_length_exceeded")
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                max_tokens=limit if limit is not None else context - prompt_len,
                seed=req.seed,
                stop=req.stop_sequences(),
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    async def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt_param: str,
                      cache_salt: str | None) -> "_Tracker":
        started = time.monotonic()
        try:
            stream = await self.engine.add_request(request_id, prompt_ids, params, cache_salt)
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param, code="invalid_value") from None
        except QueueFullError as e:
            raise APIError(503, str(e), code="queue_full",
                           headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}) from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        return _Tracker(stream, params, started, self.metrics)


class _Tracker:
    """One accepted request: its output stream, its timings, and its cleanup (`close`, idempotent): abort
    if unfinished, count it in the metrics."""

    def __init__(self, stream: RequestStream, params: SamplingParams, started: float, metrics: ServerMetrics):
        self.stream, self.started, self.metrics = stream, started, metrics
        self.request_id = stream.request_id
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self._sent_chars = 0
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

    async def events(self, renderer: Renderer) -> AsyncIterator[str]:
        """SSE events: a chunk per step that made text (or tokens, with return_token_ids), the finishing chunk,
        usage if asked, `[DONE]`. An engine failure mid-stream becomes an error event (the status line is
        already sent)."""
        try:
            first = renderer.first_chunk()
            if first is not None:
                yield _sse(first)
            async for out in self.outputs():
                text = self._text_delta(out)
                if out.finished or text or (renderer.return_token_ids and out.new_token_ids):
                    yield _sse(renderer.chunk(out, text))
                if out.finished and renderer.include_usage:
                    yield _sse(renderer.usage_chunk(out))
        except RuntimeError as e:  # EngineStoppedError included
            status = 503 if isinstance(e, EngineStoppedError) else 500
            yield _sse(APIError(status, str(e), code="engine_unavailable" if status == 503 else "engine_error").to_dict())
        finally:
            self.close()
        yield "data: [DONE]\n\n"

    def _text_delta(self, out: RequestOutput) -> str:
        """The text to stream after this output: what the engine's text gained since the last event, less a
        tail as long as the longest stop string but one, which may yet turn out to begin a stop string (the
        engine cuts a completed stop string off its text, so that tail must not have been sent).
        Example, stop ["\\n\\n"]: text "a = 1\\n" streams "a = 1"; the next step's "\\n" completes the stop
        string, the text becomes "a = 1", and nothing more is sent. A slice of the text, never a re-decode."""
        end = len(out.text) if out.finished else max(self._sent_chars, len(out.text) - self.holdback)
        delta = out.text[self._sent_chars:end]
        self._sent_chars = end
        return delta

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stream.close()
        m = self.metrics
        m.running.labels(m.model_name).dec()
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        m.request_finished(self.finish_reason or "abort", self.num_tokens, ttft, time.monotonic() - self.started)


class _SSEResponse(StreamingResponse):
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


async def _with_cancellation(request: Request, handler) -> Response:
    """Run `handler` until it answers or the client disconnects (then cancel it: its request is aborted).
    A streaming answer is returned at once; its own response object watches the connection after that."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)  # nobody reads it: the client is gone
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- tokenization (run in a worker thread) ------------------------------------------------------------


def _chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # the template refused the conversation (raise_exception), or there is none
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                       code="invalid_value") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _completion_prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    vocab = tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in the prompt is outside the vocabulary [0, {vocab})", param="prompt",
                       code="invalid_value")
    return list(prompt)


# ---- helpers ------------------------------------------------------------------------------------------


async def _parse(request: Request, model: type[BaseModel]):
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)


# ---- ASGI middleware ----------------------------------------------------------------------------------


class _BodyTooLarge(Exception):
    pass


class _BodyLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, or while a chunked body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen, started = 0, False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body is larger than the limit of {self.max_bytes} bytes.",
                         code="request_too_large")
        await _error_response(error)(scope, receive, send)


class _ApiKeyAuth:
    """401 unless `Authorization: Bearer <api_key>` on /v1/* (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key")
                return await _error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class _CountAnswers:
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
