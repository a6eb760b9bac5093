"""An API request's SamplingParams, built in named steps, each refusing what it checks with a 400:

    prompts_fit        every prompt, and the completion asked for, fit the context
    request_fields     the request's sampling fields over the server's defaults; a tool call's format wins
    lenient_schema     (`--lenient-json-schemas`) a json_schema that does not say `strict` gets strict: false
    check_vocabulary   logit_bias and stop_token_ids name tokens of the model
    completion_limit   max_tokens: the request's, else the server's default cut to the context's room
    build_params       the SamplingParams (its own ValueErrors answered as 400s)
    check_grammar      the response_format compiles into a grammar

`check_grammar` compiles and keeps nothing, and the engine compiles the same response_format again when it
takes the request (`engine.sequence.request_grammar`): the engine's seam is (prompt ids, SamplingParams), and
SamplingParams carries the response_format, not a compiled grammar. The second compile costs nothing:
compiled grammars are cached by (schema text, tokenizer, logits width) (`engine.structured._compile`, the
128 most recently used), and the server passes the engine's own tokenizer and width, so the engine's
compile is a cache hit on this one. What the server's compile buys is that an invalid or slow schema is
refused, or compiled, in a worker thread before the request reaches the engine's thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from specdec.config import SamplingParams
from specdec.engine.structured import Grammar
from specdec.models.tokenizer import Tokenizer
from specdec.server.protocol import APIError, ContextLengthError


def prompts_fit(prompt_ids: list[list[int]], limit: int | None, context: int, prompt_param: str) -> None:
    """Refuse (ContextLengthError, naming `prompt_param`) a prompt that leaves no room for one token, or one
    that with the requested completion `limit` (None: none asked for) is longer than `context`."""
    for ids in prompt_ids:
        prompt_len = len(ids)
        if prompt_len >= context:  # (the completion needs one token)
            raise ContextLengthError(context, prompt_len, prompt_param)
        if limit is not None and prompt_len + limit > context:
            raise ContextLengthError(context, prompt_len, prompt_param, completion_tokens=limit)


def request_fields(req, defaults: dict[str, Any], response_format: dict | None, lenient_json_schemas: bool
                   ) -> dict[str, Any]:
    """The request's SamplingParams fields (`req.sampling_fields`, `defaults` filling what it leaves out).
    `response_format`, where given (a required tool call's format), replaces the request's own."""
    fields = req.sampling_fields(defaults)
    if response_format is not None:
        fields["response_format"] = response_format
    if lenient_json_schemas:
        fields["response_format"] = lenient_schema(fields["response_format"])
    return fields


def lenient_schema(response_format: dict | None) -> dict | None:
    """A json_schema response_format that does not say `strict` says false (JSON Schema's open objects);
    anything else is returned as it is. Example: {"type": "json_schema", "json_schema": {"schema": s}} ->
    {"type": "json_schema", "json_schema": {"schema": s, "strict": False}}."""
    if (response_format or {}).get("type") != "json_schema":
        return response_format
    spec = response_format["json_schema"]
    if isinstance(spec, dict) and "strict" not in spec:  # the server's default, unless the request says
        return {**response_format, "json_schema": {**spec, "strict": False}}
    return response_format


def check_vocabulary(fields: dict[str, Any], vocab_size: int) -> None:
    """Refuse a token id in logit_bias or stop_token_ids outside [0, vocab_size), naming the field."""
    for name, ids in (("logit_bias", list(fields["logit_bias"])), ("stop_token_ids", fields["stop_token_ids"])):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in {name} is outside the vocabulary [0, {vocab_size})", param=name,
                           code="invalid_value")


def completion_limit(limit: int | None, prompt_ids: list[list[int]], context: int, defaults: dict[str, Any],
                     default_max_tokens: int) -> int:
    """max_tokens: the request's `limit` where it gave one (`prompts_fit` checked it), else the server's
    default (`--generation-config`'s max_new_tokens, else `default_max_tokens`) cut to the room the longest
    prompt leaves. Example: no limit, default 1024, context 4096, prompts of 3500 and 10 tokens -> 596."""
    if limit is not None:
        return limit
    room = context - max(len(ids) for ids in prompt_ids)
    return min(defaults.get("max_new_tokens", default_max_tokens), room)


def build_params(req, fields: dict[str, Any], max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
                 ) -> SamplingParams:
    """The SamplingParams; what SamplingParams itself refuses (a ValueError) is a 400 with its message."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=req.seed,
            stop=req.stop_sequences(),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **fields,
        )
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


async def check_grammar(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a response_format that does not compile (param `response_format`). Compiled in a worker
    thread, off the engine's; the grammar is left in `Grammar`'s cache for the engine (see the module's
    docstring)."""
    if params.response_format is None:
        return
    try:
        await asyncio.to_thread(Grammar.from_response_format, params.response_format, tokenizer, vocab_size)
    except ValueError as e:
        raise APIError(400, str(e), param="response_format", code="invalid_value") from None
