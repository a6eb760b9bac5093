"""OpenAI request and response models (pydantic), and the OpenAI error shape (the bodies are built by
`renderers`).

Requests are strict: unknown fields, wrong JSON types and out-of-range values are refused with a 400 that
names the parameter. OpenAI parameters that specdec does not implement are declared here only so that their
neutral value (`n=1`, `logprobs=false`, `presence_penalty=0`, ...) is accepted; anything else is refused by
`unsupported_parameter`, never ignored.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.responses import JSONResponse

from specdec.config import MAX_TEMPERATURE
from specdec.server.tool_calls import ToolCallParser

# ---- errors -------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code
        self.headers = headers  # extra response headers, e.g. Retry-After
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP answer (also an ASGI app: `await e.response()(scope, receive, send)`)."""
        return JSONResponse(self.to_dict(), status_code=self.status, headers=self.headers)


class ContextLengthError(APIError):
    """A prompt longer than the context, or a prompt and the completion asked for: a 400 with code
    `context_length_exceeded` and OpenAI's own words, which the openai SDK and Codex act on by the code.
    Each API words it from the same numbers: Anthropic's (`anthropic.error_body`: "prompt is too long: N
    tokens > M maximum", which makes Claude Code compact), a Responses stream (`response.failed`). Example:

        ContextLengthError(256, 300, "messages").message
        -> "This model's maximum context length is 256 tokens. However, your messages resulted in 300
            tokens. Please reduce the length of the messages."
        ContextLengthError(256, 60, "messages", completion_tokens=250).message
        -> "This model's maximum context length is 256 tokens. However, you requested 310 tokens (60 in the
            messages, 250 in the completion). Please reduce the length of the messages or completion."

    `at_least`: the prompt was refused before tokenizing, from a bound on its tokens (`prompts.refuse_if_too_long`)."""

    def __init__(self, context: int, prompt_tokens: int, param: str, completion_tokens: int = 0,
                 at_least: bool = False):
        self.context, self.prompt_tokens, self.completion_tokens = context, prompt_tokens, completion_tokens
        head = f"This model's maximum context length is {context} tokens. However, "
        if completion_tokens:
            message = (f"{head}you requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the "
                       f"{param}, {completion_tokens} in the completion). Please reduce the length of the {param} "
                       "or completion.")
        else:
            # a prompt of exactly the context is refused too: the completion needs at least one token
            room = ", which leaves no room for the completion" if prompt_tokens <= context else ""
            message = (f"{head}your {param} resulted in {'at least ' if at_least else ''}{prompt_tokens} tokens"
                       f"{room}. Please reduce the length of the {param}.")
        super().__init__(400, message, param=param, code="context_length_exceeded")


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the parameter, e.g. `temperature: Input should be >= 0`."""
    err = e.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if p != "body"]
    param = _param_name(loc)
    if err["type"] == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {err['msg']}", code="invalid_json")
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if not loc:
        return APIError(400, f"The request body must be a JSON object: {err['msg']}", code="invalid_request")
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param, code="missing_required_parameter")
    message = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]  # no "Value error, "
    return APIError(400, f"Invalid value for {param}: {message}", param=param, code="invalid_value")


_FIELDS = {"role", "content", "type", "text", "include_usage", "tool_calls", "tool_call_id", "function", "name",
           "arguments", "description", "parameters", "strict"}


def _param_name(loc: list) -> str | None:
    """`['messages', 0, 'role']` -> `messages[0].role`; union member tags (`'str'`, `'list[str]'`) dropped."""
    if not loc:
        return None
    name = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in _FIELDS:
            name += f".{part}"
        else:
            break
    return name


# ---- requests -----------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # NaN, Infinity, 1e999: refused


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: str) -> str:
        try:
            json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments must be JSON text: {e}") from None
        return arguments


class ToolCallParam(_Strict):
    """A call in an assistant message of the conversation (one the model made earlier)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant message with tool_calls
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    name: str | None = None  # a participant's name, given to the chat template (most ignore it)

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only tool messages have it")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape). Call arguments become dicts, as vLLM
        passes them: Qwen2.5's template writes them with `tojson`, which would quote a JSON string again.
        Example: `{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}`."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                          "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


INT64 = dict(ge=-(2**63), le=2**64 - 1)
MAX_N = 16  # the most sequences (n, best_of) one request may ask for
# stop strings per request, and characters per stop string (OpenAI allows 4 stop strings): generous, bounded
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None  # optional, as in vLLM: the served model when absent
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension; 0 or -1 disables
    seed: int | None = Field(None, **INT64)
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM extension
    return_token_ids: bool = False  # vLLM extension: the token ids of the prompt and of the completion
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: recorded by OpenAI, no effect on the output
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: only requests with the same salt share prefixes
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=2)  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int | None = Field(None, ge=0)  # vLLM extension
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} or a "json_schema"

    def sampling_fields(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """The SamplingParams fields these requests share (validated there too); `defaults` (the server's
        --generation-config) fill temperature, top_p, top_k, min_p and repetition_penalty left out."""
        defaults = defaults or {}

        def given(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, neutral)

        try:
            bias = {int(token): value for token, value in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias", code="invalid_value") from None
        bad = next(((t, v) for t, v in bias.items() if not -100 <= v <= 100), None)  # NaN included
        if bad is not None:  # as OpenAI: a bias is at most 100 either way (-100 bans a token, 100 forces it)
            raise APIError(400, f"logit_bias of token {bad[0]} is {bad[1]}: a bias must be in [-100, 100]",
                           param="logit_bias", code="invalid_value")
        rf = self.response_format
        return dict(
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias=bias, min_tokens=self.min_tokens or 0, min_p=given("min_p", 0.0),
            stop_token_ids=tuple(self.stop_token_ids or ()), n=self.num_sequences()[0],
            best_of=self.num_sequences()[1],
            response_format=None if rf is None or rf.get("type") == "text" else rf,
        )

    def num_sequences(self) -> tuple[int, int | None]:
        """(n, best_of) of each prompt."""
        return self.n or 1, None

    def stop_sequences(self) -> tuple[str, ...]:
        """The stop strings: at most MAX_STOP_STRINGS, each of 1 to MAX_STOP_CHARS characters."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError(400, "Invalid value for stop: stop sequences must not be empty strings", param="stop",
                           code="invalid_value")
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"Invalid value for stop: at most {MAX_STOP_STRINGS} stop sequences of at most "
                                f"{MAX_STOP_CHARS} characters each", param="stop", code="invalid_value")
        return tuple(stops)

    def unsupported_parameter(self) -> APIError | None:
        """A 400 for the first parameter set to a value specdec does not implement, or None."""
        if self.stream_options is not None and not self.stream:
            return APIError(400, "stream_options is only allowed when stream is true", param="stream_options",
                            code="invalid_value")
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                return APIError(400, f"{name}={value!r} is not supported by specdec (supported: "
                                     f"{' or '.join(repr(v) for v in neutral)})",
                                param=name, code="unsupported_parameter")
        return None

    NEUTRAL: ClassVar[dict[str, tuple]] = {}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # OpenAI's bookkeeping, no effect on the output: storing the completion, tags for it, the processing tier
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # the legacy form of tools: refused, send tools instead
    function_call: str | dict[str, Any] | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.NEUTRAL, "functions": ([],), "function_call": ("none",),
    }

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None without `logprobs`, else `top_logprobs` (default 0)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def tool_call_format(self) -> dict[str, Any] | None:
        """For `tool_choice` "required" or a named function: the response format that makes the answer a call,
        as JSON the parser reads as one: `{"name": ..., "arguments": {...}}` with the function's parameters
        schema (a list of one or more such calls for "required" when parallel calls are allowed, as in vLLM).
        None otherwise. A 400 if `response_format` is also set: the two would contradict."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return None
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(400, "response_format cannot be combined with a required tool call", param="response_format",
                           code="invalid_value")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None

        def call(tool: Tool) -> dict[str, Any]:
            parameters = tool.function.parameters or {"type": "object"}
            return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
                    "required": ["name", "arguments"], "additionalProperties": False}

        calls = [call(t) for t in self.tools or () if named is None or t.function.name == named]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if named is None and self.parallel_tool_calls is not False:
            schema = {"type": "array", "items": schema, "minItems": 1}
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the template, with the fields the client set (none added as nulls), or None."""
        return [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None

    def tool_parser(self) -> ToolCallParser | None:
        """The parser of the answer's tool calls; None without tools or with `tool_choice: "none"` (the tools
        are still in the prompt, as in vLLM). A 400 for a `tool_choice` without tools or naming no declared
        tool. `"required"` and a named function are also enforced by a grammar (`tool_call_format`)."""
        names = tuple(t.function.name for t in self.tools or ())
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise APIError(400, "tool_choice needs tools: declare the functions in tools", param="tool_choice",
                           code="invalid_value")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                f"the tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
        if not names or choice == "none":
            return None
        return ToolCallParser(names, parallel=self.parallel_tool_calls is not False)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI allows 5; vLLM 20
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def num_sequences(self) -> tuple[int, int | None]:
        return self.n or 1, self.best_of

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_SamplingRequest.NEUTRAL, "suffix": ("",)}

    def output_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's and vLLM's default

    def unsupported_parameter(self) -> APIError | None:
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            return APIError(400, f"best_of ({self.best_of}) must be >= n ({n})", param="best_of",
                            code="invalid_value")
        if self.stream and self.best_of is not None and self.best_of > n:
            return APIError(400, "best_of > n cannot be streamed: the best are known only at the end",
                            param="best_of", code="invalid_value")
        return super().unsupported_parameter()

    def prompts(self) -> list[str | list[int]]:
        """The prompts (text or token ids): one, or a batch of several (answered as n choices each)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(batch) > MAX_N:
            raise APIError(400, f"at most {MAX_N} prompts per request, got {len(batch)}", param="prompt",
                           code="invalid_value")
        if any(len(q) == 0 for q in batch) or not batch:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if len(batch) * (self.best_of or self.n or 1) > MAX_N:
            raise APIError(400, f"{len(batch)} prompts x {self.best_of or self.n or 1} sequences each is more than the "
                                f"{MAX_N} one request may run", param="prompt", code="invalid_value")
        return batch


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages or ()]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache, not prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM extension)
    specdec: dict[str, Any] | None = None  # per-request speculative statistics; OpenAI clients ignore it


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # left out of the body when None


class _Choice(BaseModel):
    index: int = 0
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None  # vLLM's: the stop string that ended it
    token_ids: list[int] | None = None  # with return_token_ids (vLLM extension)


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatChunkChoice(_Choice):
    delta: dict[str, Any]  # {"role": "assistant", "content": ""} first, then {"content": ...} or
    # {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}; {} at the end


class CompletionChoice(_Choice):
    text: str


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"  # chunks too, as OpenAI's
    choices: list[CompletionChoice]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
