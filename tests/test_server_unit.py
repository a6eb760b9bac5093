"""The HTTP server against a fake engine: fast checks of the protocol, errors, metrics and concurrency.

`FakeEngine` implements the `Engine` interface (add_request / abort_request / has_unfinished_requests /
num_queued / step) over a byte-level tokenizer: every request answers `reply_for(prompt)` followed by EOS, a few tokens
per step (its text and stop rules by the engine's `OutputText`), and records speculative counters as a K=3 draft of which
2 tokens are accepted. A prompt
containing "BOOM" makes `step` raise. With `prefix_caching`, a prompt it has seen before with the same
`cache_salt` counts all its tokens but the last as cached. The server runs under uvicorn in a thread, on a
free local port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec.config import SamplingParams
from specdec.engine.metrics import SpecMetrics
from specdec.engine.output_text import OutputText
from specdec.engine.outputs import RequestOutput
from specdec.server.app import build_app
from specdec.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from specdec.server.cli import add_serve_arguments
from specdec.server.limits import uvicorn_config
from specdec.testing.byte_tokenizer import EOS, ByteTokenizer

MODEL = "fake-model"


# ---- the fake engine ------------------------------------------------------------------------------------


def reply_for(prompt_text: str) -> str:
    """What the fake model answers: non-ASCII on purpose (é is 2 bytes, 😀 is 4)."""
    return f"Héllo 😀! You said {len(prompt_text)} chars. Bye."


def first_tokens(text: str, n: int) -> str:
    """The text of the first n byte tokens (a cut character shows as U+FFFD, as decode flushes it)."""
    return text.encode()[:n].decode(errors="replace")


class FakeEngine:
    def __init__(self, max_model_len: int = 256, tokens_per_step: int = 3, step_delay: float = 0.0,
                 max_batch_size: int = 1, prefix_caching: bool = False):
        self.tokenizer = ByteTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.prefix_caching = prefix_caching
        self.seen: set[tuple] = set()  # (cache_salt, prompt) of every request, with prefix_caching
        self.max_model_len = max_model_len
        self.tokens_per_step, self.step_delay, self.max_batch_size = tokens_per_step, step_delay, max_batch_size
        self.metrics = SpecMetrics()
        self.waiting: deque = deque()
        self.running: dict[str, dict] = {}
        self._aborted: set[str] = set()
        self.aborted_ids: list[str] = []  # for tests: every request ended by abort

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"context is {self.max_model_len} tokens, {n + params.max_tokens} requested")
        key = (cache_salt, tuple(prompt_token_ids))
        cached = n - 1 if self.prefix_caching and key in self.seen else 0
        self.seen.add(key)
        prompt = self.tokenizer.decode(prompt_token_ids)
        answer = list(reply_for(prompt).encode()) + [EOS]
        self.waiting.append(dict(id=request_id, prompt=list(prompt_token_ids), params=params, answer=answer,
                                 out=[], output=OutputText(self.tokenizer, params, self.tokenizer.eos_token_ids),
                                 metrics=SpecMetrics(prompt_tokens=n, cached_tokens=cached), boom="BOOM" in prompt))

    def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def num_queued(self) -> int:
        return max(0, len(self.waiting) - (self.max_batch_size - len(self.running)))

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid in list(self._aborted):
            seq = self.running.pop(rid, None) or next((s for s in self.waiting if s["id"] == rid), None)
            if seq is not None:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                self.aborted_ids.append(rid)
                outputs.append(self._output(seq, [], "abort"))
        self._aborted.clear()
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            self.running[seq["id"]] = seq
        if self.step_delay:
            time.sleep(self.step_delay)
        for seq in list(self.running.values()):
            if seq["boom"]:
                raise RuntimeError("boom")
            outputs.append(self._advance(seq))
        return outputs

    def _advance(self, seq: dict) -> RequestOutput:
        output: OutputText = seq["output"]
        new = output.append(seq["answer"][len(seq["out"]): len(seq["out"]) + self.tokens_per_step])
        seq["out"] += new
        seq["metrics"].record_step(3, 2, len(new))
        if output.finished:
            del self.running[seq["id"]]
            self.metrics.merge(seq["metrics"])
        return self._output(seq, new)

    def _output(self, seq: dict, new: list[int], reason: str | None = None) -> RequestOutput:
        output: OutputText = seq["output"]
        if reason == "abort":
            output.abort()
        return RequestOutput(request_id=seq["id"], prompt_token_ids=seq["prompt"], new_token_ids=new,
                             new_text=output.new_text(), token_ids=seq["out"], text=output.text,
                             finished=output.finished, finish_reason=output.finish_reason,
                             stop_reason=output.stop_reason, metrics=seq["metrics"])


# ---- a live server in a thread --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`serve`'s uvicorn (`uvicorn_config`: its deadlines, `server_options` overriding them) in a thread."""

    def __init__(self, engine: FakeEngine, max_waiting_requests: int | None = None,
                 server_options: dict | None = None, **app_kwargs):
        self.engine = engine
        self.async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
        self.app = build_app(self.async_engine, MODEL, **app_kwargs)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, "127.0.0.1", self.port, log_level="warning", **(server_options or {}))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def live():
    with LiveServer(FakeEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, timeout=20) as c:
        yield c


def chat_body(content: str = "hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def chat_prompt_text(content: str = "hi") -> str:
    return f"<user>{content}\n<assistant>"


def expected_chat_reply(content: str = "hi") -> str:
    return reply_for(chat_prompt_text(content))


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (each event one `data:` line + blank line)."""
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def assert_error(response: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param != "<any>":
        assert error["param"] == param, error
    return error


# ---- the happy paths ------------------------------------------------------------------------------------


def test_info_endpoints(client):
    assert client.get("/health").status_code == 200
    assert "version" in client.get("/version").json()
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 256


def test_chat_completion(client):
    r = client.post("/v1/chat/completions", json=chat_body(temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected_chat_reply()}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt_len = len(b"<user>hi\n<assistant>")
    completion_len = len(expected_chat_reply().encode()) + 1  # EOS included
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
                             "total_tokens": prompt_len + completion_len, "prompt_tokens_details": {"cached_tokens": 0}}
    spec = body["specdec"]
    assert spec["num_drafts"] == spec["target_passes"] and spec["num_draft_tokens"] == 3 * spec["num_drafts"]
    assert spec["emitted_tokens"] == completion_len


def test_completion_length_and_model_optional(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == first_tokens(reply_for("abc"), 5) and choice["finish_reason"] == "length"
    assert r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] == 5


def test_completion_default_max_tokens_is_16_and_token_prompts(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [97, 98, 99]})
    assert r.json()["choices"][0]["text"] == first_tokens(reply_for("abc"), 16)
    for prompt in ([[97, 98, 99]], ["abc"]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
        assert r.json()["choices"][0]["text"] == first_tokens(reply_for("abc"), 16)


def test_chat_without_max_tokens_is_capped_by_default_max_tokens():
    with LiveServer(FakeEngine(), default_max_tokens=5) as server, httpx.Client(base_url=server.url) as c:
        body = c.post("/v1/chat/completions", json=chat_body()).json()
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
        body = c.post("/v1/chat/completions", json=chat_body(max_tokens=7)).json()
        assert body["usage"]["completion_tokens"] == 7


def test_stop_string(client):
    r = client.post("/v1/chat/completions", json=chat_body(stop=["You said", "never"])).json()
    assert r["choices"][0]["message"]["content"] == "Héllo 😀! "
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == "You said"
    r = client.post("/v1/completions", json={"prompt": "x", "stop": "!"}).json()
    assert r["choices"][0]["text"] == "Héllo 😀"


@pytest.mark.parametrize("stop", ["You said", "!", ["Bye", "chars"]])
def test_stop_string_streamed_equals_not_streamed(client, stop):
    """A stop string across steps: the engine cuts it off its text once complete; no part of it is streamed."""
    whole = client.post("/v1/chat/completions", json=chat_body(stop=stop)).json()["choices"][0]["message"]
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stop=stop, stream=True)) as r:
        r.read()
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["content"]


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    body = chat_body(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, tool_choice="none",
                     response_format={"type": "text"}, logit_bias={}, user="u1", top_k=-1, seed=7,
                     max_completion_tokens=4)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4  # max_completion_tokens applies
    r = client.post("/v1/completions", json={"prompt": "x", "echo": False, "best_of": 1, "suffix": "", "n": 1})
    assert r.status_code == 200, r.text


def test_fields_that_do_not_change_the_output_are_accepted(client):
    """OpenAI's `name` on messages, `user`, `store`, `metadata` and `service_tier`: accepted, same answer."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief", "name": "ops"},
                                         {"role": "user", "content": "hi", "name": "alice"}],
            "user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reply_for("<system>be brief\n<user>hi\n<assistant>")
    r = client.post("/tokenize", json={"messages": body["messages"]})
    assert r.status_code == 200 and r.json()["count"] == len(b"<system>be brief\n<user>hi\n<assistant>")


def test_n_choices_and_several_prompts(client):
    r = client.post("/v1/chat/completions", json=chat_body(n=3, max_tokens=5))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == first_tokens(expected_chat_reply(), 5) for c in body["choices"])
    prompt_tokens = len(chat_prompt_text("hi").encode())
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 15, "total_tokens": prompt_tokens + 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    r = client.post("/v1/completions", json={"prompt": ["ab", "abcd"], "n": 2, "max_tokens": 40})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [reply_for("ab")] * 2 + [reply_for("abcd")] * 2  # prompt i: choices 2i, 2i+1
    assert r.json()["usage"]["prompt_tokens"] == 6


def test_n_choices_streamed(client):
    with client.stream("POST", "/v1/chat/completions", json=chat_body(n=2, stream=True,
                                                                     stream_options={"include_usage": True})) as r:
        r.read()
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    texts, finished = {0: "", 1: ""}, set()
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"] is not None:
                finished.add(c["index"])
    assert texts == {0: expected_chat_reply(), 1: expected_chat_reply()} and finished == {0, 1}
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(expected_chat_reply().encode()) + 2  # + EOS each


def test_echo_puts_the_prompt_before_the_completion(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "echo": True, "max_tokens": 40})
    assert r.json()["choices"][0]["text"] == "abc" + reply_for("abc")
    with client.stream("POST", "/v1/completions", json={"prompt": "abc", "echo": True, "stream": True,
                                                        "max_tokens": 40}) as r:
        r.read()
    text = "".join(c["choices"][0]["text"] for c in map(json.loads, sse_events(r)[:-1]) if c["choices"])
    assert text == "abc" + reply_for("abc")


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "héllo"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 6, "max_model_len": 256, "tokens": list("héllo".encode())}
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == list(chat_prompt_text("hi").encode())
    assert client.post("/detokenize", json={"tokens": list("héllo".encode())}).json() == {"prompt": "héllo"}
    for bad, param in (({"tokens": [999]}, "tokens"), ({"tokens": "x"}, "tokens")):
        assert_error(client.post("/detokenize", json=bad), 400, param)
    assert_error(client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]}), 400)


def test_generation_config_defaults_fill_what_requests_leave_out():
    class Recording(FakeEngine):
        def add_request(self, request_id, prompt_token_ids, params, cache_salt=None):
            super().add_request(request_id, prompt_token_ids, params, cache_salt)
            self.params = params

    defaults = {"temperature": 0.3, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7}
    with LiveServer(Recording(), sampling_defaults=defaults) as server, httpx.Client(base_url=server.url) as c:
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        p = server.engine.params
        assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens, p.top_p) == (0.3, 20, 1.05, 7, 1.0)
        assert c.post("/v1/chat/completions", json=chat_body(temperature=0, top_k=-1, max_tokens=3)).status_code == 200
        p = server.engine.params
        assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0, 0, 1.05, 3)


def test_chat_stream_format(client):
    with client.stream("POST", "/v1/chat/completions",
                       json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        r.read()
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in content_chunks)  # OpenAI: null on every other chunk
    deltas = [c["choices"][0]["delta"].get("content", "") for c in content_chunks]
    assert "".join(deltas) == expected_chat_reply()
    assert not any("\ufffd" in d for d in deltas)  # never half a UTF-8 character
    assert len([d for d in deltas if d]) > 3  # streamed in pieces, not at the end
    final = content_chunks[-1]
    assert final["choices"][0]["finish_reason"] == "stop" and "specdec" in final
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks[:-1])


def test_completion_stream_without_usage(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 12, "stream": True}) as r:
        r.read()
    events = sse_events(r)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == first_tokens(reply_for("abc"), 12)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client_parses_answers(live):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=live.url + "/v1", api_key="unused")
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=50)
    assert r.choices[0].message.content == expected_chat_reply() and r.usage.total_tokens > 0
    stream = oa.completions.create(model=MODEL, prompt="abc", max_tokens=8, stream=True,
                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first_tokens(reply_for("abc"), 8)
    assert chunks[-1].usage.completion_tokens == 8
    assert [m.id for m in oa.models.list()] == [MODEL]


# ---- errors: each one has its status and error JSON, and the server answers normally afterwards ---------

BAD_REQUESTS = [
    # (path, body, status, param)
    ("chat", b"{not json", 400, None),
    ("chat", b"", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", chat_body(temperature="hot"), 400, "temperature"),
    ("chat", chat_body(max_tokens="5"), 400, "max_tokens"),
    ("chat", chat_body(max_tokens=2.5), 400, "max_tokens"),
    ("chat", chat_body(stream="yes"), 400, "stream"),
    ("chat", chat_body(max_tokens=-1), 400, "max_tokens"),
    ("chat", chat_body(max_tokens=0), 400, "max_tokens"),
    ("chat", chat_body(max_completion_tokens=-5), 400, "max_completion_tokens"),
    ("chat", chat_body(temperature=-0.1), 400, "temperature"),
    ("chat", chat_body(top_p=0), 400, "top_p"),
    ("chat", chat_body(top_p=1.5), 400, "top_p"),
    ("chat", chat_body(top_k=-2), 400, "top_k"),
    ("chat", chat_body(seed="x"), 400, "seed"),
    ("chat", chat_body(stop=3), 400, "stop"),
    ("chat", chat_body(stop=[""]), 400, "stop"),
    ("chat", chat_body(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("chat", chat_body(stop="x" * 257), 400, "stop"),
    ("chat", chat_body(n=0), 400, "n"),
    ("chat", chat_body(n=17), 400, "n"),
    ("chat", chat_body(top_logprobs=3), 400, "top_logprobs"),  # without logprobs
    ("chat", chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat", chat_body(tools=[{"type": "code_interpreter"}]), 400, "tools[0].type"),
    ("chat", chat_body(tool_choice="auto"), 400, "tool_choice"),
    ("chat", chat_body(response_format={"type": "xml"}), 400, "response_format"),
    ("chat", chat_body(presence_penalty=2.5), 400, "presence_penalty"),
    ("chat", chat_body(frequency_penalty=-3), 400, "frequency_penalty"),
    ("chat", chat_body(repetition_penalty=0), 400, "repetition_penalty"),
    ("chat", chat_body(repetition_penalty=5e-324), 400, "repetition_penalty"),
    ("chat", json.dumps(chat_body(temperature=float("inf"))).encode(), 400, "temperature"),  # Infinity
    ("chat", chat_body(temperature=101), 400, "temperature"),
    ("chat", json.dumps(chat_body(logit_bias={"5": float("nan")})).encode(), 400, "logit_bias"),  # NaN
    ("chat", chat_body(logit_bias={"fifty": 10}), 400, "logit_bias"),
    ("chat", chat_body(logit_bias={"5": 101}), 400, "logit_bias"),  # OpenAI's range: [-100, 100]
    ("chat", chat_body(logit_bias={"5": -100.5}), 400, "logit_bias"),
    ("chat", chat_body(logit_bias={"5": 1e308}), 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": -1e308}}, 400, "logit_bias"),
    ("chat", chat_body(logit_bias={"9999": 10}), 400, "logit_bias"),  # outside the vocabulary
    ("chat", chat_body(stop_token_ids=[300]), 400, "stop_token_ids"),
    ("chat", chat_body(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("chat", chat_body(min_p=1.5), 400, "min_p"),
    ("chat", chat_body(min_tokens=-1), 400, "min_tokens"),
    ("chat", chat_body(min_tokens=50, max_tokens=10), 400, None),
    ("chat", chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
    ("chat", chat_body(whatever=1), 400, "whatever"),
    ("chat", {"model": MODEL}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    ("chat", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),  # the template refuses
    ("chat", chat_body("x" * 300), 400, "messages"),  # longer than the context (256)
    ("chat", chat_body(max_tokens=250), 400, "messages"),  # prompt + max_tokens over the context
    ("completions", {"prompt": "x", "best_of": 3, "n": 4}, 400, "best_of"),
    ("completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": ["a"] * 17}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b", "c"], "n": 6}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [5, 999]}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat", chat_body(model="gpt-4"), 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_request(client, path, body, status, param):
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    r = client.post(url, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
        else client.post(url, json=body)
    error = assert_error(r, status, param)
    if param == "messages" and "context" in error["message"]:
        assert error["code"] == "context_length_exceeded" and "256" in error["message"]
    # and the server still answers correctly
    ok = client.post("/v1/chat/completions", json=chat_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == expected_chat_reply()


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_api_key():
    with LiveServer(FakeEngine(), api_key="sk-test") as server, httpx.Client(base_url=server.url) as c:
        assert_error(c.post("/v1/chat/completions", json=chat_body()), 401)
        assert_error(c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "sk-test"}), 401)
        assert_error(c.post("/v1/chat/completions", content=b"{bad", headers={"Authorization": "x"}), 401)
        assert c.get("/health").status_code == 200
        good = {"Authorization": "Bearer sk-test"}
        assert c.post("/v1/chat/completions", json=chat_body(), headers=good).status_code == 200
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.get("/metrics", headers=good).status_code == 200
        # every route the app has, those added later included, and paths it does not have: 401 without the key
        routes = [(method, route.path) for route in server.app.routes for method in getattr(route, "methods", ())
                  if method != "HEAD"]
        assert {"/tokenize", "/detokenize", "/metrics", "/version", "/openapi.json"} <= {p for _, p in routes}
        for method, path in routes + [("GET", "/docs"), ("GET", "/nothing"), ("OPTIONS", "/v1/chat/completions")]:
            if path != "/health":  # an OpenAI error object; Anthropic's own shape on its /v1/messages routes
                r = c.request(method, path, json={"prompt": "x" * 100})
                if path.startswith("/v1/messages"):
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
                else:
                    assert_error(r, 401)
    with LiveServer(FakeEngine(), api_key="sk-test", public_metrics=True) as server, \
            httpx.Client(base_url=server.url) as c:  # a scraper without the key reads /metrics, and only it
        assert c.get("/metrics").status_code == 200 and c.get("/health").status_code == 200
        assert_error(c.get("/version"), 401)
        assert_error(c.post("/tokenize", json={"prompt": "x"}), 401)


def test_body_size_limit():
    with LiveServer(FakeEngine(), max_body_bytes=2000) as server, httpx.Client(base_url=server.url) as c:
        big = chat_body("x" * 5000)
        error = assert_error(c.post("/v1/chat/completions", json=big), 413)
        assert error["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit applies while the body streams in
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        assert_error(c.post("/v1/chat/completions", content=chunked()), 413)
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_engine_failure_is_a_500_and_the_server_survives():
    with LiveServer(FakeEngine()) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        assert_error(c.post("/v1/chat/completions", json=chat_body("BOOM")), 500)
        with c.stream("POST", "/v1/completions", json={"prompt": "BOOM", "stream": True}) as r:
            r.read()
        events = sse_events(r)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert c.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["message"]["content"] == \
            expected_chat_reply()
        assert c.get("/health").status_code == 200


class CrashingTokenizer(ByteTokenizer):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if "CRASH" in text:
            raise ZeroDivisionError("secret detail")
        return super().encode(text)


def test_an_unexpected_error_is_a_generic_500_with_an_id_in_the_log(caplog):
    """A bug answering a request: the client gets a generic message and an id (also in X-Request-Id); the
    exception itself goes only to the log, under that id."""
    engine = FakeEngine()
    engine.tokenizer = CrashingTokenizer()
    with LiveServer(engine) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=chat_body("CRASH"))
        error = assert_error(r, 500)
        assert error["code"] == "internal_error" and error["type"] == "server_error"
        error_id = r.headers["x-request-id"]
        assert error_id in error["message"] and "secret" not in r.text and "ZeroDivision" not in r.text
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
    (record,) = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert record.exc_info[0] is ZeroDivisionError


@pytest.mark.parametrize("special", [False, True])
def test_special_tokens_in_messages_setting_reaches_the_tokenizer(special):
    """Chat and /tokenize render messages with special-token text plain by default (test_tokenizer.py checks
    the tokenization itself), as it was with `--special-tokens-in-messages`."""
    engine, seen = FakeEngine(), []
    render = engine.tokenizer.render_chat
    engine.tokenizer.render_chat = lambda m, gen=True, special_text=False, tools=None: \
        seen.append(special_text) or render(m, gen, tools=tools)
    with LiveServer(engine, special_tokens_in_messages=special) as server, httpx.Client(base_url=server.url) as c:
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        assert c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert seen == [special, special]
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["--special-tokens-in-messages"] * special)
    assert args.special_tokens_in_messages is special


def test_a_prompt_certainly_too_long_is_refused_before_tokenizing():
    engine = FakeEngine()
    encoded = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, add_special_tokens=False: encoded.append(len(text)) or encode(text)
    with LiveServer(engine) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        for path, body in (("/v1/completions", {"prompt": "x" * 3_000_000}),
                           ("/v1/chat/completions", chat_body("é" * 1_000_000))):
            error = assert_error(c.post(path, json=body), 400)
            assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
        assert encoded == []
        assert c.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 5}).status_code == 200


def test_context_overflow_is_openais_context_length_exceeded(live):
    """The openai SDK and Codex act on `code: "context_length_exceeded"`: a 400 in OpenAI's shape and words,
    streamed or not, the prompt's exact tokens where it was tokenized, a bound where it was refused before."""
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    head = "This model's maximum context length is 256 tokens. However, "
    content = "é" * 130  # 130 characters, under the bound; 260 bytes, so 278 tokens with the template
    n, hi = len(chat_prompt_text(content).encode()), len(chat_prompt_text("hi").encode())
    cases = [  # (call, param, message)
        (lambda: oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}]),
         "messages", f"{head}your messages resulted in {n} tokens. Please reduce the length of the messages."),
        (lambda: list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                 stream=True)),
         "messages", f"{head}your messages resulted in {n} tokens. Please reduce the length of the messages."),
        (lambda: oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=250),
         "messages", f"{head}you requested {hi + 250} tokens ({hi} in the messages, 250 in the completion). Please "
                     "reduce the length of the messages or completion."),
        (lambda: oa.completions.create(model=MODEL, prompt="é" * 200, max_tokens=5),
         "prompt", f"{head}your prompt resulted in 400 tokens. Please reduce the length of the prompt."),
        (lambda: list(oa.completions.create(model=MODEL, prompt="x" * 300, stream=True)),
         "prompt", f"{head}your prompt resulted in at least 300 tokens. Please reduce the length of the prompt."),
    ]
    for call, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400 and e.value.body == {
            "message": message, "type": "invalid_request_error", "param": param, "code": "context_length_exceeded"}
        assert e.value.code == "context_length_exceeded"  # what the SDK's users read
        # and the server answers the next request
        r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=50)
        assert r.choices[0].message.content == expected_chat_reply()
    r = httpx.post(live.url + "/v1/chat/completions", json=chat_body(content, stream=True))
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"  # refused before the stream
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_models_report_max_model_len_as_vllm():
    openai = pytest.importorskip("openai")
    with LiveServer(FakeEngine(max_model_len=8192)) as server:
        models = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").models.list().data
        assert [(m.id, m.max_model_len) for m in models] == [(MODEL, 8192)]


# ---- metrics --------------------------------------------------------------------------------------------


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return samples


def test_metrics_move_by_the_right_amounts(client):
    before = scrape(client)
    body = client.post("/v1/chat/completions", json=chat_body("metrics please")).json()
    after = scrape(client)
    delta = lambda name, **labels: after.get((name, tuple(sorted(labels.items()))), 0) - \
        before.get((name, tuple(sorted(labels.items()))), 0)  # noqa: E731
    spec, usage = body["specdec"], body["usage"]
    assert delta("specdec:spec_decode_num_drafts_total") == spec["num_drafts"] > 0
    assert delta("specdec:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert delta("specdec:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    for pos, n in enumerate(spec["accepted_per_position"]):
        assert delta("specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == n
    assert delta("specdec:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
    assert delta("specdec:generation_tokens_total") == usage["completion_tokens"]
    assert delta("specdec:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("specdec:request_success_total", finished_reason="stop") == 1
    assert delta("specdec:time_to_first_token_seconds_count") == 1
    assert delta("specdec:e2e_request_latency_seconds_count") == 1
    assert delta("specdec:request_time_per_output_token_seconds_count") == 1
    assert delta("specdec:http_requests_total", method="POST", path="/v1/chat/completions", status="200") == 1
    assert after[("specdec:num_requests_running", ())] == 0


def test_cached_prompt_tokens_in_usage_and_metrics_per_cache_salt():
    """The engine's cached tokens reach `usage.prompt_tokens_details.cached_tokens` (streamed usage too) and
    vLLM's prefix-cache counters; `cache_salt` reaches the engine, and an empty salt is refused."""
    with LiveServer(FakeEngine(prefix_caching=True)) as server, httpx.Client(base_url=server.url, timeout=20) as c:
        def cached(**kw) -> int:
            return c.post("/v1/chat/completions", json=chat_body("cache me", **kw)).json()["usage"][
                "prompt_tokens_details"]["cached_tokens"]

        n = len(b"<user>cache me\n<assistant>")
        before = scrape(c)
        assert [cached(), cached(), cached(cache_salt="t1"), cached(cache_salt="t1"), cached(cache_salt="t2")] == \
            [0, n - 1, 0, n - 1, 0]
        after = scrape(c)
        delta = lambda name: after[(name, ())] - before.get((name, ()), 0)  # noqa: E731
        assert delta("specdec:prefix_cache_queries_total") == 5 * n
        assert delta("specdec:prefix_cache_hits_total") == 2 * (n - 1)
        with c.stream("POST", "/v1/completions", json={"prompt": "cache me", "stream": True, "max_tokens": 3,
                                                        "stream_options": {"include_usage": True}}) as r:
            r.read()
        with c.stream("POST", "/v1/completions", json={"prompt": "cache me", "stream": True, "max_tokens": 3,
                                                        "stream_options": {"include_usage": True}}) as r:
            usage = json.loads([line for line in r.iter_lines() if line.startswith("data: {")][-1][6:])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": len(b"cache me") - 1}
        # n choices share their prompt: what the first prefilled is not cached, though the others found it
        assert [cached(cache_salt="n", n=3), cached(cache_salt="n", n=3)] == [0, n - 1]
        r = c.post("/v1/chat/completions", json=chat_body("x", cache_salt=""))
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_metrics_count_errors(client):
    before = scrape(client)
    client.post("/v1/chat/completions", json=chat_body(n=0))
    after = scrape(client)
    key = ("specdec:http_requests_total", (("method", "POST"), ("path", "/v1/chat/completions"), ("status", "400")))
    assert after[key] - before.get(key, 0) == 1


def test_metric_labels_stay_bounded(client):
    """Methods other than GET and POST, and invented paths, count as "other": /metrics does not grow with what
    clients send. (Invented methods never reach the app: the HTTP parser, llhttp, answers them 400.)"""
    for i, method in enumerate(["PROPFIND", "MKCOL", "LOCK", "PURGE", "SEARCH"] * 6):
        client.request(method, f"/v1/invented{i}")
        client.get(f"/nothing/{i}")
    assert client.request("FOO1", "/v1/models").status_code == 400
    labels = {labels for name, labels in scrape(client) if name == "specdec:http_requests_total"}
    methods = {dict(labels)["method"] for labels in labels}
    paths = {dict(labels)["path"] for labels in labels}
    assert methods <= {"GET", "POST", "other"} and "other" in methods
    assert all(not p.startswith(("/v1/invented", "/nothing")) for p in paths) and "other" in paths
    assert len(labels) < 40


# ---- concurrency, disconnects, shutdown -----------------------------------------------------------------


async def streamed_chat_text(c: httpx.AsyncClient, content: str) -> str:
    """Stream one chat completion and return its text (asserting a 200)."""
    async with c.stream("POST", "/v1/chat/completions", json=chat_body(content, stream=True)) as r:
        assert r.status_code == 200
        text = ""
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["delta"].get("content", "") if choices else ""
        return text


def test_concurrent_streams_are_all_served_and_the_loop_stays_free():
    engine = FakeEngine(step_delay=0.02, tokens_per_step=2)  # queued one at a time, ~0.5 s per request
    with LiveServer(engine) as server:

        async def one(c: httpx.AsyncClient, i: int) -> str:
            return await streamed_chat_text(c, f"client {i}")

        async def health_latency(c: httpx.AsyncClient) -> float:
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            return time.perf_counter() - t0

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                return await asyncio.gather(*(one(c, i) for i in range(5)), health_latency(c))

        *texts, latency = asyncio.run(main())
        assert texts == [expected_chat_reply(f"client {i}") for i in range(5)]
        assert latency < 0.2  # answered while the engine was busy
        assert not engine.has_unfinished_requests()


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_stream_disconnect_aborts_and_frees_the_slot():
    engine = FakeEngine(step_delay=0.05, tokens_per_step=1)  # ~3 s for a whole answer
    with LiveServer(engine) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body("going away", stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            request_id = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
        # leaving the block closed the connection mid-stream
        wait_until(lambda: request_id in engine.aborted_ids)
        wait_until(lambda: not engine.has_unfinished_requests())
        t0 = time.time()
        assert c.post("/v1/completions", json={"prompt": "next", "max_tokens": 5}).json()["choices"][0]["text"] == \
            first_tokens(reply_for("next"), 5)
        assert time.time() - t0 < 1.5  # not queued behind the abandoned request
        samples = scrape(c)
        assert samples[("specdec:request_success_total", (("finished_reason", "abort"),))] == 1
        assert samples[("specdec:num_requests_running", ())] == 0


def test_non_stream_disconnect_aborts():
    engine = FakeEngine(step_delay=0.05, tokens_per_step=1)
    with LiveServer(engine) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/chat/completions", json=chat_body("impatient"), timeout=0.5)
        wait_until(lambda: len(engine.aborted_ids) == 1)
        wait_until(lambda: not engine.has_unfinished_requests())


def test_async_engine_shutdown_ends_streams():
    engine = FakeEngine(step_delay=0.05, tokens_per_step=1)
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def main():
        stream = await async_engine.add_request("r1", list(b"hello"), SamplingParams(max_tokens=50))
        got = []
        with pytest.raises(EngineStoppedError):
            async for out in stream:
                got.append(out)
                if len(got) == 2:
                    async_engine.shutdown(timeout=0)
        with pytest.raises(EngineStoppedError):
            await async_engine.add_request("r2", list(b"hello"), SamplingParams())

    asyncio.run(main())
    async_engine.shutdown()
    assert not async_engine.healthy


def test_async_engine_run_drives_the_loop_in_the_calling_thread():
    """own_thread=False (what `specdec serve` does with its main thread): `start()` starts nothing, `run()`
    steps the engine in the caller's thread until `shutdown()`, which, called from another thread, waits
    for the loop to end and fail what is in flight."""
    engine = FakeEngine(step_delay=0.01, tokens_per_step=1)
    async_engine = AsyncEngine(engine, own_thread=False)
    async_engine.start()
    assert not async_engine._thread.is_alive()
    stepped_in = []
    async_engine.add_step_listener(lambda outputs: stepped_in.append(threading.current_thread().name))
    driver = threading.Thread(target=async_engine.run, name="driver")
    driver.start()

    async def main():
        stream = await async_engine.add_request("r1", list(b"hi"), SamplingParams(max_tokens=50))
        assert "".join([out.new_text async for out in stream]) == reply_for("hi")
        long = await async_engine.add_request("r2", list(b"hello"), SamplingParams(max_tokens=50))
        outputs = long.__aiter__()
        await outputs.__anext__()
        assert async_engine.healthy and set(stepped_in) == {"driver"}
        await asyncio.to_thread(async_engine.shutdown)  # from another thread: waits for the loop to end
        assert async_engine._done.is_set() and not async_engine.healthy
        with pytest.raises(EngineStoppedError):
            async for _ in outputs:
                pass

    asyncio.run(main())
    driver.join(5)
    assert not driver.is_alive()
    with pytest.raises(RuntimeError, match="own_thread=False"):
        AsyncEngine(FakeEngine()).run()


def test_async_engine_refusal_is_a_value_error():
    async_engine = AsyncEngine(FakeEngine(max_model_len=8))
    async_engine.start()

    async def main():
        with pytest.raises(ValueError, match="context"):
            await async_engine.add_request("r", list(b"hello"), SamplingParams(max_tokens=5))

    asyncio.run(main())
    async_engine.shutdown()


# ---- the queue limit ------------------------------------------------------------------------------------


def test_full_queue_is_a_503_and_the_others_complete():
    """max_batch_size 1, --max-waiting-requests 1: the first request runs, the second waits, a third (either
    endpoint, streamed or not) is answered 503 `queue_full` with Retry-After at once; the first two complete
    exactly as they would alone, and once the queue moved a request is taken again."""
    engine = FakeEngine(step_delay=0.05, tokens_per_step=2)  # ~1 s per request
    with LiveServer(engine, max_waiting_requests=1) as server:

        streamed = streamed_chat_text

        async def until(predicate) -> None:
            deadline = time.time() + 5
            while not predicate():
                assert time.time() < deadline, "timed out"
                await asyncio.sleep(0.01)

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                first = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat_body("first")))
                await until(lambda: len(engine.running) == 1)
                second = asyncio.ensure_future(streamed(c, "second"))
                await until(lambda: len(engine.waiting) == 1)
                refused = [
                    await c.post("/v1/chat/completions", json=chat_body("third")),
                    await c.post("/v1/chat/completions", json=chat_body("third", stream=True)),
                    await c.post("/v1/completions", json={"prompt": "third", "max_tokens": 5}),
                    await c.post("/v1/completions", json={"prompt": "third", "stream": True}),
                ]
                assert len(engine.running) == 1 and len(engine.waiting) == 1  # all refused while both were busy
                return (await first).json(), await second, refused

        first, second, refused = asyncio.run(main())
        for r in refused:
            error = assert_error(r, 503, None)
            assert error["code"] == "queue_full" and error["type"] == "server_error"
            assert "max_waiting_requests = 1" in error["message"]
            assert r.headers["retry-after"] == "1"
        assert first["choices"][0]["message"]["content"] == expected_chat_reply("first")
        assert second == expected_chat_reply("second")
        assert not engine.has_unfinished_requests() and engine.aborted_ids == []
        with httpx.Client(base_url=server.url, timeout=10) as c:
            r = c.post("/v1/chat/completions", json=chat_body("fourth"))
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
                expected_chat_reply("fourth")
            samples = scrape(c)
        key = ("specdec:http_requests_total", (("method", "POST"), ("path", "/v1/chat/completions"), ("status", "503")))
        assert samples[key] == 2
        assert samples[("specdec:num_requests_running", ())] == 0


@pytest.mark.parametrize("max_batch_size,limit", [(1, 1), (1, 3), (2, 1)])
def test_async_engine_counts_only_requests_waiting_for_a_slot(max_batch_size, limit):
    """Requests added together: the first `max_batch_size` take the free slots (even before the engine steps),
    the next `limit` wait, the one after is refused with QueueFullError; the accepted ones all complete."""
    engine = FakeEngine(step_delay=0.02, tokens_per_step=2, max_batch_size=max_batch_size)
    async_engine = AsyncEngine(engine, max_waiting_requests=limit)
    async_engine.start()
    params = SamplingParams(max_tokens=4)

    async def main():
        n = max_batch_size + limit + 1
        added = await asyncio.gather(*(async_engine.add_request(f"r{i}", list(b"hello"), params) for i in range(n)),
                                     return_exceptions=True)
        *accepted, refused = added
        assert isinstance(refused, QueueFullError) and refused.limit == limit
        for stream in accepted:
            outs = [out async for out in stream]
            assert outs[-1].finished and outs[-1].token_ids == list(reply_for("hello").encode()[:4])
        again = await async_engine.add_request("again", list(b"hello"), params)  # the queue moved
        assert [out async for out in again][-1].finished

    asyncio.run(main())
    async_engine.shutdown()


def test_limits_are_bounded_by_default_and_flags_change_them():
    parser = add_serve_arguments(argparse.ArgumentParser())
    defaults = parser.parse_args([])
    assert (defaults.max_waiting_requests, defaults.limit_concurrency, defaults.default_max_tokens) == (64, 256, 1024)
    args = parser.parse_args(["--max-waiting-requests", "8", "--limit-concurrency", "9", "--default-max-tokens", "10"])
    assert (args.max_waiting_requests, args.limit_concurrency, args.default_max_tokens) == (8, 9, 10)
    for flag in ("--max-waiting-requests", "--limit-concurrency", "--default-max-tokens"):
        for bad in ("0", "-1", "x"):
            with pytest.raises(SystemExit):
                parser.parse_args([flag, bad])
    with pytest.raises(ValueError, match=">= 1"):
        AsyncEngine(FakeEngine(), max_waiting_requests=0)


SERVER_PROCESS = textwrap.dedent("""
    import argparse, sys
    sys.path.insert(0, {tests!r})
    from test_server_unit import FakeEngine
    from specdec.server.cli import _serve, add_serve_arguments

    class FakeLLM:
        engine = FakeEngine(step_delay={step_delay!r}, tokens_per_step=1)

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args({args!r})
    sys.exit(_serve(FakeLLM(), ["fake-model"], args))
""")


@contextlib.contextmanager
def server_process(*flags: str, step_delay: float = 0.05):
    """`_serve` (what `specdec serve` runs) over a FakeEngine (~2.5 s per chat answer at a `step_delay` of
    0.05 s) in a process of its own: yields (process, url); its output must hold no traceback."""
    port = free_port()
    code = SERVER_PROCESS.format(tests=str(Path(__file__).parent), args=["--port", str(port), *flags],
                                 step_delay=step_delay)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url + "/health"), timeout=20)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode()
    assert "Traceback" not in output, output


def streamed_events(lines) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_sigterm_drains_then_exits():
    """SIGTERM mid-stream: /health and new requests are answered 503 at once, the stream in flight runs to
    its end untouched, then the process exits 0. The answer takes ~7.5 s, so that the checks made while it
    drains end before it does on a loaded machine too (with ~2.5 s answers the test failed at times under load;
    a check made after the answer's end finds the process gone)."""
    with server_process(step_delay=0.15) as (proc, url), httpx.Client(base_url=url, timeout=10) as c, \
            c.stream("POST", "/v1/chat/completions", json=chat_body("long", stream=True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=url, timeout=5) as other:
            wait_until(lambda: other.get("/health").status_code == 503)
            for body in (chat_body("new"), chat_body("new", stream=True)):
                assert assert_error(other.post("/v1/chat/completions", json=body), 503)["code"] == "engine_unavailable"
        events = streamed_events(lines)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == \
            expected_chat_reply("long")  # the first event, read above, carried the role only
        assert proc.wait(timeout=15) == 0


def _thread_nice(pid: int) -> dict[int, int]:
    """Each thread's nice value (field 19 of /proc/PID/task/TID/stat), by thread id."""
    nice = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nice[int(tid)] = int(f.read().rpartition(")")[2].split()[16])
    return nice


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("flags, steps", [((), 5), (("--engine-nice", "2"), 2), (("--engine-nice", "0"), 0)])
def test_the_engine_threads_run_nicer_than_the_http_thread(flags, steps):
    """The engine loop (the main thread) and the threads started before the server are `steps` of nice below
    the process's start; the HTTP thread, and the threads it starts, keep it; the server answers as usual."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with server_process(*flags) as (proc, url), httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected_chat_reply()
        nice = _thread_nice(proc.pid)
        assert nice[proc.pid] == min(19, base + steps), nice  # the main thread: the engine loop
        assert base in nice.values(), nice  # the HTTP thread
        assert set(nice.values()) <= {base, min(19, base + steps)}, nice


def test_the_engine_nice_flag():
    from specdec.server.cli import add_serve_arguments

    parser = add_serve_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).engine_nice == 5
    assert parser.parse_args(["--engine-nice", "19"]).engine_nice == 19
    for bad in ("-1", "20", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--engine-nice", bad])


def test_sigterm_cancels_what_outlasts_the_shutdown_timeout():
    with server_process("--shutdown-timeout", "0.5") as (proc, url), httpx.Client(base_url=url, timeout=10) as c, \
            c.stream("POST", "/v1/chat/completions", json=chat_body("long", stream=True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        events = streamed_events(lines)
        assert events[-1] == "[DONE]" and "shutdown timeout (0.5 s)" in events[-2]["error"]["message"]
        assert time.time() - t0 < 2.0  # cancelled after 0.5 s, long before the answer's end
        assert proc.wait(timeout=15) == 0


def test_sigint_cancels_in_flight_at_once_and_exits():
    with server_process() as (proc, url), httpx.Client(base_url=url, timeout=10) as c, \
            c.stream("POST", "/v1/chat/completions", json=chat_body("long", stream=True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proc.send_signal(signal.SIGINT)
        events = streamed_events(lines)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert proc.wait(timeout=15) in (0, -signal.SIGINT)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_requests_left_before_the_engine_took_them_count_as_aborted():
    """Issue 36: streams closed by their client while the server still tokenized them were answered 499 in
    the HTTP metrics but missing from request_success_total{finished_reason="abort"}. Here the chat template
    takes 0.5 s and each client leaves after 0.1 s; then one client leaves mid-answer (counted once, by the
    engine request's own ending); the aborts must equal the 499s."""
    engine = FakeEngine(step_delay=0.05, tokens_per_step=1)
    render_chat = engine.tokenizer.render_chat

    def slow_render_chat(*args, **kwargs):
        time.sleep(0.5)
        return render_chat(*args, **kwargs)

    engine.tokenizer.render_chat = slow_render_chat
    with LiveServer(engine) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        for stream in (True, False, True):
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/chat/completions", json=chat_body("leaving", stream=stream), timeout=0.1)
        with c.stream("POST", "/v1/chat/completions", json=chat_body("leaving later", stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        wait_until(lambda: not engine.has_unfinished_requests() and
                   scrape(c).get(("specdec:request_success_total", (("finished_reason", "abort"),))) == 4)
        samples = scrape(c)
        gone = sum(v for (name, labels), v in samples.items()
                   if name == "specdec:http_requests_total" and ("status", "499") in labels)
        assert gone == 3, gone
        assert samples[("specdec:num_requests_running", ())] == 0
        assert len(engine.aborted_ids) == 1  # the one that reached the engine


IDLE_MAIN_THREAD = textwrap.dedent("""
    import signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    from test_server_unit import FakeEngine
    from specdec.server.async_engine import AsyncEngine

    engine = AsyncEngine(FakeEngine(), own_thread=False)
    signal.signal(signal.SIGTERM, lambda sig, frame: engine.drain(1.0))

    def kill_from_here():  # the OS may deliver a process's SIGTERM to any of its threads: here, this one
        time.sleep(0.5)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=kill_from_here, daemon=True).start()
    started = time.monotonic()
    engine.run()
    print(f"stopped after {{time.monotonic() - started:.2f}} s")
""")


def test_idle_engine_loop_in_the_main_thread_handles_a_signal_sent_to_another_thread():
    """`specdec serve` idles in the engine loop in the main thread; a SIGTERM that lands on another thread
    (uvicorn's, an OpenMP worker) still drains and stops it within a moment, not at the next request."""
    code = IDLE_MAIN_THREAD.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[2]) < 5.0, done.stdout
