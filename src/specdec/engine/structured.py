"""Structured output: a grammar (OpenAI `response_format`, a tool's JSON schema) as a mask of the tokens
allowed next, one matcher per sequence, computed by llguidance.

Speculative decoding stays exactly plain constrained decoding: the engine masks verified position i with
the grammar state after the accepted tokens plus drafted tokens 0..i-1 (`masks_along`), accepts, then
`advance`s the matcher by the emitted tokens only. Example, schema `{"a": integer}` on Qwen2.5:

>>> grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
...                                "required": ["a"]}, tokenizer)
>>> matcher = grammar.matcher()
>>> matcher.advance(tokenizer.encode('{"a": 1'))
>>> masks, n = matcher.masks_along(tokenizer.encode("2}x"))   # 'x' is forbidden after the object
>>> n, masks[2].nonzero().flatten().tolist()                  # masks after '', '2', '2}'; then EOS only
(3, [151643, 151645])

When the grammar is complete the mask allows the tokenizer's EOS ids and nothing else can follow;
while it is incomplete EOS is forbidden. Special tokens other than EOS are never allowed.

JSON schemas are strict by default, as xgrammar's in vLLM and OpenAI's strict structured outputs: an object
schema that lists `properties` and says nothing of `additionalProperties` allows no other property
(`closed_objects`). `"additionalProperties": true` (or a schema) in the schema, or `"strict": false` in the
`json_schema` of a response_format, keeps JSON Schema's own open default.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
import numpy as np
import torch

from specdec.models.tokenizer import Tokenizer

# Any JSON whitespace, at most 32 characters wherever JSON allows whitespace (llguidance's default is
# unbounded): a model caught in a loop of newlines must move on instead of filling max_tokens with them.
WHITESPACE = r"[\x20\x0A\x0D\x09]{1,32}"
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class Grammar:
    """A grammar compiled for one tokenizer and logits width; `matcher()` starts a sequence's state.

    Compiled grammars are cached (least recently used, bounded), so a schema that every request sends
    compiles once.
    """

    def __init__(self, initial: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self._initial = initial  # the start state; each sequence gets a copy
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @staticmethod
    def from_response_format(
        response_format: dict, tokenizer: Tokenizer, vocab_size: int | None = None
    ) -> Grammar | None:
        """The grammar of an OpenAI `response_format`; None for `{"type": "text"}`. Example:

        >>> Grammar.from_response_format({"type": "json_schema", "json_schema": {"name": "point",
        ...     "schema": {"type": "object", "properties": {"x": {"type": "number"}}}}}, tokenizer)
        """
        if not isinstance(response_format, dict):
            raise ValueError(f'response_format is an object such as {{"type": "json_object"}}, not {response_format!r}')
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar.json_schema({"type": "object"}, tokenizer, vocab_size)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return Grammar.json_schema(schema, tokenizer, vocab_size, strict=spec.get("strict") is not False)
        raise ValueError(f"response_format type {kind!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}")

    @staticmethod
    def json_schema(schema: dict, tokenizer: Tokenizer, vocab_size: int | None = None, strict: bool = True
                    ) -> Grammar:
        """JSON text valid under `schema` (JSON Schema; properties come in the order `properties` lists
        them); `strict`: only the listed properties where the schema does not say otherwise
        (`closed_objects`). `vocab_size` is the model's logits width, the tokenizer's vocabulary size by
        default. ValueError for a schema that is invalid, unsupported or unsatisfiable."""
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is an object, not {type(schema).__name__}")
        return _compile(json.dumps(closed_objects(schema) if strict else schema), tokenizer,
                        vocab_size or tokenizer.vocab_size)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._initial.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarMatcher:
    """One sequence's place in the grammar: the masks of allowed tokens, and the tokens emitted so far.

    Example, schema `{"a": integer}` after '{"a": 12': `allowed_mask()` allows digits, whitespace and
    '}' (and ',' if the schema is not strict), and neither EOS nor letters; after `advance(ids of "}")` only the EOS ids are allowed and
    `is_terminated()` is True.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids

    def allowed_mask(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens allowed next (False beyond the tokenizer's vocabulary)."""
        masks, _ = self.masks_along([])
        return masks[0]

    def masks_along(self, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Masks for positions 0..len(tokens), mask i being the state after `tokens[:i]`, up to the first
        token the grammar forbids (its position's mask is the last one). Returns (bool [n, vocab_size], n);
        the matcher's state is unchanged. Example: tokens = [ok, ok, forbidden, ok] -> n = 3."""
        rows, consumed = [], 0  # rows: one bit per token, little-endian int32 words
        for i in range(len(tokens) + 1):
            rows.append(self._matcher.compute_bitmask())
            if i == len(tokens) or not self._allows(tokens[i]):
                break
            consumed += self._consume(tokens[i])
        self._matcher.rollback(consumed)
        bits = np.unpackbits(np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), -1), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size]).view(torch.bool), len(rows)

    def advance(self, tokens: list[int]) -> None:
        """Commit emitted tokens; ValueError, with the state unchanged, if the grammar forbids one."""
        consumed = 0
        for i, token in enumerate(tokens):
            if not self._allows(token):
                self._matcher.rollback(consumed)
                raise ValueError(f"token {token} at position {i} is not allowed by the grammar")
            consumed += self._consume(token)

    def is_terminated(self) -> bool:
        """The grammar is complete and nothing can follow but EOS (or EOS was accepted)."""
        return self._matcher.is_stopped()

    def _allows(self, token: int) -> bool:
        """What the mask says of `token`. Once the grammar is stopped only EOS may follow: llguidance's
        validate_tokens then refuses EOS too, though its mask and consume_token take it."""
        if self._matcher.is_stopped():
            return token in self._eos_token_ids
        return self._matcher.validate_tokens([token]) == 1

    def _consume(self, token: int) -> int:
        """Take an allowed token; returns how many tokens llguidance recorded (what rollback counts): none
        for EOS once the grammar is stopped, which changes nothing there."""
        if self._matcher.is_stopped():
            return 0
        self._matcher.consume_token(token)
        return 1


# keywords whose value is one subschema, a list of them, or a name -> subschema map
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, close: bool = True) -> Any:
    """A copy of `schema` in which every object schema listing `properties` without a word on
    `additionalProperties` (or `unevaluatedProperties`) gets `"additionalProperties": false`, at any depth.
    The members of an `allOf` are not closed themselves (each would refuse the others' properties), only
    what they nest. Example:

    >>> closed_objects({"type": "object", "properties": {"p": {"type": "object", "properties": {}}},
    ...                 "additionalProperties": True})
    {'type': 'object', 'properties': {'p': {'type': 'object', 'properties': {}, 'additionalProperties': False}},
     'additionalProperties': True}
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), (dict, list)):
            value = out[key]
            out[key] = [closed_objects(s) for s in value] if isinstance(value, list) else closed_objects(value)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, close=False) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if close and "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=128)
def _compile(schema_json: str, tokenizer: Tokenizer, vocab_size: int) -> Grammar:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults={"whitespace_pattern": WHITESPACE})
    initial = llguidance.LLMatcher(_ll_tokenizer(tokenizer, vocab_size), grammar, log_level=0)
    if initial.is_error():
        raise ValueError(f"invalid JSON schema: {initial.get_error()}")
    grammar = Grammar(initial, vocab_size, frozenset(tokenizer.eos_token_ids))
    probe = grammar.matcher()
    probe.allowed_mask()  # the first mask: llguidance stops at once where only the empty text fits
    if probe.is_terminated():  # e.g. {"$ref": "#"}, a schema that is only itself (issue 36: answered "")
        raise ValueError('the JSON schema admits no JSON value (a schema that only refers to itself, as '
                         '{"$ref": "#"}, describes nothing)')
    return grammar


def prepare(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Build llguidance's view of `tokenizer` now (a server at start), not in the first structured request: it
    took 1.2 s of Claude Code's first call after a restart (its title request asks for a JSON schema). Nothing
    for a tokenizer without a Hugging Face backend (the tests' byte tokenizers)."""
    if getattr(tokenizer, "backend", None) is not None:
        _ll_tokenizer(tokenizer, vocab_size)


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer: each token's bytes, the special tokens, the EOS ids. Built once
    per tokenizer (about 1 s for Qwen2.5's 151,936 tokens)."""
    eos = list(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
