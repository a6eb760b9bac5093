"""`/v1/messages` (Anthropic's Messages API) with the official `anthropic` SDK, over the fake engine of
test_tool_calls that says what a test scripts and renders prompts with the recorded Qwen2.5 template.

The translation is checked where it matters: the prompt a Messages request renders equals the prompt of the
chat request it stands for (so the model's answer is the same), the answer comes back in Anthropic's shape
(whole, and as the event sequence the SDK's stream helper accumulates), and errors are Anthropic's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_unit import MODEL, FakeEngine, LiveServer, chat_prompt_text, reply_for
from test_tool_calls import PARIS, REAL, WEATHER, QwenTemplateBytes, SayEngine

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
CALL_TEXT = REAL["weather"]["text"]  # what the 1.5B Coder really answers: a ```json fence of a call


@pytest.fixture(scope="module")
def live():
    with LiveServer(SayEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)


def rendered(messages: list[dict], tools: list[dict] | None = None) -> str:
    return QwenTemplateBytes().apply_chat_template(messages, tools=tools)


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event, data) of an Anthropic SSE body: each event an `event:` line and a `data:` line."""
    events = []
    for block in response.text.strip("\n").split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


# ---- text -----------------------------------------------------------------------------------------------------


def test_text_answer_and_the_prompt_equals_the_chat_requests(client, live):
    live.engine.say = "Sunny, 18 degrees."
    m = client.messages.create(model="claude-sonnet-4-5", max_tokens=100, system="Be brief.",
                               messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
                               metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [(b.type, b.text) for b in m.content] == [("text", "Sunny, 18 degrees.")]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    chat = [{"role": "system", "content": "Be brief."}, *PARIS]
    assert live.engine.prompts[-1] == rendered(chat)
    assert m.usage.input_tokens == len(rendered(chat).encode()) and m.usage.output_tokens == len(b"Sunny, 18 degrees.") + 1
    assert m.usage.cache_read_input_tokens == 0


def test_system_blocks_and_text_blocks_join_as_the_chat_path_joins_text_parts(client, live):
    live.engine.say = "ok"
    client.messages.create(model="m", max_tokens=10, system=[{"type": "text", "text": "A."},
                                                             {"type": "text", "text": "B.", "cache_control": {"type": "ephemeral"}}],
                           messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                  {"type": "text", "text": "y"}]}])
    assert live.engine.prompts[-1] == rendered([{"role": "system", "content": "A.\nB."}, {"role": "user", "content": "x\ny"}])


@pytest.mark.parametrize("system", [
    [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli;"},
     {"type": "text", "text": "You are Claude Code."}],
    "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=cli; cch=36ee5;\nYou are Claude Code.",
], ids=["block", "first line"])
def test_claude_codes_billing_line_never_reaches_the_prompt(client, live, system):
    """It changes with the session's first prompt and comes first: left in, no two sessions share a cached token."""
    live.engine.say = "ok"
    client.messages.create(model="m", max_tokens=10, system=system, messages=PARIS)
    assert live.engine.prompts[-1] == rendered([{"role": "system", "content": "You are Claude Code."}, *PARIS])
    client.messages.create(model="m", max_tokens=10, messages=PARIS,
                           system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"}])
    assert live.engine.prompts[-1] == rendered(PARIS)  # nothing else: no empty system turn


def test_sampling_fields_reach_the_engine(client, live):
    live.engine.say = "ok"
    # sent as the API's fields (this SDK's create() no longer takes them as arguments)
    client.messages.create(model="m", max_tokens=7, messages=PARIS,
                           extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    params = live.engine.params[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 20)


def test_max_tokens_is_a_ceiling_cut_to_the_context(client, live):
    """Claude Code asks for 32000 tokens whatever the context: the answer may stop at the context's end."""
    live.engine.say = "ok"
    m = client.messages.create(model="m", max_tokens=1_000_000, messages=PARIS, timeout=20)  # a timeout: no SDK refusal
    assert m.content[0].text == "ok"
    assert live.engine.params[-1].max_tokens == live.engine.max_model_len - len(live.engine.prompts[-1].encode())


def test_an_answer_cut_by_the_context_stops_with_model_context_window_exceeded(client, live):
    """Anthropic's stop reason for an answer that ran into the end of the context (`MessageTranslator`);
    `max_tokens` itself reached is still `max_tokens`."""
    live.engine.say = "0123456789" * 3
    overhead = len(rendered([{"role": "user", "content": ""}]).encode())
    messages = [{"role": "user", "content": "y" * (live.engine.max_model_len - overhead - 6)}]  # room for 6 tokens
    m = client.messages.create(model="m", max_tokens=32000, messages=messages, timeout=20)  # (no SDK refusal)
    assert (m.content[0].text, m.stop_reason, m.usage.output_tokens) == ("012345", "model_context_window_exceeded", 6)
    with client.messages.stream(model="m", max_tokens=32000, messages=messages) as s:
        assert s.get_final_message().stop_reason == "model_context_window_exceeded"
    assert client.messages.create(model="m", max_tokens=6, messages=messages).stop_reason == "max_tokens"


def test_a_prompt_longer_than_the_context_is_anthropics_prompt_too_long(client, live):
    """Claude Code compacts on a 400 whose message says "prompt is too long", sized by the two numbers after
    it (2.1.197's cli.js reads them with the regex below): streamed or not, refused before any event."""
    import re

    long = [{"role": "user", "content": "é" * 3000}]  # under the bound on characters; 6000 bytes
    n = len(rendered(long).encode())
    expected = {"type": "error", "error": {"type": "invalid_request_error",
                                           "message": f"prompt is too long: {n} tokens > 4096 maximum"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=100, messages=long)
    assert e.value.status_code == 400 and e.value.body == expected
    with pytest.raises(anthropic.BadRequestError) as e:
        with client.messages.stream(model="m", max_tokens=100, messages=long) as s:
            s.get_final_message()
    assert e.value.body == expected
    r = httpx.post(live.url + "/v1/messages", json={"model": "m", "max_tokens": 100, "messages": long, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json" and r.json() == expected
    # certainly too long: refused before tokenizing, at least as many tokens as characters
    r = httpx.post(live.url + "/v1/messages", json={"model": "m", "max_tokens": 100,
                                                   "messages": [{"role": "user", "content": "x" * 5000}]})
    numbers = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", r.json()["error"]["message"], re.I)
    assert r.status_code == 400 and int(numbers[1]) > 5000 and numbers[2] == "4096"
    live.engine.say = "ok"  # and the server answers on
    assert client.messages.create(model="m", max_tokens=5, messages=PARIS).content[0].text == "ok"


def test_context_errors_in_anthropics_words():
    from specdec.server.anthropic import error_body
    from specdec.server.protocol import ContextLengthError

    def message(*args, **kw) -> str:
        return error_body(ContextLengthError(*args, **kw))["error"]["message"]

    assert message(4096, 5000, "messages") == "prompt is too long: 5000 tokens > 4096 maximum"
    assert message(4096, 4096, "messages") == "prompt is too long: 4096 tokens > 4095 maximum"  # no room to answer
    assert message(4096, 96, "messages", completion_tokens=4001) == (
        "input length and `max_tokens` exceed context limit: 96 + 4001 > 4096, decrease input length or `max_tokens` "
        "and try again")


def test_stop_sequences_and_max_tokens(client, live):
    live.engine.say = "one two three"
    m = client.messages.create(model="m", max_tokens=50, stop_sequences=["three", "never"], messages=PARIS)
    assert m.content[0].text == "one two " and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "three")
    m = client.messages.create(model="m", max_tokens=3, messages=PARIS)
    assert m.content[0].text == "one" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_streamed_events_in_anthropics_order_and_the_sdk_helper_accumulates_them(client, live):
    live.engine.say = "Héllo 😀, it is sunny."
    with client.messages.stream(model="m", max_tokens=100, messages=PARIS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == live.engine.say
    assert [(b.type, b.text) for b in final.content] == [("text", live.engine.say)]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(live.engine.say.encode()) + 1
    assert final.usage.input_tokens == len(live.engine.prompts[-1].encode())

    r = httpx.post(live.url + "/v1/messages", json={"model": "m", "max_tokens": 100, "messages": PARIS, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    kinds = [kind for kind, _ in sse(r)]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    events = dict(sse(r))
    assert events["message_delta"]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_a_stop_sequence_streamed(client, live):
    live.engine.say = "one two three"
    with client.messages.stream(model="m", max_tokens=50, stop_sequences=["three"], messages=PARIS) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "one two " and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "three")


def test_count_tokens(client, live):
    count = client.messages.count_tokens(model="m", system="Be brief.", messages=PARIS, tools=[TOOL])
    assert count.input_tokens == len(rendered([{"role": "system", "content": "Be brief."}, *PARIS], [WEATHER]).encode())


def test_beta_query_and_unknown_fields_are_ignored(client, live):
    live.engine.say = "ok"
    m = client.beta.messages.create(model="m", max_tokens=10, messages=PARIS, betas=["some-beta-2099-01-01"],
                                    extra_body={"context_management": {"edits": []}, "service_tier": "auto"})
    assert m.content[0].text == "ok" and live.engine.prompts[-1] == rendered(PARIS)
    r = httpx.post(live.url + "/v1/messages?beta=true", json={"model": "m", "max_tokens": 5, "messages": PARIS,
                                                              "brand_new_field": {"x": 1}})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "ok"


def test_what_claude_code_sends(client, live, monkeypatch):
    """Claude Code 2.1's requests: a system message among the turns, thinking "adaptive" (answered without
    thinking: the model decides, and this one never thinks in blocks), `output_config` with a JSON schema (its
    title request: the chat path's response_format), `context_management`, `max_tokens` 64000."""
    import specdec.server.request_params as params_module

    monkeypatch.setattr(params_module.Grammar, "from_response_format", lambda rf, *args: None)
    live.engine.say = '{"title": "Greeting"}'
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
              "additionalProperties": False}
    body = {"model": "claude-opus-4-8", "max_tokens": 64000, "stream": True, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Reminder."}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    r = httpx.post(live.url + "/v1/messages?beta=true", json=body, timeout=20)
    assert r.status_code == 200, r.text
    text = "".join(e["delta"]["text"] for kind, e in sse(r) if kind == "content_block_delta")
    assert text == live.engine.say
    assert live.engine.prompts[-1] == rendered([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                                {"role": "system", "content": "Reminder."}])
    assert live.engine.params[-1].response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


# ---- tools ----------------------------------------------------------------------------------------------------


def test_tool_use_round_trip(client, live):
    """The model's call comes back as a tool_use block with its input; the client's tool_result goes back to
    the template as the chat path's tool message, the call as the assistant's tool_calls."""
    live.engine.say = CALL_TEXT
    m = client.messages.create(model="m", max_tokens=100, messages=PARIS, tools=[TOOL])
    assert live.engine.prompts[-1] == rendered(PARIS, [WEATHER])
    (use,) = m.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert use.id.startswith("toolu_") and m.stop_reason == "tool_use"

    live.engine.say = "It is sunny."
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 degrees Celsius and sunny"}]}
    m = client.messages.create(model="m", max_tokens=100, tools=[TOOL], messages=[
        *PARIS, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [result]}])
    assert m.content[0].text == "It is sunny." and m.stop_reason == "end_turn"
    question, called, answer = REAL["tool_result_text"]["messages"]  # the conversation as LLM.chat got it
    expected = [question, {**called, "tool_calls": [{**called["tool_calls"][0], "id": use.id}]},
                {**answer, "tool_call_id": use.id}]
    assert live.engine.prompts[-1] == rendered(expected, [WEATHER])


def test_tool_use_streamed_as_input_json_delta(client, live):
    live.engine.say = "Let me look. " + f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': 'Paris'}})}\n</tool_call>"
    with client.messages.stream(model="m", max_tokens=200, messages=PARIS, tools=[TOOL]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me look. " and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    r = httpx.post(live.url + "/v1/messages", json={"model": "m", "max_tokens": 200, "messages": PARIS,
                                                    "tools": [TOOL], "stream": True})
    blocks = [(kind, e.get("index"), e.get("content_block", e.get("delta", {})).get("type")) for kind, e in sse(r)
              if kind.startswith("content_block")]
    assert blocks[0] == ("content_block_start", 0, "text") and blocks[-3:] == [
        ("content_block_start", 1, "tool_use"), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_stop", 1, None)]


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, None), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"}, "get_weather"),
    ({"type": "any", "disable_parallel_tool_use": True}, "one"),
])
def test_tool_choice(client, live, monkeypatch, choice, expected):
    """any / tool become the chat path's required / named choice (a grammar the fake engine does not run; the
    real model's enforcement is in test_server_real); none keeps the tools in the prompt and parses nothing."""
    import specdec.server.request_params as params_module

    monkeypatch.setattr(params_module.Grammar, "from_response_format", lambda rf, *args: None)
    live.engine.say = CALL_TEXT
    m = client.messages.create(model="m", max_tokens=100, messages=PARIS, tools=[TOOL], tool_choice=choice)
    assert "get_weather" in live.engine.prompts[-1]
    rf = live.engine.params[-1].response_format
    if expected in (None, "none"):
        assert rf is None
        assert [b.type for b in m.content] == (["text"] if expected == "none" else ["tool_use"])
        return
    schema = rf["json_schema"]["schema"]
    if expected == "required":
        assert schema["type"] == "array" and schema["items"]["properties"]["name"] == {"const": "get_weather"}
    else:  # one call object: a named tool, or any tool with parallel use off
        assert schema["properties"]["name"] == {"const": "get_weather"}
    assert m.content[0].type == "tool_use"


# ---- errors ---------------------------------------------------------------------------------------------------

BAD = [
    ({"max_tokens": 5}, "messages"),
    ({"messages": PARIS}, "max_tokens"),
    ({"messages": PARIS, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, "messages[0].role"),
    ({"messages": PARIS, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 5}, "messages[0].content[0]"),
    ({"messages": PARIS, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"messages": PARIS, "max_tokens": 5, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"messages": PARIS, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_get_anthropics_error_shape(live, body, param):
    r = httpx.post(live.url + "/v1/messages", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert r.json()["error"]["type"] == "invalid_request_error" and param in r.json()["error"]["message"]


def test_errors_through_the_sdk(client, live):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=5, messages=PARIS, thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "thinking" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.post("/v1/messages/nowhere", cast_to=object, body={})
    live.engine.say = "ok"  # and the server answers on
    assert client.messages.create(model="m", max_tokens=5, messages=PARIS).content[0].text == "ok"


def test_engine_failure_mid_stream_is_an_error_event():
    with LiveServer(FakeEngine()) as server:
        body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "BOOM"}], "stream": True}
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=20)
        events = sse(r)
        assert [kind for kind, _ in events][:2] == ["message_start", "ping"] and events[-1][0] == "error"
        assert events[-1][1]["error"]["type"] == "api_error"
        with pytest.raises(anthropic.APIStatusError):
            body.pop("stream")
            with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.stream(**body) as s:
                s.get_final_message()
        body["messages"] = [{"role": "user", "content": "hi"}]  # the server answers on
        m = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(**body)
        assert m.content[0].text == reply_for(chat_prompt_text("hi"))


def test_api_key_as_x_api_key_or_bearer_and_errors_in_anthropics_shape():
    with LiveServer(FakeEngine(), api_key="sekret") as server:
        body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**body)
        assert e.value.body["error"]["type"] == "authentication_error"
        for kw in ({"api_key": "sekret"}, {"auth_token": "sekret", "api_key": None}):
            m = anthropic.Anthropic(base_url=server.url, max_retries=0, **kw).messages.create(**body)
            assert m.content[0].text == reply_for(chat_prompt_text("hi"))
        r = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": "sekret"},
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200  # one key, either header, on every route
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape


def test_pings_while_the_engine_is_silent(monkeypatch):
    """A long prefill streams nothing for minutes; Claude Code retries a stream after 5 minutes without an
    event. A ping goes out whenever `heartbeat_s` passes without a chunk (here 0.05 s, steps taking 0.3 s),
    and the SDK's helper takes the stream as usual."""
    import functools

    import specdec.server.app as app_module

    monkeypatch.setattr(app_module.anthropic, "MessageTranslator",
                        functools.partial(app_module.anthropic.MessageTranslator, heartbeat_s=0.05))
    with LiveServer(FakeEngine(step_delay=0.3, tokens_per_step=20)) as server:
        body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(server.url + "/v1/messages", json={**body, "stream": True}, timeout=20)
        kinds = [kind for kind, _ in sse(r)]
        assert kinds.count("ping") >= 3 and kinds[-1] == "message_stop"
        with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.stream(**body) as s:
            assert s.get_final_message().content[0].text == reply_for(chat_prompt_text("hi"))


def test_heartbeats_keep_order_errors_and_close():
    import asyncio

    from specdec.server.keepalive import with_heartbeats

    async def items(fail: bool):
        yield 1
        await asyncio.sleep(0.12)
        yield 2
        if fail:
            raise RuntimeError("engine")

    async def collect(fail: bool) -> list:
        return [x async for x in with_heartbeats(items(fail), 0.05)]

    got = asyncio.run(collect(False))
    assert got[0] == 1 and got[-1] == 2 and set(got[1:-1]) == {None} and len(got) >= 3
    with pytest.raises(RuntimeError, match="engine"):
        asyncio.run(collect(True))
