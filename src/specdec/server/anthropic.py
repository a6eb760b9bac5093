"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation of chat requests.

A Messages request becomes a `ChatCompletionRequest` (`MessagesRequest.to_chat`), answered by the chat path
unchanged (chat template, tool parsing, structured output, speculation, prefix caching); its answer, whole
or streamed, is translated back (`MessageTranslator`). Example:

    {"model": "any", "max_tokens": 64, "system": "Be brief.",
     "messages": [{"role": "user", "content": "Weather in Paris?"}],
     "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {...}}}]}
    -> chat: [{"role": "system", ...}, {"role": "user", ...}], tools [{"type": "function", "function": {...}}]
    <- chat: {"message": {"tool_calls": [{"id": "call_1f..", "function": {"name": "get_weather", ...}}]},
              "finish_reason": "tool_calls"}
    -> {"type": "message", "content": [{"type": "tool_use", "id": "toolu_1f..", "name": "get_weather",
        "input": {...}}], "stop_reason": "tool_use", ...}

Fields this API has and specdec does not use are ignored, as Anthropic's own unknown beta fields are
(`cache_control`, `context_management`, `service_tier`, ...); what would change the answer and cannot be
done (images, documents, server tools, thinking with a budget) is refused with a 400 that says so;
`thinking: {"type": "adaptive"}` (Claude Code's default: the model decides) is answered without thinking.
`output_config.format` (a JSON schema) is the chat path's response_format. The `model`
is not checked: Anthropic clients send their own model names, and the served model answers them all.
Errors have Anthropic's shape (`ErrorShape`, for every error on these paths, the middleware's included); a
prompt longer than the context is Anthropic's "prompt is too long: N tokens > M maximum" (`error_body`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.keepalive import DEFAULT_INTERVAL_S, with_heartbeats
from specdec.server.protocol import APIError, ChatCompletionRequest, ContextLengthError, validation_error

PATH = "/v1/messages"


class _Open(BaseModel):
    """Known fields strictly typed; unknown ones (beta fields, `cache_control`) ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class UnsupportedBlock(_Open):
    """What this server cannot read: refused with a 400 naming it."""

    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result", "container_upload"]


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(_text_only(self.content, "tool_result content"))


class ThinkingBlock(_Open):
    """An earlier answer's thinking, sent back by a client: dropped (this model does not think in blocks)."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnsupportedBlock,
                  Field(discriminator="type")]


class InputMessage(_Open):
    role: Literal["user", "assistant", "system"]  # system: text among the turns, as Claude Code sends it
    content: str | list[Block]


class ToolDefinition(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" (or absent): a client tool; anything else is a server tool


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Open):
    user_id: str | None = None


class Thinking(_Open):
    type: str  # "enabled" (with budget_tokens), "adaptive" (the model decides), "disabled"
    budget_tokens: int | None = None


class OutputFormat(_Open):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    format: OutputFormat | None = None  # structured output; `effort` and the rest are ignored


BILLING_HEADER = "x-anthropic-billing-header:"


def without_billing_header(system: str | list[TextBlock] | None) -> str:
    """The system text, less Claude Code's billing line (`x-anthropic-billing-header: cc_version=2.1.197.123;
    cc_entrypoint=sdk-cli;`, a block of its own, or the string's first line): attribution for Anthropic's API, not
    an instruction to the model. Its version suffix follows the session's first prompt (and `cch=`, in some
    versions, every request), and it comes first: left in, no two sessions would share a cached token
    (`benchmarks/bench_session_prefix.py`). Local servers and gateways drop it for the same reason.
    Example: ["x-anthropic-billing-header: cc_version=1;", "You are Claude Code."] -> "You are Claude Code."."""
    if not system:
        return ""
    if isinstance(system, str):
        first, _, rest = system.partition("\n")
        return rest if first.startswith(BILLING_HEADER) else system
    return "\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))


class MessagesRequest(_Open):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's earlier place for it

    def to_chat(self, stream: bool | None = None) -> ChatCompletionRequest:
        """The chat request this asks for. 400 for what cannot be honoured (see the module's docstring)."""
        if self.thinking is not None and self.thinking.type not in ("disabled", "adaptive"):
            raise APIError(400, f"thinking ({self.thinking.type!r}) is not supported by this model: it answers "
                                "without thinking blocks; leave `thinking` out or set its type to \"disabled\" (or "
                                "\"adaptive\", which lets the model decide: this one never thinks in blocks)",
                           param="thinking", code="unsupported_parameter")
        messages: list[dict[str, Any]] = []
        system = without_billing_header(self.system)
        if system:
            messages.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{i}]")
        stream = self.stream if stream is None else stream
        body: dict[str, Any] = {
            "messages": messages, "max_tokens": self.max_tokens, "stream": stream,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "stop": self.stop_sequences,
            "user": self.metadata.user_id if self.metadata is not None else None,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_chat_tool_choice(self.tool_choice))
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt or self.output_format:
            schema = (fmt or self.output_format).schema_
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise validation_error(e) from None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # not part of a count request


def _chat_messages(message: InputMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (in order, around the
    user's text); an assistant's tool_use blocks become its `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "system":
        return [{"role": "system", "content": "\n".join(_text_only(message.content, f"{where}.content"))}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, UnsupportedBlock):
            raise APIError(400, f"{block.type} blocks are not supported by this server (it reads text only)",
                           param=f"{where}.content[{j}]", code="unsupported_parameter")
        if isinstance(block, ThinkingBlock):
            continue
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(400, "tool_use blocks belong in assistant messages", param=f"{where}.content[{j}]",
                               code="invalid_value")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:  # a tool result
            if message.role != "user":
                raise APIError(400, "tool_result blocks belong in user messages", param=f"{where}.content[{j}]",
                               code="invalid_value")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            content = block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {content}" if block.is_error else content})
    if message.role == "assistant":
        if texts or calls:
            out.append({"role": "assistant", "content": "\n".join(texts) if texts else None,
                        **({"tool_calls": calls} if calls else {})})
    elif texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _text_only(blocks: list, where: str) -> list[str]:
    for block in blocks:
        if not isinstance(block, TextBlock):
            raise APIError(400, f"{block.type} blocks are not supported in {where} (text only)", param=where,
                           code="unsupported_parameter")
    return [block.text for block in blocks]


def _chat_tool(tool: ToolDefinition, where: str) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise APIError(400, f"the server tool {tool.type!r} is not supported: declare client tools (name, "
                            "description, input_schema)", param=f"{where}.type", code="unsupported_parameter")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, 'tool_choice {"type": "tool"} needs the tool\'s name', param="tool_choice.name",
                           code="invalid_value")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


# ---- chat answers -> Anthropic messages --------------------------------------------------------------------

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop(finish_reason: str | None, stop_string: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and vLLM's stop_reason."""
    if isinstance(stop_string, str):
        return "stop_sequence", stop_string
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are those not read from the (prefix) cache."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage["completion_tokens"]}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


class MessageTranslator:
    """One request's chat answer as an Anthropic message (`response`) or event stream (`events`), for a
    request that asked for `max_tokens` from a model of `context` tokens.

    A `max_tokens` beyond the context's room is cut to that room (`_Server.translated`), and an answer that
    runs to the end of the context stops with `stop_reason: "model_context_window_exceeded"`. Anthropic has
    answered such a request two ways, and Claude Code (2.1.197's cli.js) handles both: a 400 "input length
    and `max_tokens` exceed context limit: N + M > L", after which it retries with a smaller max_tokens,
    and that stop reason (also in the anthropic SDK's StopReason), which it reports as "The model has
    reached its context window limit". The second needs no second request; Claude Code asks for 32000
    tokens whatever the model. A prompt that alone does not fit is refused with a 400 before any event:
    "prompt is too long: N tokens > M maximum" (`error_body`), which makes Claude Code compact."""

    prompt_param = "messages"

    def __init__(self, model: str, max_tokens: int, context: int, heartbeat_s: float = DEFAULT_INTERVAL_S):
        self.model, self.max_tokens, self.context, self.heartbeat_s = model, max_tokens, context, heartbeat_s
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def refused_stream(self, e: ContextLengthError) -> None:
        """None: Anthropic refuses a prompt too long for the context with an HTTP error, not in a stream."""
        return None

    def _stop(self, choice: dict[str, Any], prompt_tokens: int) -> tuple[str, str | None]:
        reason, sequence = _stop(choice["finish_reason"], choice.get("stop_reason"))
        if reason == "max_tokens" and self.max_tokens > self.context - prompt_tokens:  # the limit was cut
            return "model_context_window_exceeded", None
        return reason, sequence

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message["content"] else []
        content += [_tool_use(call) for call in message.get("tool_calls") or ()]
        return self._message(content, *self._stop(choice, chat["usage"]["prompt_tokens"]), _usage(chat["usage"]))

    async def events(self, chunks: AsyncIterator[dict], prompt_tokens: int) -> AsyncIterator[str]:
        """message_start, ping, then per content block content_block_start / _delta / _stop (text as it
        comes; a tool call, complete, as one input_json_delta), message_delta (stop_reason, usage),
        message_stop; a `ping` too every `heartbeat_s` seconds without a chunk. An error mid-stream is an
        `error` event, and the stream ends."""
        usage = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 "output_tokens": 0}
        yield _event("message_start", {"type": "message_start", "message": self._message([], None, None, usage)})
        yield _event("ping", {"type": "ping"})
        index, text_open, stop = 0, False, ("end_turn", None)
        try:
            async for chunk in with_heartbeats(chunks, self.heartbeat_s):
                if chunk is None:  # the engine is silent (a long prefill): a ping for the client's watchdog
                    yield _event("ping", {"type": "ping"})
                    continue
                if chunk.get("usage"):
                    if text_open:
                        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    reason, sequence = stop
                    yield _event("message_delta", {"type": "message_delta",
                                                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                   "usage": _usage(chunk["usage"])})
                    yield _event("message_stop", {"type": "message_stop"})
                    return
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    if delta.get("content"):
                        if not text_open:
                            yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": "text", "text": ""}})
                            text_open = True
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "text_delta", "text": delta["content"]}})
                    for call in delta.get("tool_calls") or ():
                        if text_open:
                            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                            index, text_open = index + 1, False
                        block = {**_tool_use(call), "input": {}}
                        yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": block})
                        yield _event("content_block_delta", {
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
                        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        index += 1
                    if choice["finish_reason"] is not None:
                        stop = self._stop(choice, prompt_tokens)
        except APIError as e:
            yield _event("error", error_body(e))


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- errors --------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, the type by status as Anthropic's. A context
    overflow in Anthropic's words, the numbers where Claude Code reads them (2.1.197's cli.js: "prompt is too
    long" starts its compaction, and the two numbers after it, "N tokens > M", size what it drops). Example:

        error_body(ContextLengthError(32768, 40000, "messages"))
        -> {"type": "error", "error": {"type": "invalid_request_error",
                                       "message": "prompt is too long: 40000 tokens > 32768 maximum"}}
    """
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    if isinstance(e, ContextLengthError):
        message = _context_message(e)
    else:
        message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def _context_message(e: ContextLengthError) -> str:
    if e.completion_tokens:  # (max_tokens is cut to the room here, so only a caller that does not cut sees it)
        return (f"input length and `max_tokens` exceed context limit: {e.prompt_tokens} + {e.completion_tokens} > "
                f"{e.context}, decrease input length or `max_tokens` and try again")
    # a prompt of exactly the context is refused too (the answer needs a token): its maximum is one less
    maximum = e.context if e.prompt_tokens > e.context else e.context - 1
    return f"prompt is too long: {e.prompt_tokens} tokens > {maximum} maximum"


class ErrorShape:
    """Every JSON error answer on /v1/messages (routes, validation, auth, limits, internal errors) in
    Anthropic's shape instead of OpenAI's; other paths and successful answers pass untouched. The errors
    the routes raise arrive in that shape already (the app's handler words them with `error_body`, which
    needs the error itself, not its OpenAI body) and pass through unchanged."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        start: Message | None = None
        body = b""

        async def reshaping_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is known
                return
            if start is None:
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            body = _reshaped(body, start["status"])
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping_send)


def _reshaped(body: bytes, status: int) -> bytes:
    try:
        error = json.loads(body)["error"]
        e = APIError(status, error["message"], param=error.get("param"), code=error.get("code"))
    except (ValueError, KeyError, TypeError):
        e = APIError(status, body.decode(errors="replace") or f"HTTP {status}")
    return json.dumps(error_body(e), ensure_ascii=False).encode()
