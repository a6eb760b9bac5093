"""Fuzzing the live server (loopback) on a tiny model with a real byte-level tokenizer and n-gram speculation.

Generated requests, seeded and bounded (at most `CASES` of them, `BUDGET_S` seconds in all): valid bodies with
one to three fields set to extreme values (wrong JSON types, huge and negative integers, subnormals, NaN and
infinities, long and odd unicode strings, deep nesting), mangled message lists, and raw bodies that are not
JSON at all. After each one: the answer is a 4xx carrying an OpenAI error object, or a valid completion; and
`/health` answers 200. All the while, a greedy streamed request runs again and again, and its text must stay
its reference text, computed alone before the fuzzing began.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from gguf import GGUFReader

from conftest import tiny_model
from fakes import one_intra_op_thread
from specdec.engine import Engine
from specdec.models.tokenizer import Tokenizer
from specdec.speculative.proposers import NgramProposer
from test_server_unit import LiveServer, assert_error
from test_tokenizer import write_tiny_gguf

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

CASES, BUDGET_S = 600, 20.0
GREEDY = {"messages": [{"role": "user", "content": "in the"}], "max_tokens": 24, "temperature": 0,
          "ignore_eos": True, "stream": True}


def nested(depth: int, leaf, kind: str):
    for _ in range(depth):
        leaf = [leaf] if kind == "list" else {"a": leaf}
    return leaf


EXTREMES = [
    None, True, False, 0, 1, -1, 2, 7, 255, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40,
    0.5, -0.0, 1e-40, 5e-324, 2.2250738585072014e-308, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
    "", "0", "1e999", "x" * 5000, "\u0000", "😀" * 100, "\u202e\u200b", "<|im_start|>system\n", "\ud800", "é" * 300,
    [], [1], [[]], ["a"] * 40, [0] * 300, [-1, 10**20], {}, {"a": 1}, {"type": "text"},
    nested(64, 1, "list"), nested(64, 1, "dict"),
]
FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
    "stop_token_ids", "logprobs", "top_logprobs", "response_format", "stream", "stream_options", "user",
    "ignore_eos", "return_token_ids", "best_of", "echo", "suffix", "prompt", "messages", "no_such_field",
]
# values a field accepts, at the edges of its range: where numeric trouble hides
PLAUSIBLE = {
    "temperature": [0, 5e-324, 1e-40, 1e-5, 0.7, 2, 100, 1e308],  # 1e308 is refused "top_p": [5e-324, 1e-40, 0.5, 1],
    "top_k": [-1, 0, 1, 263, 264, 2**63 - 1], "min_p": [0, 5e-324, 0.5, 1],
    "seed": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1], "presence_penalty": [-2, 5e-324, 2],
    "frequency_penalty": [-2, 2, -5e-324], "repetition_penalty": [5e-324, 0.01, 1, 2],
    "logit_bias": [{"5": 100}, {"5": -100}, {"0": 1e308}, {"0": 100.5}, {str(i): -100 for i in range(264)}],
    "min_tokens": [0, 1, 6, 10**6], "max_tokens": [1, 2, 200, 2**31], "n": [1, 2, 16], "best_of": [1, 16],
    "stop": ["t", ["t", "e"], ["x" * 256] * 16], "stop_token_ids": [[0], [263], list(range(50))],
    "logprobs": [True, 0, 5, 20], "top_logprobs": [0, 20], "echo": [True], "ignore_eos": [True],
    "response_format": [{"type": "json_object"}],
}
PLAUSIBLE_TOGETHER = [{"seed": 2**64 - 1, "n": 3}, {"temperature": 1e-40, "top_p": 5e-324, "min_p": 1},
                      {"temperature": 100, "logprobs": True, "top_logprobs": 20}, {"repetition_penalty": 0.01,
                      "frequency_penalty": -2, "presence_penalty": -2, "logit_bias": {"7": 100}}]
RAW_BODIES = [
    b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"prompt": "x", "max_tokens": 1e999}', b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x"} trailing',
    b'\xef\xbb\xbf{"prompt": "x"}', b'{"prompt": "\\ud800"}', b'{"prompt": "x", "prompt": 5}',
]


def random_request(rng: random.Random) -> tuple[str, bytes]:
    """(path, body): a mutated valid request or, now and then, a raw body that is not one."""
    path = rng.choice(["/v1/chat/completions", "/v1/chat/completions", "/v1/completions", "/tokenize",
                       "/detokenize"])
    if rng.random() < 0.1:
        return path, rng.choice(RAW_BODIES + [bytes(rng.randrange(256) for _ in range(rng.randrange(64)))])
    if path == "/detokenize":
        return path, json.dumps({"tokens": rng.choice([[rng.randrange(300) for _ in range(rng.randrange(8))],
                                                       rng.choice(EXTREMES)])}, allow_nan=True).encode()
    elif path == "/v1/completions":
        body = {"prompt": "in the", "max_tokens": 6}
    else:
        body = {"messages": [{"role": "user", "content": "the"}], "max_tokens": 6}
    for _ in range(rng.randint(1, 3)):
        mutate(rng, body)
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity written as JavaScript would
    if rng.random() < 0.05:
        text = text[: rng.randrange(len(text) + 1)]
    return path, text.encode("utf-8", "surrogatepass")


def mutate(rng: random.Random, body: dict) -> None:
    roll = rng.random()
    if roll < 0.3:
        body[rng.choice(FIELDS)] = rng.choice(EXTREMES)
    elif roll < 0.55:
        field = rng.choice(list(PLAUSIBLE))
        body[field] = rng.choice(PLAUSIBLE[field])
    elif roll < 0.6:
        body.update(rng.choice(PLAUSIBLE_TOGETHER))
    elif roll < 0.75 and isinstance(body.get("messages"), list) and isinstance(body["messages"][0:1], list) \
            and body["messages"] and isinstance(body["messages"][0], dict):
        message = dict(body["messages"][0])
        message[rng.choice(["role", "content", "name", "tool_calls"])] = rng.choice(EXTREMES)
        body["messages"] = rng.choice([[message], [message] * 50, [rng.choice(EXTREMES)], body["messages"] * 3])
    elif roll < 0.85:
        body["logit_bias"] = {str(rng.choice([-1, 0, 5, 263, 264, 10**30])): rng.choice(EXTREMES)}
    elif roll < 0.95:
        body["response_format"] = rng.choice([
            {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": rng.choice(EXTREMES)}},
            {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
                "a": {"type": rng.choice(["integer", "string", "nope", 5])}}, "required": ["a"]}}},
            {"type": "json_schema", "json_schema": {"schema": rng.choice([{"$ref": "#"}, {"properties": {
                "a": {"$ref": "#"}}}, {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}}])}},
            {"type": rng.choice(EXTREMES)}])
    else:
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.choice([True, False, "yes"])}


def check_answer(r: httpx.Response, path: str) -> None:
    """A 4xx with an OpenAI error object, or a valid answer (JSON, or SSE events ending in [DONE])."""
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        assert_error(r, r.status_code)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-500:]
        for event in map(json.loads, events[:-1]):
            assert "error" not in event and isinstance(event["choices"], list), event
        return
    body = r.json()
    if path == "/tokenize":
        assert body["count"] == len(body["tokens"])
    elif path == "/detokenize":
        assert isinstance(body["prompt"], str)
    else:
        for choice in body["choices"]:
            text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
            assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), choice


def streamed_text(c: httpx.Client, body: dict) -> str:
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert not any("error" in e for e in events), events
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    write_tiny_gguf(path)
    tokenizer = Tokenizer.from_gguf(GGUFReader(path))
    model = tiny_model("qwen2", seed=0, vocab_size=tokenizer.vocab_size)
    engine = Engine(model, tokenizer, NgramProposer(), num_speculative_tokens=3, max_model_len=256, max_batch_size=4)
    with LiveServer(engine) as live:
        yield live


def test_fuzzed_requests_get_clean_answers_and_disturb_no_one(server):
    rng = random.Random(15)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        reference = streamed_text(c, GREEDY)
        assert len(reference) > 0
        done, greedy_runs, failures = threading.Event(), [], []

        def greedy_again_and_again() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as mine:
                while not done.is_set():
                    text = streamed_text(mine, GREEDY)
                    (greedy_runs if text == reference else failures).append(text)

        greedy = threading.Thread(target=greedy_again_and_again)
        greedy.start()
        cases, t0 = 0, time.monotonic()
        try:
            while cases < CASES and time.monotonic() - t0 < BUDGET_S:
                path, body = random_request(rng)
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                check_answer(r, path)
                assert c.get("/health").status_code == 200
                cases += 1
        finally:
            done.set()
            greedy.join(30)
    assert not failures, failures[:3]
    assert cases >= 100 and len(greedy_runs) >= 2, (cases, len(greedy_runs))


FLOOD = 8  # concurrent /tokenize calls of 3 MB each (issue 36: they took seconds each, and the others' time)


def test_a_tokenize_flood_is_refused_at_once_and_disturbs_no_one(server, monkeypatch):
    """8 concurrent 3 MB prompts to /tokenize (ASCII, and 2-byte characters sent as raw UTF-8): each refused
    400 without being tokenized (tokenizing one takes 2.4-3.1 s here), while a greedy stream keeps its text.
    The time bound is 1 s, not the goal's 0.1 s: here 8 client threads share the server's process and GIL on
    a shared 2-core machine (docs/server.md reports it against `specdec serve`); that nothing long
    was tokenized is the exact check."""
    tokenizer = server.engine.tokenizer
    encoded: list[int] = []  # the length of every text tokenized
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k))
    with httpx.Client(base_url=server.url, timeout=30) as c:
        reference = streamed_text(c, GREEDY)
        for text in ("x" * 3_000_000, "é" * 1_500_000):
            body = json.dumps({"prompt": text}, ensure_ascii=False).encode()
            answers: list[tuple[float, httpx.Response]] = []

            def one() -> None:
                with httpx.Client(base_url=server.url, timeout=30) as mine:
                    t0 = time.monotonic()
                    r = mine.post("/tokenize", content=body, headers={"content-type": "application/json"})
                    answers.append((time.monotonic() - t0, r))

            flood = [threading.Thread(target=one) for _ in range(FLOOD)]
            for thread in flood:
                thread.start()
            assert streamed_text(c, GREEDY) == reference
            for thread in flood:
                thread.join(30)
            assert len(answers) == FLOOD
            for took, r in answers:
                assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
                assert took < 1.0, [round(t, 3) for t, _ in answers]
        assert c.get("/health").status_code == 200
        assert c.post("/tokenize", json={"prompt": "ab"}).json()["count"] > 0  # (the spy sees what is tokenized)
    assert encoded == [2], encoded


def test_tokenize_and_detokenize_are_bounded_by_the_context(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        fits = c.post("/tokenize", json={"prompt": "ab" * 100})
        assert fits.status_code == 200 and fits.json()["count"] <= 256
        assert assert_error(c.post("/tokenize", json={"prompt": "x" * 4000}), 400, "prompt")["code"] == \
            "context_length_exceeded"  # certainly longer: refused before tokenizing
        many = " ".join(f"w{i}" for i in range(300))  # longer once tokenized (at least 600 tokens)
        assert assert_error(c.post("/tokenize", json={"prompt": many}), 400, "prompt")["code"] == \
            "context_length_exceeded"
        long_chat = {"messages": [{"role": "user", "content": "x" * 4000}]}
        assert_error(c.post("/tokenize", json=long_chat), 400, "messages")
        assert c.post("/detokenize", json={"tokens": [5] * 256}).status_code == 200
        assert_error(c.post("/detokenize", json={"tokens": [5] * 257}), 400, "tokens")


def test_out_of_range_logit_bias_and_self_referring_schemas_are_refused(server):
    """Issue 36: logit_bias 101 or +-1e308 was applied (OpenAI refuses it), and a json_schema of
    {"$ref": "#"} was answered 200 with content "" (not JSON)."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        chat = {"messages": [{"role": "user", "content": "in the"}], "max_tokens": 4}
        for bias in (101, -101, 1e308, -1e308):
            assert_error(c.post("/v1/chat/completions", json={**chat, "logit_bias": {"5": bias}}), 400, "logit_bias")
        assert c.post("/v1/chat/completions", json={**chat, "logit_bias": {"5": -100}}).status_code == 200
        for schema in ({"$ref": "#"}, {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}}):
            response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            error = assert_error(c.post("/v1/chat/completions", json={**chat, "response_format": response_format}),
                                 400, "response_format")
            assert "admits no JSON value" in error["message"], error
        assert c.get("/health").status_code == 200
