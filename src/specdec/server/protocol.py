"""OpenAI request and response models (pydantic), and the OpenAI error shape.

Requests are strict: unknown fields, wrong JSON types and out-of-range values are refused with a 400 that
names the parameter. OpenAI parameters that specdec does not implement are declared here only so that their
neutral value (`n=1`, `logprobs=false`, `presence_penalty=0`, ...) is accepted; anything else is refused by
`unsupported_parameter`, never ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.outputs import RequestOutput

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
    return APIError(400, f"Invalid value for {param}: {err['msg']}", param=param, code="invalid_value")


def _param_name(loc: list) -> str | None:
    """`['messages', 0, 'role']` -> `messages[0].role`; union member tags (`'str'`, `'list[str]'`) dropped."""
    if not loc:
        return None
    name = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("role", "content", "type", "text", "include_usage"):
            name += f".{part}"
        else:
            break
    return name


# ---- requests -----------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)  # as vLLM


INT64 = dict(ge=-(2**63), le=2**64 - 1)


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None  # optional, as in vLLM: the served model when absent
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
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
    # Declared so that their neutral values pass; see `unsupported_parameter`.
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None

    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError(400, "Invalid value for stop: stop sequences must not be empty strings", param="stop",
                           code="invalid_value")
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

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
        "logit_bias": ({},), "min_tokens": (0,), "min_p": (0,), "stop_token_ids": ([],),
    }


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools, which are refused
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.NEUTRAL, "logprobs": (False,), "top_logprobs": (0,), "tools": ([],),
        "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
        "response_format": ({"type": "text"},),
    }

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_SamplingRequest.NEUTRAL, "echo": (False,), "suffix": ("",), "best_of": (1,)}

    def output_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's and vLLM's default

    def unsupported_parameter(self) -> APIError | None:
        if self.logprobs is not None:
            return APIError(400, "logprobs is not supported by specdec", param="logprobs",
                            code="unsupported_parameter")
        return super().unsupported_parameter()

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several is refused (specdec answers n=1)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"a batch of {len(p)} prompts is not supported; send one prompt per request",
                               param="prompt", code="unsupported_parameter")
            p = p[0]
        if len(p) == 0:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        return p


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
    content: str


class _Choice(BaseModel):
    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | None = None  # vLLM's: the stop string that ended it
    token_ids: list[int] | None = None  # with return_token_ids (vLLM extension)


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatChunkChoice(_Choice):
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": ...}; {} at the end


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


# ---- engine outputs -> response bodies ----------------------------------------------------------------


class Renderer:
    """Turns one request's `RequestOutput`s into JSON-ready bodies: the whole answer, or stream chunks.
    `ChatRenderer` and `CompletionRenderer` differ only in the choice they build."""

    def __init__(self, request_id: str, model: str, *, include_usage: bool = False, return_token_ids: bool = False):
        self.request_id, self.model = request_id, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.created = int(time.time())

    def first_chunk(self) -> dict | None:
        return None

    def response(self, out: RequestOutput) -> dict:
        choice = self._choice(out, out.text, out.token_ids, final=True, streaming=False)
        return self._body(choice, out, usage=_usage(out), streaming=False)

    def chunk(self, out: RequestOutput, text: str) -> dict:
        """The chunk of one step: `text` (what it made streamable), and on the last step the finish reason and
        statistics."""
        choice = self._choice(out, text, out.new_token_ids, final=out.finished, streaming=True)
        return self._body(choice, out if out.finished else None, usage=None, streaming=True)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._body(None, None, usage=_usage(out), streaming=True)

    def _body(self, choice, out, usage: Usage | None, streaming: bool) -> dict:
        response_type = self.chunk_type if streaming else self.response_type
        body = response_type(
            id=self.request_id, created=self.created, model=self.model, choices=[choice] if choice else [],
            usage=usage, specdec=out.metrics.to_dict() if out is not None else None,
            prompt_token_ids=list(out.prompt_token_ids) if out is not None and self.return_token_ids else None,
        ).model_dump(mode="json")
        for key in ("specdec", "prompt_token_ids"):
            if body[key] is None:
                del body[key]
        if streaming and not self.include_usage:
            del body["usage"]  # OpenAI: present (null until the last chunk) only with include_usage
        for c in body["choices"]:
            if c["token_ids"] is None:
                del c["token_ids"]
        first = ("id", "object", "created", "model", "choices")  # OpenAI's key order
        return {**{k: body[k] for k in first}, **body}


class ChatRenderer(Renderer):
    response_type, chunk_type = ChatCompletionResponse, ChatCompletionChunk

    def first_chunk(self) -> dict:
        return self._body(ChatChunkChoice(delta={"role": "assistant", "content": ""}), None, None, streaming=True)

    def _choice(self, out, text: str, token_ids: list[int], final: bool, streaming: bool):
        common = _choice_fields(out, token_ids if self.return_token_ids else None, final)
        if not streaming:
            return ChatChoice(message=AssistantMessage(content=text), **common)
        return ChatChunkChoice(delta={"content": text} if text or not final else {}, **common)


class CompletionRenderer(Renderer):
    response_type = chunk_type = CompletionResponse

    def _choice(self, out, text: str, token_ids: list[int], final: bool, streaming: bool):
        return CompletionChoice(text=text, **_choice_fields(out, token_ids if self.return_token_ids else None, final))


def _choice_fields(out: RequestOutput, token_ids: list[int] | None, final: bool) -> dict:
    # stop_reason as vLLM's: the stop string that ended the answer, None when EOS (or the length) did
    stop_reason = out.stop_reason if final and isinstance(out.stop_reason, str) else None
    return {"finish_reason": out.finish_reason if final else None, "stop_reason": stop_reason,
            "token_ids": list(token_ids) if token_ids is not None else None}


def _usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.metrics.cached_tokens))
