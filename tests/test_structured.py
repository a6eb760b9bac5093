"""Structured output: grammar masks on the tiny byte-level tokenizer (exact tables) and, marked `real`, on
the pulled Qwen2.5 tokenizer; constrained greedy decoding, plain and speculative, over random scorers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_tokenizer import write_tiny_gguf

from specdec.engine.structured import Grammar
from specdec.models import store
from specdec.models.gguf_file import GGUFFile
from specdec.models.tokenizer import Tokenizer

A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
RECORD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": "string", "maxLength": 8},
        "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "d": {"enum": ["x", "y z"]},
    },
    "required": ["a", "b", "c", "d"],
    "additionalProperties": False,
}
WS = {" ", "\t", "\n", "\r"}
DIGITS = set("0123456789")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny_gguf(path)
    return Tokenizer.from_gguf(GGUFFile(path))


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(store.pull("qwen2.5-coder-0.5b-instruct", progress=False)))


@pytest.fixture(params=["tiny", pytest.param("qwen", marks=pytest.mark.real)])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def allowed_texts(tok: Tokenizer, mask: torch.Tensor) -> set[str]:
    return {tok.decode([i]) for i in mask.nonzero().flatten().tolist()}


def after(grammar: Grammar, tok: Tokenizer, text: str):
    matcher = grammar.matcher()
    matcher.advance(tok.encode(text))
    return matcher


def test_masks_allow_exactly_the_valid_next_bytes(tiny):
    """The tiny vocabulary is one token per byte (plus ' t', 'he', ' the', 'in'), so each mask is a table."""
    grammar = Grammar.json_schema(A, tiny)
    eos = {"<|im_end|>", "<|endoftext|>"}
    expected = {
        "": {"{"},
        "{": WS | {'"'},
        "{" + " " * 32: {'"'},  # at most 32 whitespace characters in a row
        '{"': {"a"},  # the schema's properties come first, in order
        '{"a":': WS | DIGITS | {"-"},
        '{"a": 12': WS | DIGITS | {"}"},  # strict: "a" is the only property
        '{"a": 0': WS | {"}"},  # no leading zeros
        '{"a": 12}': eos,  # complete: EOS and nothing else
    }
    for prefix, texts in expected.items():
        assert allowed_texts(tiny, after(grammar, tiny, prefix).allowed_mask()) == texts, prefix
    lenient = Grammar.json_schema(A, tiny, strict=False)  # JSON Schema's open default: more properties may follow
    assert allowed_texts(tiny, after(lenient, tiny, '{"a": 12').allowed_mask()) == WS | DIGITS | {",", "}"}


def test_schemas_are_strict_unless_they_or_the_request_say_otherwise(tiny):
    """Unlisted properties are refused at every depth (as xgrammar in vLLM); `additionalProperties` in the
    schema and `"strict": false` in the response format keep them allowed; a schema without `properties`
    (any object) stays open."""
    nested = {"type": "object", "properties": {"p": A, "q": {"type": "array", "items": A}}, "required": ["p"]}

    def accepts(grammar: Grammar, text: str) -> bool:
        try:
            after(grammar, tiny, text)
            return True
        except ValueError:
            return False

    strict = Grammar.json_schema(nested, tiny)
    assert accepts(strict, '{"p": {"a": 1}, "q": [{"a": 2}]}')
    for extra in ('{"p": {"a": 1}, "x"', '{"p": {"a": 1, "b"', '{"p": {"a": 1}, "q": [{"a": 2, "b"'):
        assert not accepts(strict, extra), extra
        assert accepts(Grammar.json_schema(nested, tiny, strict=False), extra), extra
    assert accepts(Grammar.json_schema({**A, "additionalProperties": True}, tiny), '{"a": 1, "b": 2}')
    assert accepts(Grammar.json_schema({**A, "additionalProperties": {"type": "integer"}}, tiny), '{"a": 1, "b": 2')
    assert accepts(Grammar.json_schema({"type": "object"}, tiny), '{"b": 2}')

    def response_format(**spec) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "n", "schema": A, **spec}}

    assert not accepts(Grammar.from_response_format(response_format(), tiny), '{"a": 1, "b"')
    assert not accepts(Grammar.from_response_format(response_format(strict=True), tiny), '{"a": 1, "b"')
    assert accepts(Grammar.from_response_format(response_format(strict=False), tiny), '{"a": 1, "b"')


def test_closed_objects_leaves_all_of_members_open_and_the_input_unchanged():
    from specdec.engine.structured import closed_objects

    schema = {"allOf": [A, {"properties": {"b": {"type": "object", "properties": {}}}}], "$defs": {"d": A}}
    closed = closed_objects(schema)
    assert "additionalProperties" not in closed["allOf"][0] and "additionalProperties" not in closed["allOf"][1]
    assert closed["allOf"][1]["properties"]["b"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in A and "additionalProperties" not in schema["$defs"]["d"]


def test_masks_and_advance_agree_on_every_token(tiny):
    grammar = Grammar.json_schema(A, tiny)
    done = tiny.encode('{"a": 12}')
    for prefix in ([], tiny.encode('{"a": 1'), done, done + [tiny.eos_token_ids[0]]):
        matcher = grammar.matcher()
        matcher.advance(prefix)
        mask = matcher.allowed_mask()
        for token in range(grammar.vocab_size):
            try:
                grammar.matcher().advance(prefix + [token])
                assert mask[token], (prefix, token)
            except ValueError:
                assert not mask[token], (prefix, token)


def test_first_mask_allows_only_an_opening_brace(tok):
    mask = Grammar.json_schema(A, tok).matcher().allowed_mask()
    texts = allowed_texts(tok, mask)
    assert "{" in texts and all(re.fullmatch(r'\{\s*"?', t) for t in texts)  # no letters, no EOS
    assert not mask[list(tok.eos_token_ids)].any() and not mask[tok.encode("a")].any()


def test_eos_only_when_complete(tok):
    grammar = Grammar.json_schema(A, tok)
    eos = list(tok.eos_token_ids)
    matcher = grammar.matcher()
    masks, n = matcher.masks_along(tok.encode('{"a": 12'))
    assert n == masks.shape[0] and not masks[:, eos].any()
    matcher.advance(tok.encode('{"a": 12'))
    assert not matcher.is_terminated()
    matcher.advance(tok.encode("}"))
    mask = matcher.allowed_mask()
    assert matcher.is_terminated() and mask[eos].all() and mask.sum() == len(eos)
    matcher.advance(eos[:1])
    assert matcher.is_terminated() and torch.equal(matcher.allowed_mask(), mask)
    with pytest.raises(ValueError, match="at position 1 is not allowed"):
        matcher.advance(eos[-1:] + tok.encode(" "))
    matcher = after(grammar, tok, '{"a": 12')
    matcher.advance(tok.encode("}") + eos + eos)  # nothing to roll back for EOS once stopped
    with pytest.raises(ValueError, match="at position 2 is not allowed"):
        matcher.advance(eos + tok.encode(" "))
    assert matcher.is_terminated() and torch.equal(matcher.allowed_mask(), mask)


def test_masks_along_stops_at_the_first_forbidden_token_and_rolls_back(tok):
    grammar = Grammar.json_schema(A, tok)
    matcher = after(grammar, tok, '{"a": 1')
    before = matcher.allowed_mask()
    draft = tok.encode("2") + tok.encode("}") + tok.encode("x") + tok.encode(" ")
    masks, n = matcher.masks_along(draft)
    assert n == 3 and masks.shape == (3, grammar.vocab_size) and masks.dtype == torch.bool
    for i in range(n):  # mask i is the state after draft[:i]
        reference = after(grammar, tok, '{"a": 1')
        reference.advance(draft[:i])
        assert torch.equal(masks[i], reference.allowed_mask()), i
    assert not masks[2, draft[2]]
    assert torch.equal(matcher.allowed_mask(), before)  # rolled back
    masks, n = matcher.masks_along(draft[:2])
    assert n == 3 and torch.equal(masks[0], before)  # every token allowed: len(tokens) + 1 masks
    assert matcher.masks_along([])[1] == 1
    eos = list(tok.eos_token_ids)
    masks, n = matcher.masks_along(draft[:2] + [eos[0], eos[-1]] + draft[2:])  # after EOS, EOS only
    assert n == 5 and all(set(m.nonzero().flatten().tolist()) == set(eos) for m in masks[2:])
    assert torch.equal(matcher.allowed_mask(), before)


def test_advance_refuses_a_forbidden_token_and_keeps_its_state(tok):
    matcher = after(Grammar.json_schema(A, tok), tok, '{"a": ')
    before = matcher.allowed_mask()
    with pytest.raises(ValueError, match="at position 1 is not allowed"):
        matcher.advance(tok.encode("1") + tok.encode("x"))
    assert torch.equal(matcher.allowed_mask(), before)


def test_mask_is_as_wide_as_the_logits(tok):
    grammar = Grammar.json_schema({"type": "string"}, tok, vocab_size=tok.vocab_size + 64)
    mask = after(grammar, tok, '"x').allowed_mask()  # inside a string: almost every token
    assert mask.shape == (tok.vocab_size + 64,) and mask[: tok.vocab_size].sum() > tok.vocab_size // 2
    assert not mask[tok.vocab_size :].any()


def test_compiled_grammars_are_cached_and_matchers_independent(tiny):
    grammar = Grammar.json_schema(A, tiny)
    assert Grammar.json_schema(json.loads(json.dumps(A)), tiny) is grammar
    assert Grammar.from_response_format({"type": "json_object"}, tiny) is Grammar.json_schema({"type": "object"}, tiny)
    first, second = grammar.matcher(), grammar.matcher()
    first.advance(tiny.encode('{"a'))
    assert torch.equal(second.allowed_mask(), grammar.matcher().allowed_mask())


def test_response_formats_and_clear_errors(tiny):
    assert Grammar.from_response_format({"type": "text"}, tiny) is None
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": A, "strict": True}}
    assert Grammar.from_response_format(schema, tiny) is Grammar.json_schema(A, tiny)
    bad_formats = [
        ({"type": "xml"}, "type 'xml' is not supported"),
        ("json", "response_format is an object"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "needs"),
    ]
    bad_schemas = [
        ({"type": "strnig"}, "Invalid type: strnig"),
        ({"$ref": "#/$defs/missing"}, "does not exist"),
        ({"type": "string", "format": "colour"}, "format"),
        ({**A, "required": ["z"], "additionalProperties": False}, "unsatisfiable"),
        ({"$ref": "#"}, "admits no JSON value"),  # llguidance compiles it to the empty text (issue 36)
        ({"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}}, "admits no JSON value"),
    ]
    bad_formats += [({"type": "json_schema", "json_schema": {"name": "a", "schema": s}}, m) for s, m in bad_schemas]
    for response_format, message in bad_formats:
        with pytest.raises(ValueError, match=message):
            Grammar.from_response_format(response_format, tiny)
    with pytest.raises(ValueError, match="not list"):
        Grammar.json_schema([A], tiny)


# ---- decoding with random scorers ----------------------------------------------------------------------


def random_scorer(tok: Tokenizer, vocab_size: int, seed: int):
    """Logits for a prefix: random (a function of seed and prefix), closing characters and EOS raised so
    that outputs end within a few dozen tokens."""
    bonus = torch.zeros(vocab_size)
    closers = [tok.encode(t) for t in ('"', "}", "]", '"}', "}]", "]}", '"]', '"}]')]
    bonus[[ids[0] for ids in closers if len(ids) == 1] + list(tok.eos_token_ids)] = 4.0

    def logits(prefix: list[int]) -> torch.Tensor:  # [vocab_size]
        generator = torch.Generator().manual_seed(hash((seed, *prefix)) % (1 << 62))
        return torch.randn(vocab_size, generator=generator) + bonus

    return logits


def masked_argmax(logits: torch.Tensor, mask: torch.Tensor) -> int:
    return int(logits.masked_fill(~mask, float("-inf")).argmax())


def plain_decode(grammar: Grammar, tok: Tokenizer, logits, max_tokens: int = 300) -> list[int]:
    matcher, out = grammar.matcher(), []
    while len(out) < max_tokens:
        token = masked_argmax(logits(out), matcher.allowed_mask())
        matcher.advance([token])
        out.append(token)
        if token in tok.eos_token_ids:
            assert matcher.is_terminated()
            return out
    raise AssertionError(f"no EOS in {max_tokens} tokens: {tok.decode(out)!r}")


def propose(grammar: Grammar, logits, out: list[int], k: int, generator: torch.Generator) -> list[int]:
    """k drafted tokens: mostly the target's own masked choice, sometimes another allowed token, sometimes
    any token at all (most are forbidden; the rest of that draft is random too)."""
    matcher, draft = grammar.matcher(), []
    matcher.advance(out)
    for _ in range(k):
        u = float(torch.rand((), generator=generator))
        if matcher is None or u < 0.15:
            token = int(torch.randint(grammar.vocab_size, (), generator=generator))
        else:
            scores = logits(out + draft) if u > 0.3 else torch.randn(grammar.vocab_size, generator=generator)
            token = masked_argmax(scores, matcher.allowed_mask())
        draft.append(token)
        if matcher is not None:
            try:
                matcher.advance([token])
            except ValueError:
                matcher = None
    return draft


def speculative_decode(grammar: Grammar, tok: Tokenizer, logits, k: int = 4, max_tokens: int = 300) -> list[int]:
    """The engine's loop: every verified position masked along the draft, greedy acceptance, the matcher
    advanced by the emitted tokens (accepted, then the recovered or bonus token)."""
    matcher, out, generator = grammar.matcher(), [], torch.Generator().manual_seed(7)
    while len(out) < max_tokens:
        draft = propose(grammar, logits, out, k, generator)
        masks, n = matcher.masks_along(draft)
        emitted = []
        for i in range(n):
            token = masked_argmax(logits(out + draft[:i]), masks[i])
            emitted.append(token)
            if i == len(draft) or token != draft[i] or token in tok.eos_token_ids:
                break
        matcher.advance(emitted)
        out += emitted
        if out[-1] in tok.eos_token_ids:
            return out
    raise AssertionError(f"no EOS in {max_tokens} tokens: {tok.decode(out)!r}")


def valid_record(doc) -> bool:
    """RECORD's schema checked by hand (jsonschema is not a dependency)."""
    return (
        isinstance(doc, dict) and list(doc) == ["a", "b", "c", "d"] and type(doc["a"]) is int
        and isinstance(doc["b"], str) and len(doc["b"]) <= 8
        and isinstance(doc["c"], list) and len(doc["c"]) <= 3 and all(type(x) is bool for x in doc["c"])
        and doc["d"] in ("x", "y z")
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_greedy_decoding_gives_valid_json(tok, seed):
    record = Grammar.json_schema(RECORD, tok)
    out = plain_decode(record, tok, random_scorer(tok, record.vocab_size, seed))
    assert valid_record(json.loads(tok.decode(out[:-1]))), tok.decode(out)
    any_object = Grammar.from_response_format({"type": "json_object"}, tok)
    out = plain_decode(any_object, tok, random_scorer(tok, any_object.vocab_size, seed))
    assert isinstance(json.loads(tok.decode(out[:-1])), dict), tok.decode(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_constrained_decoding_equals_plain(tok, seed):
    grammar = Grammar.json_schema(RECORD, tok)
    logits = random_scorer(tok, grammar.vocab_size, seed)
    assert speculative_decode(grammar, tok, logits) == plain_decode(grammar, tok, logits)
