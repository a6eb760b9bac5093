"""The OpenAI-compatible HTTP app: `build_app(engine_client, served_model_name, api_key=None)`.

    POST /v1/chat/completions, POST /v1/completions   (JSON, or Server-Sent Events with "stream": true)
    POST /tokenize, /detokenize                         (vLLM's)
    GET  /v1/models, /health, /version, /metrics

Each request: validate (pydantic, strict) -> tokenize (in a worker thread, unless certainly longer than the
context) -> check the context fits ->
`AsyncEngine.add_request` -> read the engine's per-step outputs, answering them as one JSON body or as SSE
chunks of the text each step made decodable (`RequestOutput.new_text`, never the whole text re-decoded).
A client that goes away aborts its request; every error is an OpenAI error object with its status. A request
that finds the engine's queue full (`AsyncEngine(max_waiting_requests=N)`) is answered 503, code `queue_full`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.config import SamplingParams
from specdec.engine.outputs import RequestOutput
from specdec.engine.structured import Grammar
from specdec.fan_out import pick_best, sub_requests
from specdec.server import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_TIMEOUT_BODY
from specdec.server import anthropic
from specdec.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from specdec.server.limits import BodyDeadline, InFlightLimit
from specdec.server.metrics import CONTENT_TYPE, ServerMetrics
from specdec.server.protocol import (
    APIError, ChatCompletionRequest, ChatRenderer, CompletionRequest, CompletionRenderer,
    DetokenizeRequest, Renderer, TokenizeRequest, new_id, validation_error,
)
from specdec.server.responses import ResponseStore, ResponsesRequest, ResponseTranslator

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
    sampling_defaults: dict[str, Any] | None = None,
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    special_tokens_in_messages: bool = False,
    limit_concurrency: int | None = None,
    timeout_body: float = DEFAULT_TIMEOUT_BODY,
    public_metrics: bool = False,
    lenient_json_schemas: bool = False,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The app serving `engine_client` under `served_model_name` (the first of a list is the name answers
    carry; requests may use any). Starts the engine thread on startup and stops it on shutdown.
    `api_key` protects every route but /health (and /metrics with `public_metrics`, for a scraper without
    the key): /tokenize, /metrics and /openapi.json tell of the model and of other users. `sampling_defaults`
    (`--generation-config`) are the values of sampling parameters that requests leave out. A chat request
    without max_tokens generates `default_max_tokens` tokens at most (fewer where the context has less
    room; a `max_new_tokens` default comes first). Special-token text in chat messages is tokenized as
    plain text unless `special_tokens_in_messages`. At most `limit_concurrency` requests are answered at once
    (None: no limit; /health always is), and a body must arrive within `timeout_body` seconds of its head
    (`specdec.server.limits`). JSON schemas (response_format, required tool calls) allow only the properties
    they list unless they say otherwise, or `lenient_json_schemas` (then unless they ask for `strict`).
    /v1/messages (Anthropic's) and /v1/responses (OpenAI's) are translated into chat requests; stored
    responses are kept in `response_store` (bounded, in memory)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    metrics = metrics or ServerMetrics(names[0])
    engine_client.add_step_listener(metrics.on_step)
    server = _Server(engine_client, names, metrics, sampling_defaults or {}, default_max_tokens,
                     special_tokens_in_messages)
    server.lenient_json_schemas = lenient_json_schemas
    store = response_store if response_store is not None else ResponseStore()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_client.start()
        # the length bound that refuses megabyte prompts before tokenizing them measures the vocabulary
        # once (~1.5 s for 150k tokens): at start, not in the first request
        await asyncio.to_thread(engine_client.tokenizer.fewest_tokens, "")
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        return await _with_cancellation(request, server.chat(req))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        return await _with_cancellation(request, server.completion(req))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = await _parse(request, anthropic.MessagesRequest)
        return await _with_cancellation(request, server.translated(req.to_chat(),
                                                                   anthropic.MessageTranslator(names[0])))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> dict:
        req = await _parse(request, anthropic.CountTokensRequest)
        return {"input_tokens": await server.chat_prompt_length(req.to_chat(stream=False))}

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await _parse(request, ResponsesRequest)
        history = store.get(req.previous_response_id)[1] if req.previous_response_id else []
        translator = ResponseTranslator(req, names[0], history + req.input_messages(), store)
        return await _with_cancellation(request, server.translated(req.to_chat(history), translator))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return store.get(response_id, param="response_id")[0]

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await server.tokenize(await _parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await server.detokenize(await _parse(request, DetokenizeRequest))

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(server.started)
        cards = [{"id": n, "object": "model", "created": created, "owned_by": "specdec", "root": model_root or names[0],
                  "parent": None, "max_model_len": engine_client.max_model_len} for n in names]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health() -> Response:
        if not engine_client.healthy:
            return _error_response(APIError(503, "the engine is not running, or the server is shutting down",
                                            code="engine_unavailable"))
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
    app.add_middleware(BodyDeadline, timeout=timeout_body)
    if limit_concurrency is not None:
        app.add_middleware(InFlightLimit, limit=limit_concurrency)
    if api_key:
        app.add_middleware(_ApiKeyAuth, api_key=api_key,
                           open_paths=frozenset({"/health", "/metrics"} if public_metrics else {"/health"}))
    app.add_middleware(_CountAnswers, metrics=metrics, known_paths=known_paths)
    app.add_middleware(_InternalErrors)
    app.add_middleware(anthropic.ErrorShape)
    return app


# ---- serving a request --------------------------------------------------------------------------------


class _Server:
    def __init__(self, engine: AsyncEngine, names: list[str], metrics: ServerMetrics, defaults: dict[str, Any],
                 default_max_tokens: int, special_text: bool):
        self.engine, self.names, self.metrics, self.defaults = engine, names, metrics, defaults
        self.default_max_tokens, self.special_text = default_max_tokens, special_text
        self.lenient_json_schemas = False
        self.started = time.time()

    async def chat(self, req: ChatCompletionRequest) -> Response:
        request, renderer = await self.start_chat(req)
        return await self._answer(req, request, renderer)

    async def translated(self, req: ChatCompletionRequest, translator) -> Response:
        """A chat request answered in another API's shape (/v1/messages, /v1/responses): `translator` turns
        the chat answer into its body (`response(chat body)`) or its stream into that API's SSE events
        (`events(chat chunks, prompt length)`, the chunks ending with the usage chunk, an APIError raised
        mid-stream). Its `max_tokens` is a ceiling: the answer may stop at the end of the context."""
        request, renderer = await self.start_chat(req, fit_context=True)
        if req.stream:
            return _SSEResponse(translator.events(request.chunks(renderer), len(request.prompt_ids[0])),
                                request.close)
        with contextlib.closing(request):
            return JSONResponse(translator.response(renderer.response(await request.run_to_end())))

    async def chat_prompt_length(self, req: ChatCompletionRequest) -> int:
        """The number of tokens of the chat request's prompt (/v1/messages/count_tokens)."""
        req.tool_parser()  # refuses a tool_choice that names no declared tool
        ids = await asyncio.to_thread(_chat_prompt_ids, self.engine.tokenizer, req.template_messages(),
                                      req.template_tools(), special_text=self.special_text)
        return len(ids)

    async def start_chat(self, req: ChatCompletionRequest, fit_context: bool = False
                         ) -> tuple["_Request", ChatRenderer]:
        """The chat request submitted to the engine, and the renderer of its answer. `fit_context`: a
        completion limit beyond the context's room is cut to that room instead of refused."""
        self._check(req)
        tool_parser = req.tool_parser()
        prompt_ids = await asyncio.to_thread(_chat_prompt_ids, self.engine.tokenizer, req.template_messages(),
                                             req.template_tools(), context=self.engine.max_model_len,
                                             special_text=self.special_text)
        limit = req.output_limit()
        if fit_context and limit is not None:
            limit = max(1, min(limit, self.engine.max_model_len - len(prompt_ids)))
        params = await self._params(req, limit, [prompt_ids], "messages", logprobs=req.num_logprobs(),
                                    response_format=req.tool_call_format())
        request = await self._submit(new_id("chatcmpl"), [prompt_ids], params, "messages", req.cache_salt)
        return request, self._renderer(req, request, ChatRenderer, tool_parser=tool_parser)

    async def completion(self, req: CompletionRequest) -> Response:
        self._check(req)
        prompt_ids = [await asyncio.to_thread(_completion_prompt_ids, self.engine.tokenizer, p,
                                              context=self.engine.max_model_len) for p in req.prompts()]
        echo_logprobs = req.logprobs if req.echo else None
        params = await self._params(req, req.output_limit(), prompt_ids, "prompt", logprobs=req.logprobs,
                                    prompt_logprobs=echo_logprobs)
        request = await self._submit(new_id("cmpl"), prompt_ids, params, "prompt", req.cache_salt)
        return await self._answer(req, request, self._renderer(req, request, CompletionRenderer))

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """The prompt's tokens, up to the context's length: a longer text is refused, at once where it
        certainly is longer (`_refuse_if_too_long`), as the generation routes refuse it."""
        if req.model is not None and req.model not in self.names:
            self._check(req)
        tokenizer, context = self.engine.tokenizer, self.engine.max_model_len
        if req.messages is not None:
            param = "messages"
            ids = await asyncio.to_thread(_chat_prompt_ids, tokenizer, req.template_messages(), None,
                                          req.add_generation_prompt, context=context, special_text=self.special_text,
                                          completion_room=0)
        else:
            param = "prompt"
            _refuse_if_too_long(tokenizer, req.prompt, context, param, completion_room=0)
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
        if len(ids) > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, your {param} "
                                f"has {len(ids)} tokens.", param=param, code="context_length_exceeded")
        return {"count": len(ids), "max_model_len": context, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        """The text of up to the context's length of tokens (no prompt or output of this server is longer)."""
        context = self.engine.max_model_len
        if len(req.tokens) > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you gave "
                                f"{len(req.tokens)} tokens.", param="tokens", code="context_length_exceeded")
        ids = _completion_prompt_ids(self.engine.tokenizer, req.tokens, param="tokens") if req.tokens else []
        return {"prompt": await asyncio.to_thread(self.engine.tokenizer.decode, ids)}

    def _renderer(self, req, request: "_Request", renderer_type: type[Renderer], **options) -> Renderer:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tokenizer = self.engine.tokenizer
        return renderer_type(request.request_id, self.names[0], include_usage=include_usage,
                             return_token_ids=req.return_token_ids,
                             token_text=lambda t: tokenizer.decode([t]),
                             echo=[tokenizer.decode(ids) for ids in request.prompt_ids]
                             if getattr(req, "echo", False) else None, n=request.params.n, **options)

    async def _answer(self, req, request: "_Request", renderer: Renderer) -> Response:
        if req.stream:
            return _SSEResponse(request.events(renderer), request.close)
        with contextlib.closing(request):
            return JSONResponse(renderer.response(await request.run_to_end()))

    # -- steps shared by both endpoints

    def _check(self, req) -> None:
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"The model `{req.model}` does not exist. This server serves "
                                f"{', '.join(f'`{n}`' for n in self.names)}.", param="model", code="model_not_found")
        error = req.unsupported_parameter() if hasattr(req, "unsupported_parameter") else None
        if error is not None:
            raise error

    async def _params(self, req, limit: int | None, prompt_ids: list[list[int]], prompt_param: str,
                      logprobs: int | None = None, prompt_logprobs: int | None = None,
                      response_format: dict | None = None) -> SamplingParams:
        """SamplingParams, once every prompt and the requested completion are known to fit the context.
        Without a limit the completion takes `default_max_tokens` or the rest of the context if less. A grammar
        (response_format) is compiled here, off the engine's thread, and refused here if it is invalid."""
        context = self.engine.max_model_len
        for ids in prompt_ids:
            prompt_len = len(ids)
            if prompt_len >= context:
                raise APIError(400, f"This model's maximum context length is {context} tokens. However, your "
                                    f"{prompt_param} has {prompt_len} tokens: at most {context - 1} prompt tokens fit, "
                                    f"leaving room for one completion token.", param=prompt_param,
                               code="context_length_exceeded")
            if limit is not None and prompt_len + limit > context:
                raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                    f"{prompt_len + limit} tokens ({prompt_len} in the {prompt_param}, {limit} in the "
                                    f"completion): at most {context - prompt_len} completion tokens fit after this "
                                    f"{prompt_param}.", param=prompt_param, code="context_length_exceeded")
        fields = req.sampling_fields(self.defaults)
        if response_format is not None:
            fields["response_format"] = response_format
        if self.lenient_json_schemas and (fields["response_format"] or {}).get("type") == "json_schema":
            spec = fields["response_format"]["json_schema"]
            if isinstance(spec, dict) and "strict" not in spec:  # the server's default, unless the request says
                fields["response_format"] = {**fields["response_format"], "json_schema": {**spec, "strict": False}}
        vocab = self.engine.vocab_size
        for name, ids in (("logit_bias", list(fields["logit_bias"])), ("stop_token_ids", fields["stop_token_ids"])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} in {name} is outside the vocabulary [0, {vocab})", param=name,
                               code="invalid_value")
        try:
            if limit is None and "max_new_tokens" in self.defaults:
                limit = min(self.defaults["max_new_tokens"], context - max(len(ids) for ids in prompt_ids))
            params = SamplingParams(
                max_tokens=limit if limit is not None else
                min(self.default_max_tokens, context - max(len(ids) for ids in prompt_ids)),
                seed=req.seed,
                stop=req.stop_sequences(),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                **fields,
            )
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        if params.response_format is not None:
            try:
                await asyncio.to_thread(Grammar.from_response_format, params.response_format, self.engine.tokenizer,
                                        self.engine.vocab_size)
            except ValueError as e:
                raise APIError(400, str(e), param="response_format", code="invalid_value") from None
        return params

    async def _submit(self, request_id: str, prompt_ids: list[list[int]], params: SamplingParams, prompt_param: str,
                      cache_salt: str | None = None) -> "_Request":
        """One engine request per sequence: `fan_out(params)` of them for each prompt (`sub_requests`)."""
        request = _Request(request_id, prompt_ids, params)
        try:
            plan = sub_requests(prompt_ids, params, lambda i, j: request_id if len(prompt_ids) == 1 and j == 0
                                else f"{request_id}-{i}-{j}")
            for sub in (sub for group in plan for sub in group):
                started = time.monotonic()
                stream = await self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params, cache_salt)
                request.trackers[sub.prompt_index].append(_Tracker(stream, started, self.metrics))
                _REACHED_ENGINE.get([False])[0] = True  # its tracker counts it from now on
        except BaseException as e:
            request.close()
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=prompt_param, code="invalid_value") from None
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), code="queue_full",
                               headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}) from None
            if isinstance(e, EngineStoppedError):
                raise APIError(503, str(e), code="engine_unavailable") from None
            raise
        return request


class _Request:
    """The engine requests one API request runs: for each prompt, its sequences (`fan_out`). Choices are
    numbered prompt by prompt, n each: choice i * n + j is sequence j of prompt i (with best_of > n, the
    j-th best)."""

    def __init__(self, request_id: str, prompt_ids: list[list[int]], params: SamplingParams):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.trackers: list[list[_Tracker]] = [[] for _ in prompt_ids]

    def _all(self) -> list["_Tracker"]:
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
                yield _sse(chunk)
        except APIError as e:
            yield _sse(e.to_dict())
        yield "data: [DONE]\n\n"

    async def chunks(self, renderer: Renderer) -> AsyncIterator[dict]:
        """The chunks of every choice as its sequence makes them (choices interleave), then usage if asked.
        An engine failure raises APIError (503 if the engine stopped, else 500)."""
        indexed = [(i * self.params.n + j, t) for i, group in enumerate(self.trackers) for j, t in enumerate(group)]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, tracker: _Tracker) -> None:
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


class _Tracker:
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


# [reached]: set by `_with_cancellation` for the handler's task (which copies the context), made True by
# `_submit` once the engine has taken the request: from then on its trackers count how it ends
_REACHED_ENGINE: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("_REACHED_ENGINE")


async def _with_cancellation(request: Request, handler) -> Response:
    """Run `handler` until it answers or the client disconnects (then cancel it: its request is aborted).
    A streaming answer is returned at once; its own response object watches the connection after that.
    A client gone before the engine took its request is counted here as an aborted request (499)."""
    started, reached = time.monotonic(), [False]
    token = _REACHED_ENGINE.set(reached)
    try:
        task = asyncio.ensure_future(handler)
    finally:
        _REACHED_ENGINE.reset(token)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if not reached[0]:
            request.app.state.server.metrics.request_finished("abort", 0, None, time.monotonic() - started)
        return Response(status_code=499)  # nobody reads it: the client is gone
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- tokenization (run in a worker thread) ------------------------------------------------------------


def _chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                     add_generation_prompt: bool = True, context: int | None = None,
                     special_text: bool = False, completion_room: int = 1) -> list[int]:
    """The conversation's prompt ids; special-token text in the messages stays plain text unless
    `special_text` (see `Tokenizer.render_chat`). Refused at once if certainly longer than `context` less
    `completion_room`."""
    try:
        parts = tokenizer.render_chat(messages, add_generation_prompt, special_text, tools=tools)
    except Exception as e:  # the template refused the conversation (raise_exception), or there is none
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                       code="invalid_value") from None
    _refuse_if_too_long(tokenizer, "".join(text for text, _ in parts), context, "messages", completion_room)
    return tokenizer.encode_parts(parts)


def _completion_prompt_ids(tokenizer, prompt: str | list[int], param: str = "prompt", context: int | None = None
                           ) -> list[int]:
    if isinstance(prompt, str):
        _refuse_if_too_long(tokenizer, prompt, context, param)
        return tokenizer.encode(prompt, add_special_tokens=True)
    vocab = tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in the {param} is outside the vocabulary [0, {vocab})", param=param,
                       code="invalid_value")
    return list(prompt)


def _refuse_if_too_long(tokenizer, text: str, context: int | None, param: str, completion_room: int = 1) -> None:
    """Refuse, before tokenizing it, a `text` that certainly does not fit the `context` with
    `completion_room` tokens to spare (`Tokenizer.fewest_tokens`), as the context check after tokenizing
    would (a 3 MB prompt took 3.6 s to tokenize)."""
    if context is not None and (at_least := tokenizer.fewest_tokens(text)) > context - completion_room:
        room = ", leaving room for one completion token" if completion_room else ""
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, your {param} has "
                            f"at least {at_least} tokens ({len(text)} characters): at most "
                            f"{context - completion_room} prompt tokens fit{room}.", param=param,
                       code="context_length_exceeded")


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
                return await _error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class _InternalErrors:
    """A bug answering a request: the client gets a generic 500 with an id to quote (also in X-Request-Id), the
    log the traceback under that id. Not re-raised (as Starlette's handler of Exception would, making the
    server drop the connection), unless the response had begun: then only cutting it short is left."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            error_id = new_id("err")
            logger.exception("internal error %s answering %s %s", error_id, scope["method"], scope["path"])
            if started:
                raise
            error = APIError(500, f"The server had an error while processing your request. Quote {error_id} to "
                                  f"its operator, whose log has the details.", code="internal_error",
                             headers={"X-Request-Id": error_id})
            await _error_response(error)(scope, receive, send)


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
