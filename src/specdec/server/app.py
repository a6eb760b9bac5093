"""The OpenAI-compatible HTTP app: `build_app(engine_client, served_model_name, api_key=None)`.

    POST /v1/chat/completions, POST /v1/completions   (JSON, or Server-Sent Events with "stream": true)
    POST /v1/messages, /v1/messages/count_tokens      (Anthropic's, translated: `anthropic`)
    POST /v1/responses, GET /v1/responses/{id}         (OpenAI's Responses, translated: `responses`)
    POST /tokenize, /detokenize                         (vLLM's)
    GET  /v1/models, /health, /version, /metrics

Each request: validate (pydantic, strict) -> tokenize (in a worker thread, unless certainly longer than the
context) -> check the context fits ->
`AsyncEngine.add_request` -> read the engine's per-step outputs, answering them as one JSON body or as SSE
chunks of the text each step made decodable (`RequestOutput.new_text`, never the whole text re-decoded).
A client that goes away aborts its request; every error is an OpenAI error object with its status. A request
that finds the engine's queue full (`AsyncEngine(max_waiting_requests=N)`) is answered 503, code `queue_full`.
Beside it: `prompts` (prompt ids, refusing certainly over-long text before tokenizing), `request_params` (a
request's SamplingParams, in named steps), `streams` (a request's way through the engine and back,
cancellation), `limits` and `middleware` (what wraps every route).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import SamplingParams
from specdec.engine import structured
from specdec.fan_out import sub_requests
from specdec.server import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_TIMEOUT_BODY
from specdec.server import anthropic
from specdec.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from specdec.server.limits import BodyDeadline, BodyLimit, InFlightLimit
from specdec.server.metrics import CONTENT_TYPE, ServerMetrics
from specdec.server.middleware import ApiKeyAuth, CountAnswers, InternalErrors
from specdec.server.prompts import chat_prompt_ids, completion_prompt_ids, refuse_if_too_long
from specdec.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, ContextLengthError, DetokenizeRequest, TokenizeRequest, new_id,
    validation_error,
)
from specdec.server.renderers import ChatRenderer, CompletionRenderer, Renderer
from specdec.server.request_params import (
    build_params, check_grammar, check_vocabulary, completion_limit, prompts_fit, request_fields,
)
from specdec.server.responses import ResponseStore, ResponsesRequest, ResponseTranslator
from specdec.server.streams import ApiRequest, SSEResponse, Tracker, engine_took_request, with_cancellation

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
    responses_db: str | None = None,
    responses_retention_s: float | None = None,
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
    responses are kept in `response_store` (bounded; default: in memory, or in the SQLite file `responses_db`), each under its request's `cache_salt`
    (`GET /v1/responses/{id}?cache_salt=...` reads a salted one)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    metrics = metrics or ServerMetrics(names[0])
    engine_client.add_step_listener(metrics.on_step)
    prefix = getattr(getattr(engine_client, "engine", None), "prefix_cache", None)
    if getattr(prefix, "disk", None) is not None:
        metrics.watch_disk(prefix.disk)
    server = _Server(engine_client, names, metrics, sampling_defaults or {}, default_max_tokens,
                     special_tokens_in_messages)
    server.lenient_json_schemas = lenient_json_schemas
    store = response_store if response_store is not None else \
        ResponseStore(path=responses_db, retention_s=responses_retention_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_client.start()
        # the length bound that refuses megabyte prompts before tokenizing them measures the vocabulary
        # once (~1.5 s for 150k tokens): at start, not in the first request
        await asyncio.to_thread(engine_client.tokenizer.fewest_tokens, "")
        vocab_size = getattr(getattr(engine_client, "engine", None), "vocab_size", None)
        if vocab_size is not None:  # llguidance's view of the tokenizer (~1 s), for structured output's grammars
            await asyncio.to_thread(structured.prepare, engine_client.tokenizer, vocab_size)
        try:
            yield
        finally:
            await asyncio.to_thread(engine_client.shutdown)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if request.url.path.startswith(anthropic.PATH):  # in Anthropic's words, from the error's own numbers
            return JSONResponse(anthropic.error_body(e), status_code=e.status, headers=e.headers)
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail), code=None).response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        return await with_cancellation(request, server.chat(req))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        return await with_cancellation(request, server.completion(req))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = await _parse(request, anthropic.MessagesRequest)
        translator = anthropic.MessageTranslator(names[0], req.max_tokens, engine_client.max_model_len)
        return await with_cancellation(request, server.translated(req.to_chat(), translator))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> dict:
        req = await _parse(request, anthropic.CountTokensRequest)
        return {"input_tokens": await server.chat_prompt_length(req.to_chat(stream=False))}

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await _parse(request, ResponsesRequest)
        history = store.get(req.previous_response_id, scope=req.cache_salt)[1] if req.previous_response_id else []
        translator = ResponseTranslator(req, names[0], history + req.input_messages(), store)
        return await with_cancellation(request, server.translated(req.to_chat(history), translator))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, cache_salt: str | None = None) -> dict:
        return store.get(response_id, param="response_id", scope=cache_salt)[0]

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
            return APIError(503, "the engine is not running, or the server is shutting down",
                            code="engine_unavailable").response()
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
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BodyDeadline, timeout=timeout_body)
    if limit_concurrency is not None:
        app.add_middleware(InFlightLimit, limit=limit_concurrency)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key,
                           open_paths=frozenset({"/health", "/metrics"} if public_metrics else {"/health"}))
    app.add_middleware(CountAnswers, metrics=metrics, known_paths=known_paths)
    app.add_middleware(InternalErrors)
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
        mid-stream). Its `max_tokens` is a ceiling: the answer may stop at the end of the context. A prompt
        longer than the context is refused as that API refuses it: a 400 before any event, unless the
        translator streams the refusal (`refused_stream`: a Responses stream's `response.failed`)."""
        try:
            request, renderer = await self.start_chat(req, fit_context=True, param=translator.prompt_param)
        except ContextLengthError as e:
            refusal = translator.refused_stream(e) if req.stream else None
            if refusal is None:
                raise
            return SSEResponse(refusal, lambda: None)
        if req.stream:
            return SSEResponse(translator.events(request.chunks(renderer), len(request.prompt_ids[0])),
                                request.close)
        with contextlib.closing(request):
            return JSONResponse(translator.response(renderer.response(await request.run_to_end())))

    async def chat_prompt_length(self, req: ChatCompletionRequest) -> int:
        """The number of tokens of the chat request's prompt (/v1/messages/count_tokens)."""
        req.tool_parser()  # refuses a tool_choice that names no declared tool
        ids = await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer, req.template_messages(),
                                      req.template_tools(), special_text=self.special_text)
        return len(ids)

    async def start_chat(self, req: ChatCompletionRequest, fit_context: bool = False, param: str = "messages"
                         ) -> tuple["ApiRequest", ChatRenderer]:
        """The chat request submitted to the engine, and the renderer of its answer. `fit_context`: a
        completion limit beyond the context's room is cut to that room instead of refused. Errors about
        the prompt name `param` (the request's field that held the messages: `input` for /v1/responses)."""
        self._check(req)
        tool_parser = req.tool_parser()
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer, req.template_messages(),
                                             req.template_tools(), context=self.engine.max_model_len,
                                             special_text=self.special_text, param=param)
        limit, room = req.output_limit(), self.engine.max_model_len - len(prompt_ids)
        if fit_context and limit is not None:
            limit = max(1, min(limit, room))
        # a translated request without a limit (a Responses request without max_output_tokens: Codex sends
        # none) may take the rest of the context, as OpenAI's and llama.cpp's servers answer it: Codex fails
        # the turn on an answer cut short (`incomplete`), so chat's bounded default would end the session
        default = max(1, room) if fit_context else self.default_max_tokens
        params = await self._params(req, limit, [prompt_ids], param, logprobs=req.num_logprobs(),
                                    response_format=req.tool_call_format(), default_max_tokens=default)
        request = await self._submit(new_id("chatcmpl"), [prompt_ids], params, param, req.cache_salt)
        return request, self._renderer(req, request, ChatRenderer, tool_parser=tool_parser)

    async def completion(self, req: CompletionRequest) -> Response:
        self._check(req)
        prompt_ids = [await asyncio.to_thread(completion_prompt_ids, self.engine.tokenizer, p,
                                              context=self.engine.max_model_len) for p in req.prompts()]
        echo_logprobs = req.logprobs if req.echo else None
        params = await self._params(req, req.output_limit(), prompt_ids, "prompt", logprobs=req.logprobs,
                                    prompt_logprobs=echo_logprobs)
        request = await self._submit(new_id("cmpl"), prompt_ids, params, "prompt", req.cache_salt)
        return await self._answer(req, request, self._renderer(req, request, CompletionRenderer))

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """The prompt's tokens, up to the context's length: a longer text is refused, at once where it
        certainly is longer (`refuse_if_too_long`), as the generation routes refuse it."""
        if req.model is not None and req.model not in self.names:
            self._check(req)
        tokenizer, context = self.engine.tokenizer, self.engine.max_model_len
        if req.messages is not None:
            param = "messages"
            ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, req.template_messages(), None,
                                          req.add_generation_prompt, context=context, special_text=self.special_text,
                                          completion_room=0)
        else:
            param = "prompt"
            refuse_if_too_long(tokenizer, req.prompt, context, param, completion_room=0)
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
        if len(ids) > context:
            raise ContextLengthError(context, len(ids), param)
        return {"count": len(ids), "max_model_len": context, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        """The text of up to the context's length of tokens (no prompt or output of this server is longer)."""
        context = self.engine.max_model_len
        if len(req.tokens) > context:
            raise ContextLengthError(context, len(req.tokens), "tokens")
        ids = completion_prompt_ids(self.engine.tokenizer, req.tokens, param="tokens") if req.tokens else []
        return {"prompt": await asyncio.to_thread(self.engine.tokenizer.decode, ids)}

    def _renderer(self, req, request: "ApiRequest", renderer_type: type[Renderer], **options) -> Renderer:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tokenizer = self.engine.tokenizer
        return renderer_type(request.request_id, self.names[0], include_usage=include_usage,
                             return_token_ids=req.return_token_ids,
                             token_text=lambda t: tokenizer.decode([t]),
                             echo=[tokenizer.decode(ids) for ids in request.prompt_ids]
                             if getattr(req, "echo", False) else None, n=request.params.n, **options)

    async def _answer(self, req, request: "ApiRequest", renderer: Renderer) -> Response:
        if req.stream:
            return SSEResponse(request.events(renderer), request.close)
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
                      response_format: dict | None = None, default_max_tokens: int | None = None
                      ) -> SamplingParams:
        """SamplingParams, once every prompt and the requested completion are known to fit the context: the
        steps of `request_params`, in this order (the order the errors come in). Without a limit the
        completion takes the server's default (`default_max_tokens`, else the server's) or the rest of the
        context if less. A grammar (response_format) is compiled here, off the engine's thread, and refused
        here if it is invalid."""
        context = self.engine.max_model_len
        prompts_fit(prompt_ids, limit, context, prompt_param)
        fields = request_fields(req, self.defaults, response_format, self.lenient_json_schemas)
        check_vocabulary(fields, self.engine.vocab_size)
        max_tokens = completion_limit(limit, prompt_ids, context, self.defaults,
                                      default_max_tokens or self.default_max_tokens)
        params = build_params(req, fields, max_tokens, logprobs, prompt_logprobs)
        await check_grammar(params, self.engine.tokenizer, self.engine.vocab_size)
        return params

    async def _submit(self, request_id: str, prompt_ids: list[list[int]], params: SamplingParams, prompt_param: str,
                      cache_salt: str | None = None) -> "ApiRequest":
        """One engine request per sequence: `fan_out(params)` of them for each prompt (`sub_requests`)."""
        request = ApiRequest(request_id, prompt_ids, params)
        try:
            plan = sub_requests(prompt_ids, params, lambda i, j: request_id if len(prompt_ids) == 1 and j == 0
                                else f"{request_id}-{i}-{j}")
            for sub in (sub for group in plan for sub in group):
                started = time.monotonic()
                stream = await self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params, cache_salt)
                request.trackers[sub.prompt_index].append(Tracker(stream, started, self.metrics))
                engine_took_request()  # its tracker counts it from now on
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


# ---- helpers ------------------------------------------------------------------------------------------


async def _parse(request: Request, model: type[BaseModel]):
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None

