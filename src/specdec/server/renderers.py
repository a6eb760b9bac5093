"""Engine outputs -> OpenAI response bodies: `ChatRenderer` and `CompletionRenderer` turn one request's
`RequestOutput`s into the whole answer or its stream chunks (the models in `protocol`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from specdec.engine.metrics import SpecMetrics
from specdec.engine.outputs import RequestOutput, TokenLogprob
from specdec.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, CompletionChoice,
    CompletionResponse, PromptTokensDetails, Usage,
)
from specdec.server.tool_calls import ToolCallParser, ToolCallStream


class Renderer:
    """Turns one request's `RequestOutput`s into JSON-ready bodies: the whole answer, or stream chunks.
    `ChatRenderer` and `CompletionRenderer` differ only in the choice they build (and its logprobs).
    `token_text(id)` is a token's text (for logprobs); `echo` the prompts' texts to put before each
    completion (completions with echo), choice i completing prompt i // `n`."""

    def __init__(self, request_id: str, model: str, *, include_usage: bool = False, return_token_ids: bool = False,
                 token_text: Callable[[int], str] = str, echo: list[str] | None = None, n: int = 1):
        self.request_id, self.model = request_id, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.token_text, self.echo, self.n = token_text, echo, n
        self.created = int(time.time())
        self._echoed: set[int] = set()  # streamed choices whose echo was sent

    def first_chunk(self, index: int) -> dict | None:
        return None

    def response(self, choices: list[tuple[int, RequestOutput]]) -> dict:
        """The whole answer: `choices` are (index, final output)."""
        built = []
        for index, out in choices:
            echo = self.echo is not None
            text = self.echo[index // self.n] + out.text if echo else out.text
            built.append(self._choice(out, text, out.token_ids, out.logprobs, index, final=True, streaming=False,
                                      with_prompt=echo))
        outs = [out for _, out in choices]
        return self._body(built, _merged_metrics(outs), usage=self.usage(choices), outs=outs, streaming=False)

    def chunk(self, out: RequestOutput, text: str, index: int = 0) -> dict | None:
        """The chunk of one step of choice `index`: `text` (what it made streamable), and on the last step
        the finish reason and statistics. None when the step has nothing to send."""
        echo = self.echo is not None and index not in self._echoed  # the echo goes with a choice's first chunk
        if echo:
            self._echoed.add(index)
            text = self.echo[index // self.n] + text
        choice = self._choice(out, text, out.new_token_ids, out.new_logprobs, index, final=out.finished, streaming=True,
                              with_prompt=echo)
        if choice is None:  # nothing to send: the text is held back (a possible tool call)
            return None
        return self._body([choice], out.metrics if out.finished else None, usage=None,
                          outs=[out] if out.finished else [], streaming=True)

    def usage_chunk(self, choices: list[tuple[int, RequestOutput]]) -> dict:
        return self._body([], None, usage=self.usage(choices), outs=[], streaming=True)

    def usage(self, choices: list[tuple[int, RequestOutput]]) -> Usage:
        """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice; cached
        tokens once per prompt too: those none of its choices prefilled (the first to join may have prefilled
        what the others then found cached)."""
        prompt, cached = {}, {}
        for index, out in choices:
            prompt[index // self.n] = len(out.prompt_token_ids)
            cached[index // self.n] = min(cached.get(index // self.n, out.metrics.cached_tokens), out.metrics.cached_tokens)
        completion = sum(len(out.token_ids) for _, out in choices)
        return Usage(prompt_tokens=sum(prompt.values()), completion_tokens=completion,
                     total_tokens=sum(prompt.values()) + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))

    def _body(self, choices: list, metrics, usage: Usage | None, outs: list[RequestOutput], streaming: bool) -> dict:
        response_type = self.chunk_type if streaming else self.response_type
        prompt_ids = None
        if outs and self.return_token_ids:
            prompt_ids = list(outs[0].prompt_token_ids)
        body = response_type(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage, specdec=metrics.to_dict() if metrics is not None else None, prompt_token_ids=prompt_ids,
        ).model_dump(mode="json")
        for key in ("specdec", "prompt_token_ids"):
            if body[key] is None:
                del body[key]
        if streaming and not self.include_usage:
            del body["usage"]  # OpenAI: present (null until the last chunk) only with include_usage
        for c in body["choices"]:
            if c["token_ids"] is None:
                del c["token_ids"]
            if "message" in c and c["message"]["tool_calls"] is None:
                del c["message"]["tool_calls"]
        first = ("id", "object", "created", "model", "choices")  # OpenAI's key order
        return {**{k: body[k] for k in first}, **body}


class ChatRenderer(Renderer):
    """With a `tool_parser`, the text is split into content and tool calls (finish reason "tool_calls" when
    there were calls): the whole answer at once, or a stream step by step, text that may begin a call held
    back until it is known (see `ToolCallStream`)."""

    response_type, chunk_type = ChatCompletionResponse, ChatCompletionChunk

    def __init__(self, *args, tool_parser: ToolCallParser | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.tool_streams: dict[int, ToolCallStream] = {}  # streamed choice -> its parser's state

    def first_chunk(self, index: int) -> dict:
        choice = ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})
        return self._body([choice], None, None, outs=[], streaming=True)

    def _choice(self, out, text: str, token_ids: list[int], logprobs, index: int, final: bool, streaming: bool,
                with_prompt: bool = False):
        common = _choice_fields(out, token_ids if self.return_token_ids else None, final, index)
        if logprobs is not None:
            common["logprobs"] = {"content": [self._entry(e) for e in logprobs], "refusal": None}
        content, calls = text, []
        if not streaming:
            if self.tool_parser is not None:
                content, calls = self.tool_parser.parse(text)
            if calls:
                common["finish_reason"] = "tool_calls"
            message = AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls] or None)
            return ChatChoice(message=message, **common)
        stream = None
        if self.tool_parser is not None:
            stream = self.tool_streams.setdefault(index, self.tool_parser.stream())
            content, calls = stream.feed(text, final)
            if not (content or calls or final or common["token_ids"] or logprobs):
                return None
            if final and stream.num_calls:
                common["finish_reason"] = "tool_calls"
        delta: dict[str, Any] = {"content": content} if content or not (final or calls) else {}
        if calls:
            first = stream.num_calls - len(calls)
            delta["tool_calls"] = [c.to_openai(index=first + i) for i, c in enumerate(calls)]
        return ChatChunkChoice(delta=delta, **common)

    def _entry(self, e: TokenLogprob) -> dict:
        return {**self._token(e.token_id, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


class CompletionRenderer(Renderer):
    response_type = chunk_type = CompletionResponse

    def _choice(self, out, text: str, token_ids: list[int], logprobs, index: int, final: bool, streaming: bool,
                with_prompt: bool = False):
        common = _choice_fields(out, token_ids if self.return_token_ids else None, final, index)
        if logprobs is not None:
            entries = list(logprobs)
            if with_prompt and out.prompt_logprobs is not None:  # echo: the prompt's tokens come first
                entries = list(out.prompt_logprobs) + entries
            common["logprobs"] = self._logprobs(out.prompt_token_ids[0] if out.prompt_token_ids else 0, entries)
        return CompletionChoice(text=text, **common)

    def _logprobs(self, first_prompt_token: int, entries: list) -> dict:
        """OpenAI's completions shape; the prompt's first token (echo) has no logprob (null)."""
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for e in entries:
            token_id = e.token_id if e is not None else first_prompt_token
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            token_logprobs.append(None if e is None else _finite(e.logprob))
            top.append(None if e is None else {self.token_text(t): _finite(lp) for t, lp in e.top})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _finite(logprob: float) -> float:
    """-inf (a token the processing excluded) as OpenAI writes it: -9999.0."""
    return max(logprob, -9999.0)


def _choice_fields(out: RequestOutput, token_ids: list[int] | None, final: bool, index: int) -> dict:
    # stop_reason as vLLM's: the stop string that ended the answer, None when EOS (or the length) did
    stop_reason = out.stop_reason if final and isinstance(out.stop_reason, str) else None
    return {"index": index, "finish_reason": out.finish_reason if final else None, "stop_reason": stop_reason,
            "token_ids": list(token_ids) if token_ids is not None else None}


def _merged_metrics(outs: list[RequestOutput]) -> SpecMetrics:
    if len(outs) == 1:
        return outs[0].metrics
    merged = SpecMetrics()
    for out in outs:
        merged.merge(out.metrics)
    return merged

