"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) as a translation of chat requests.

A Responses request becomes a `ChatCompletionRequest` (`ResponsesRequest.to_chat`) answered by the chat path
unchanged (chat template, tool parsing, structured output, speculation, prefix caching); its answer, whole or
streamed, is translated back (`ResponseTranslator`). Input items map to chat messages:

    "instructions"                                   -> a system message, first
    {"role": "user", "content": "hi"} (or "type": "message", content parts input_text / output_text)
                                                     -> a message of that role (developer: system)
    {"type": "function_call", "call_id", "name", "arguments"}
                                                     -> an assistant message's tool_calls (consecutive calls
                                                        join one message)
    {"type": "function_call_output", "call_id", "output"}  -> a tool message
    {"type": "reasoning", ...}                       -> dropped (this model has no reasoning items)

The answer's text is one `message` output item, each tool call a `function_call` item. `store` (default
true, as OpenAI's) keeps the response and its conversation (`ResponseStore`: the most recent `max_responses`,
at most `max_chars` characters of them; in memory, or in a SQLite file that outlives the server and that its
replicas share, as `specdec serve` keeps them), so a later request may continue it with
`previous_response_id`, as vLLM does; the earlier request's `instructions` are not carried over.
Fields specdec does not use (`reasoning`, `include`, `prompt_cache_key`, `truncation`, ...) are ignored, as
vLLM ignores them. Only function tools are offered to the model: built-in tools (`web_search`, ...), custom
tools and tool namespaces, which Codex sends with every request, are left out of the prompt, since nothing
here could run them. What would change the answer and cannot be done (images, files, `background`) is a 400
that says so.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.server.keepalive import DEFAULT_INTERVAL_S, with_heartbeats
from specdec.server.protocol import APIError, ChatCompletionRequest, ContextLengthError, validation_error

DEFAULT_MAX_STORED = 256  # responses kept for previous_response_id / GET
DEFAULT_MAX_STORED_CHARS = 64 << 20  # characters of their conversations, all together


class _Open(BaseModel):
    """Known fields strictly typed; unknown ones ignored (as vLLM's Responses API does)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ContentPart(_Open):
    type: Literal["input_text", "output_text", "text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None

    def as_text(self, where: str) -> str:
        if self.type in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{self.type} content is not supported by this server (it reads text only)",
                           param=where, code="unsupported_parameter")
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.as_text(f"{where}.content[{i}]") for i, p in enumerate(self.content))


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Open):
    type: Literal["reasoning"]


Item = Annotated[FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")]


class FunctionTool(_Open):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Open):
    type: Literal["function"]
    name: str


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Open):
    format: TextFormat | None = None


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[MessageItem | Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension
    seed: int | None = None  # vLLM's extension
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's extension

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (without the instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text(where)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else \
                    "".join(p.as_text(f"{where}.output[{j}]") for j, p in enumerate(item.output))
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return messages

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request: the instructions, `history` (a previous response's conversation), the input."""
        if self.background:
            raise APIError(400, "background responses are not supported", param="background",
                           code="unsupported_parameter")
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            history + self.input_messages()
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens, "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "user": self.user, "parallel_tool_calls": self.parallel_tool_calls, "cache_salt": self.cache_salt,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        functions = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools or ()) if t.type == "function"]
        if functions:  # built-in tools and namespaces are not offered to the model: nothing here could run them
            body["tools"] = functions
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            body["tool_choice"] = self.tool_choice
        body["response_format"] = self._response_format()
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise validation_error(e) from None

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema",
                           code="missing_required_parameter")
        spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format \
            else {"type": "text"}
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id, "store": self.store,
                "temperature": self.temperature, "top_p": self.top_p, "text": {"format": fmt},
                "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction)
                                else self.tool_choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
                "truncation": "disabled", "metadata": self.metadata or {}, "user": self.user,
                "reasoning": {"effort": None, "summary": None}}


def _chat_tool(tool: FunctionTool, where: str) -> dict[str, Any]:
    if tool.name is None:
        raise APIError(400, "a function tool needs a name", param=f"{where}.name", code="missing_required_parameter")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


# ---- the store -----------------------------------------------------------------------------------------


class ResponseStore:
    """Stored responses, newest last, each with its conversation (chat messages, the answer included):
    at most `max_responses`, and at most `max_chars` characters of conversations (the oldest go first), none
    older than `retention_s` seconds (None: no age bound). In memory, or with `path` in one SQLite file
    (write-ahead log), which outlives the process and which the replicas on a machine share: a conversation
    continued after a restart, or on another replica, finds its previous response (the bounds then hold for
    the file). A response is read back only under the `scope` it was stored with (the request's
    `cache_salt`: a tenant's responses stay its own). `owner` names the engine replica holding the store
    (`specdec serve --replicas`): the ids it gives (`new_id`) carry it, so that a request continuing a
    response is routed to the replica that stored it (`owner_of`)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED, max_chars: int = DEFAULT_MAX_STORED_CHARS,
                 owner: str | None = None, path: str | Path | None = None, retention_s: float | None = None):
        if owner is not None and not _OWNER.fullmatch(owner):
            raise ValueError(f"a response store's owner is letters and digits, got {owner!r}")
        self.max_responses, self.max_chars, self.owner = max_responses, max_chars, owner
        self.retention_s, self.path = retention_s, None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._db = sqlite3.connect(":memory:" if self.path is None else str(self.path), timeout=30,
                                   check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            if self.path is not None:
                os.chmod(self.path, 0o600)
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, scope TEXT NOT NULL, "
                             "created REAL NOT NULL, size INTEGER NOT NULL, body TEXT NOT NULL, "
                             "conversation TEXT NOT NULL)")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")

    def put(self, response: dict, conversation: list[dict], scope: str | None = None) -> None:
        body, talk = json.dumps(response), json.dumps(conversation)
        size = len(talk) + len(body)
        if size > self.max_chars or self.max_responses == 0:
            return
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                           (response["id"], scope or "", time.time(), size, body, talk))
                if self.retention_s is not None:
                    db.execute("DELETE FROM responses WHERE created < ?", (time.time() - self.retention_s,))
                count, chars = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
                if count > self.max_responses or chars > self.max_chars:  # the oldest go first
                    drop, freed = [], 0
                    for rid, n in db.execute("SELECT id, size FROM responses ORDER BY created, rowid"):
                        if count - len(drop) <= self.max_responses and chars - freed <= self.max_chars:
                            break
                        drop.append((rid,))
                        freed += n
                    db.executemany("DELETE FROM responses WHERE id = ?", drop)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def new_id(self) -> str:
        """A new response id: resp_<32 hex digits>, or resp_<owner>_<32 hex digits> for a replica's store."""
        return _item_id("resp" if self.owner is None else f"resp_{self.owner}")

    def get(self, response_id: str, param: str = "previous_response_id",
            scope: str | None = None) -> tuple[dict, list[dict]]:
        """(response, conversation); 404 if unknown, no longer kept, or stored under another scope."""
        with self._lock:
            row = self._db.execute("SELECT body, conversation, created FROM responses WHERE id = ? AND scope = ?",
                                   (response_id, scope or "")).fetchone()
        if row is None or (self.retention_s is not None and row[2] < time.time() - self.retention_s):
            where = "in memory" if self.path is None else "on disk"
            raise APIError(404, f"Response with id '{response_id}' not found: it was not stored (store: false), or "
                                f"this server no longer keeps it (it keeps the last {self.max_responses}, {where})",
                           param=param, code="response_not_found")
        return json.loads(row[0]), json.loads(row[1])


# ---- chat answers -> responses -----------------------------------------------------------------------------


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


_OWNER = re.compile(r"[A-Za-z0-9]+")
_OWNED_ID = re.compile(r"resp_([A-Za-z0-9]+)_[0-9a-f]{32}")


def owner_of(response_id: str | None) -> str | None:
    """The replica whose store gave `response_id` (`ResponseStore.new_id`); None for an id without one.
    Example: owner_of("resp_k3x9_" + 32 * "a") -> "k3x9"."""
    match = _OWNED_ID.fullmatch(response_id) if response_id else None
    return match.group(1) if match else None


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


class ResponseTranslator:
    """One request's chat answer as a response object (`response`) or its event stream (`events`); stored
    at the end when the request says `store`. A prompt longer than the context is a 400 (code
    `context_length_exceeded`, param `input`) when not streamed, and a stream that fails (`refused_stream`)
    when streamed."""

    prompt_param = "input"

    def __init__(self, req: ResponsesRequest, model: str, conversation: list[dict[str, Any]], store: ResponseStore,
                 heartbeat_s: float = DEFAULT_INTERVAL_S):
        self.req, self.model, self.conversation, self.store = req, model, conversation, store
        self.heartbeat_s = heartbeat_s
        self.id = store.new_id()
        self.created_at = int(time.time())
        self.sequence = 0

    def _response(self, status: str, output: list[dict], usage: dict | None) -> dict[str, Any]:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "usage": usage, **self.req.echo()}
        if status in ("completed", "incomplete"):
            self._keep(body)
        return body

    def _keep(self, body: dict[str, Any]) -> None:
        if not self.req.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        for item in body["output"]:
            if item["type"] == "message":
                reply["content"] = "".join(part["text"] for part in item["content"])
            else:
                reply.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        if reply["content"] is None and "tool_calls" not in reply:  # an empty answer (EOS first) stays a turn
            reply["content"] = ""
        self.store.put(body, self.conversation + [reply], scope=self.req.cache_salt)

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        output = [_message_item(_item_id("msg"), message["content"], "completed")] if message["content"] else []
        output += [_call_item(call) for call in message.get("tool_calls") or ()]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self._response(status, output, _usage(chat["usage"]))

    def _failed(self, output: list[dict], e: APIError) -> dict[str, Any]:
        return {**self._response("failed", output, None), "error": {"code": e.code or "server_error",
                                                                   "message": e.message}}

    async def refused_stream(self, e: ContextLengthError) -> AsyncIterator[str]:
        """A streamed request whose prompt does not fit the context: response.created,
        response.in_progress, then response.failed with `error.code: "context_length_exceeded"`, and no
        HTTP error. That is how OpenAI streams it (openai/codex's SSE tests replay its event: `"status":
        "failed", "error": {"code": "context_length_exceeded", ...}`) and the only form Codex acts on:
        codex-api's `sse/responses.rs` maps that code in a response.failed to ContextWindowExceeded (a turn
        then marks the context full for its auto-compaction; a compaction drops its oldest item and tries
        again), while `api_bridge.rs` makes a 400 with that code an InvalidRequest."""
        yield self._event("response.created", response=self._response("in_progress", [], None))
        yield self._event("response.in_progress", response=self._response("in_progress", [], None))
        yield self._event("response.failed", response=self._failed([], e))

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def events(self, chunks: AsyncIterator[dict], prompt_tokens: int) -> AsyncIterator[str]:
        """response.created, response.in_progress; for the text: response.output_item.added,
        response.content_part.added, response.output_text.delta as it comes, response.output_text.done,
        response.content_part.done, response.output_item.done; for each tool call (complete):
        response.output_item.added, response.function_call_arguments.delta and .done,
        response.output_item.done; then response.completed (response.incomplete at max_output_tokens).
        response.in_progress again every `heartbeat_s` seconds without a chunk. An error mid-stream is an
        `error` event, then response.failed."""
        yield self._event("response.created", response=self._response("in_progress", [], None))
        yield self._event("response.in_progress", response=self._response("in_progress", [], None))
        output: list[dict[str, Any]] = []
        text_id, text, finish = None, "", None
        try:
            async for chunk in with_heartbeats(chunks, self.heartbeat_s):
                if chunk is None:  # the engine is silent (a long prefill): a heartbeat for the client's watchdog
                    yield self._event("response.in_progress", response=self._response("in_progress", [], None))
                    continue
                if chunk.get("usage"):
                    for event in self._close_text(output, text_id, text):
                        yield event
                    status = "incomplete" if finish == "length" else "completed"
                    yield self._event(f"response.{status}",
                                      response=self._response(status, output, _usage(chunk["usage"])))
                    return
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    if delta.get("content"):
                        if text_id is None:
                            text_id = _item_id("msg")
                            yield self._event("response.output_item.added", output_index=len(output),
                                              item=_message_item(text_id, "", "in_progress"))
                            yield self._event("response.content_part.added", item_id=text_id, output_index=len(output),
                                              content_index=0, part={"type": "output_text", "text": "",
                                                                     "annotations": [], "logprobs": []})
                        text += delta["content"]
                        yield self._event("response.output_text.delta", item_id=text_id, output_index=len(output),
                                          content_index=0, delta=delta["content"], logprobs=[])
                    for call in delta.get("tool_calls") or ():
                        for event in self._close_text(output, text_id, text):
                            yield event
                        text_id, text = None, ""
                        item = _call_item(call, "in_progress")
                        index = len(output)
                        yield self._event("response.output_item.added", output_index=index, item=item)
                        arguments = call["function"]["arguments"]
                        yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=arguments)
                        yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, name=item["name"], arguments=arguments)
                        item = {**item, "arguments": arguments, "status": "completed"}
                        output.append(item)
                        yield self._event("response.output_item.done", output_index=index, item=item)
                    finish = choice["finish_reason"] or finish
        except APIError as e:
            yield self._event("error", code=e.code, message=e.message, param=e.param)
            yield self._event("response.failed", response=self._failed(output, e))

    def _close_text(self, output: list[dict], text_id: str | None, text: str) -> list[str]:
        """The events that end the message item being streamed (none if there is none); it joins `output`."""
        if text_id is None:
            return []
        index = len(output)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = _message_item(text_id, text, "completed")
        output.append(item)
        return [self._event("response.output_text.done", item_id=text_id, output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=text_id, output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]
