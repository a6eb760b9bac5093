"""`/v1/responses` (OpenAI's Responses API) with the official `openai` SDK, over the fake engine of
test_tool_calls that says what a test scripts and renders prompts with the recorded Qwen2.5 template.

As for /v1/messages: the prompt a Responses request renders equals the prompt of the chat request it stands
for, the answer comes back as output items (whole, and as the events the SDK's stream helper accumulates),
`store` / `previous_response_id` continue a conversation, and bad requests are 400s naming the field.
"""

from __future__ import annotations

import time

import json

import httpx
import pytest

from specdec.server.responses import ResponseStore
from test_server_unit import MODEL, FakeEngine, LiveServer, assert_error, sse_events
from test_tool_calls import PARIS, REAL, WEATHER, QwenTemplateBytes, SayEngine

openai = pytest.importorskip("openai")

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
CALL_TEXT = REAL["weather"]["text"]
QUESTION = PARIS[0]["content"]


@pytest.fixture(scope="module")
def live():
    with LiveServer(SayEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def rendered(messages: list[dict], tools: list[dict] | None = None) -> str:
    return QwenTemplateBytes().apply_chat_template(messages, tools=tools)


def events(live, **body) -> list[dict]:
    r = httpx.post(live.url + "/v1/responses", json={"model": MODEL, "stream": True, **body}, timeout=20)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.strip("\n").split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data[len("data: "):])
        assert name == f"event: {payload['type']}"
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_text_answer_and_the_prompt_equals_the_chat_requests(client, live):
    live.engine.say = "Sunny, 18 degrees."
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=50,
                                temperature=0, store=False)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == "Sunny, 18 degrees." and [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert live.engine.prompts[-1] == rendered([{"role": "system", "content": "Be brief."}, *PARIS])
    params = live.engine.params[-1]
    assert (params.max_tokens, params.temperature) == (50, 0)
    assert r.usage.input_tokens == len(live.engine.prompts[-1].encode())
    assert r.usage.output_tokens == len(b"Sunny, 18 degrees.") + 1 and r.instructions == "Be brief."


def test_input_items_as_the_chat_conversation(client, live):
    """Messages (string or parts, developer as system), a function call and its output: the chat path's
    conversation, rendered by the template as chat's would be."""
    live.engine.say = "It is sunny."
    question, called, answer = REAL["tool_result_text"]["messages"]
    r = client.responses.create(model=MODEL, tools=[TOOL], store=False, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question["content"]}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": answer["content"]},
    ])
    assert r.output_text == "It is sunny."
    expected = [{"role": "system", "content": "Be brief."}, question, called, answer]
    assert live.engine.prompts[-1] == rendered(expected, [WEATHER])


def test_streamed_events_and_the_sdk_helper(client, live):
    live.engine.say = "Héllo 😀, it is sunny."
    with client.responses.stream(model=MODEL, input=QUESTION, store=False) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == live.engine.say == final.output_text and final.status == "completed"
    kinds = [e["type"] for e in events(live, input=QUESTION, store=False)]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


def test_function_call_whole_and_streamed(client, live):
    live.engine.say = CALL_TEXT
    r = client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL], store=False)
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert live.engine.prompts[-1] == rendered(PARIS, [WEATHER])

    live.engine.say = "Let me look. " + f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': 'Paris'}})}\n</tool_call>"
    with client.responses.stream(model=MODEL, input=QUESTION, tools=[TOOL], store=False) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me look. " and json.loads(arguments) == {"city": "Paris"}
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    kinds = [e["type"] for e in events(live, input=QUESTION, tools=[TOOL], store=False)]
    assert kinds[-6:] == ["response.output_item.done", "response.output_item.added",
                          "response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]


def test_only_function_tools_are_offered_to_the_model(client, live):
    """Codex sends a web_search tool and a namespace of sub-agent tools with every request: left out of the
    prompt (nothing here could run them), the function tools offered as chat's."""
    live.engine.say = "ok"
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                 "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}
    r = client.responses.create(model=MODEL, input=QUESTION, store=False, tools=[
        TOOL, {"type": "web_search", "external_web_access": False}, namespace,
        {"type": "custom", "name": "apply_patch", "description": "A patch."}])
    assert r.output_text == "ok" and live.engine.prompts[-1] == rendered(PARIS, [WEATHER])
    client.responses.create(model=MODEL, input=QUESTION, store=False, tools=[{"type": "web_search"}])
    assert live.engine.prompts[-1] == rendered(PARIS)


def test_max_output_tokens_makes_an_incomplete_response(client, live):
    live.engine.say = "one two three"
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output_text == "one"
    assert events(live, input=QUESTION, max_output_tokens=3, store=False)[-1]["type"] == "response.incomplete"


def test_without_max_output_tokens_the_answer_may_take_the_rest_of_the_context(client, live):
    """Codex sends no max_output_tokens and fails its turn on an `incomplete` answer: as OpenAI's and
    llama.cpp's servers do, the answer may run to the end of the context, not to chat's default of 1024
    tokens (a chat request without max_tokens keeps that default)."""
    live.engine.say = "ok"
    assert client.responses.create(model=MODEL, input=QUESTION, store=False).status == "completed"
    prompt_tokens = len(live.engine.tokenizer.encode(live.engine.prompts[-1]))
    assert live.engine.params[-1].max_tokens == live.engine.max_model_len - prompt_tokens > 1024
    httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": PARIS}, timeout=20)
    assert live.engine.params[-1].max_tokens == 1024


def test_store_and_previous_response_id(client, live):
    """A stored response continues with previous_response_id: its conversation (less its instructions) and
    answer come before the new input; GET returns it; store: false keeps nothing."""
    live.engine.say = CALL_TEXT
    first = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", tools=[TOOL])
    (call,) = first.output
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    live.engine.say = "It is sunny."
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees Celsius and sunny"}])
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    question, called, answer = REAL["tool_result_text"]["messages"]
    called = {**called, "tool_calls": [{**called["tool_calls"][0], "id": call.call_id}]}
    assert live.engine.prompts[-1] == rendered([question, called, {**answer, "tool_call_id": call.call_id}], [WEATHER])
    with client.responses.stream(model=MODEL, previous_response_id=second.id, input="Thanks!") as stream:
        third = stream.get_final_response()
    assert live.engine.prompts[-1].endswith("It is sunny.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n"
                                            "<|im_start|>assistant\n")
    assert client.responses.retrieve(third.id).output_text == "It is sunny."

    unstored = client.responses.create(model=MODEL, input="x", store=False)
    for response_id in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="x", previous_response_id=response_id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)


def test_an_empty_answer_is_continued_as_an_empty_turn(client, live):
    """A stored response whose answer is empty (EOS first) continues: its turn is an empty assistant message,
    not a missing one (nor a 400 on the rebuilt conversation)."""
    live.engine.say = ""
    first = client.responses.create(model=MODEL, input="Say nothing.")
    assert first.output == []
    live.engine.say = "Done."
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Now say done.")
    assert second.output_text == "Done."
    assert live.engine.prompts[-1].endswith("Say nothing.<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
                                            "<|im_start|>user\nNow say done.<|im_end|>\n<|im_start|>assistant\n")


def test_the_store_is_bounded():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": "x"}])
    with pytest.raises(Exception, match="not found"):
        store.get("resp_0")
    assert store.get("resp_2")[1] == [{"role": "user", "content": "x"}]
    store.put({"id": "resp_big"}, [{"role": "user", "content": "x" * 6000}])
    store.put({"id": "resp_big2"}, [{"role": "user", "content": "x" * 6000}])  # 12,000 characters: the first goes
    with pytest.raises(Exception, match="not found"):
        store.get("resp_big")
    store.get("resp_big2")
    store.put({"id": "resp_huge"}, [{"role": "user", "content": "x" * 20_000}])  # over the bound alone: not kept
    with pytest.raises(Exception, match="not found"):
        store.get("resp_huge")
    store.get("resp_big2")


def test_stored_responses_in_a_file_outlive_the_store_and_are_shared_scoped_and_bounded(tmp_path):
    """A SQLite store (`specdec serve`'s): a response kept by one store is read by another on the same file (a
    restarted server, another replica), only under the scope (`cache_salt`) it was stored with; the bounds hold
    for the file; past the retention a response is gone; the file is the server user's alone."""
    import os
    import stat

    db = tmp_path / "state" / "responses.sqlite3"
    first = ResponseStore(max_responses=3, path=db)
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    first.put({"id": "resp_a", "output": []}, talk)
    first.put({"id": "resp_salted"}, talk, scope="tenant-1")
    restarted, replica = ResponseStore(max_responses=3, path=db), ResponseStore(max_responses=3, path=db, owner="r2")
    assert restarted.get("resp_a") == ({"id": "resp_a", "output": []}, talk)
    assert replica.get("resp_salted", scope="tenant-1")[1] == talk
    for scope in (None, "tenant-2"):
        with pytest.raises(Exception, match="not found"):
            replica.get("resp_salted", scope=scope)
    for i in range(3):
        replica.put({"id": f"resp_{i}"}, talk)
    with pytest.raises(Exception, match="not found"):  # 3 kept in the file: the two oldest went
        restarted.get("resp_a")
    assert [restarted.get(f"resp_{i}")[0]["id"] for i in range(3)] == ["resp_0", "resp_1", "resp_2"]
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    short = ResponseStore(path=tmp_path / "short.sqlite3", retention_s=0.05)
    short.put({"id": "resp_old"}, talk)
    assert short.get("resp_old")[1] == talk
    time.sleep(0.1)
    with pytest.raises(Exception, match="not found"):
        short.get("resp_old")


def test_a_conversation_continues_across_a_server_restart_and_on_another_server_on_the_same_file(tmp_path):
    """Two servers one after the other (a restart), then two at once (replicas), on one responses file: a
    response stored by the first is continued by the others through `previous_response_id`, its turn in their
    prompts; a salted one only with its salt."""
    db = str(tmp_path / "responses.sqlite3")
    with LiveServer(SayEngine(), responses_db=db) as first:
        first.engine.say = "Four."
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
        stored = client.responses.create(model=MODEL, input="What is 2 + 2?", temperature=0)
        salted = client.responses.create(model=MODEL, input="Secret?", temperature=0, extra_body={"cache_salt": "t1"})
    with LiveServer(SayEngine(), responses_db=db) as restarted, LiveServer(SayEngine(), responses_db=db) as replica:
        for server in (restarted, replica):
            server.engine.say = "Eight."
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            again = client.responses.create(model=MODEL, previous_response_id=stored.id, input="And 4 + 4?",
                                            temperature=0)
            assert again.output_text == "Eight."
            assert "What is 2 + 2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n" in server.engine.prompts[-1]
            assert client.responses.retrieve(stored.id).output_text == "Four."
            with pytest.raises(openai.NotFoundError):
                client.responses.create(model=MODEL, previous_response_id=salted.id, input="more")
            client.responses.create(model=MODEL, previous_response_id=salted.id, input="more",
                                    extra_body={"cache_salt": "t1"})


def test_text_format_and_tool_choice_become_the_chat_paths(client, live, monkeypatch):
    import specdec.server.request_params as params_module

    compiled = []
    monkeypatch.setattr(params_module.Grammar, "from_response_format", lambda rf, *args: compiled.append(rf))
    live.engine.say = '{"city": "Paris"}'
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = client.responses.create(model=MODEL, input=QUESTION, store=False,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert json.loads(r.output_text) == {"city": "Paris"}
    assert live.engine.params[-1].response_format == {"type": "json_schema",
                                                      "json_schema": {"name": "place", "schema": schema}}
    client.responses.create(model=MODEL, input=QUESTION, store=False, text={"format": {"type": "json_object"}})
    assert live.engine.params[-1].response_format == {"type": "json_object"}
    live.engine.say = CALL_TEXT
    client.responses.create(model=MODEL, input=QUESTION, store=False, tools=[TOOL],
                            tool_choice={"type": "function", "name": "get_weather"})
    assert live.engine.params[-1].response_format["json_schema"]["schema"]["properties"]["name"] == \
        {"const": "get_weather"}


BAD = [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "model": "other-model"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests(live, body, param):
    r = httpx.post(live.url + "/v1/responses", json=body)
    error = assert_error(r, 404 if param == "model" else 400)
    assert error["param"] is not None and error["param"].startswith(param), error


def test_errors_through_the_sdk_and_mid_stream():
    with LiveServer(FakeEngine()) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="x", max_output_tokens=0)
        r = httpx.post(server.url + "/v1/responses", json={"input": "BOOM", "stream": True}, timeout=20)
        kinds = [json.loads(e)["type"] for e in (line.split("data: ", 1)[1] for line in r.text.strip().split("\n\n"))]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
        assert client.responses.create(model=MODEL, input="hi").status == "completed"  # and answers on


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(client, live):
    """Not streamed: OpenAI's 400 naming `input`. Streamed: response.failed with that code (as OpenAI streams
    it), the one form Codex compacts on: its SSE parser maps `response.error.code == "context_length_exceeded"`
    in a response.failed to ContextWindowExceeded, while a 400 ends its turn (`ResponseTranslator`)."""
    long = "é" * 3000  # under the bound on characters; 6000 bytes, over the context of 4096
    n = len(rendered([{"role": "user", "content": long}]).encode())
    message = (f"This model's maximum context length is 4096 tokens. However, your input resulted in {n} tokens. "
               "Please reduce the length of the input.")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=long)
    assert e.value.status_code == 400 and e.value.body == {
        "message": message, "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}

    got = events(live, input=long)
    assert [e["type"] for e in got] == ["response.created", "response.in_progress", "response.failed"]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "context_length_exceeded", "message": message}
    stream = list(client.responses.create(model=MODEL, input=long, stream=True))  # and as the SDK reads it
    assert stream[-1].type == "response.failed" and stream[-1].response.error.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):  # a failed response is not kept
        client.responses.retrieve(failed["id"])

    live.engine.say = "ok"  # and the server answers on
    assert client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5).output_text == "ok"


@pytest.mark.parametrize("lenient", [False, True])
def test_json_schemas_strict_by_default_lenient_by_server_option(monkeypatch, lenient):
    """`--lenient-json-schemas` makes a schema without a word on strictness lenient; a request's own
    `strict` wins either way (the grammar's side is in test_structured)."""
    import specdec.server.request_params as params_module

    monkeypatch.setattr(params_module.Grammar, "from_response_format", lambda rf, *args: None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with LiveServer(SayEngine(), lenient_json_schemas=lenient) as server:
        for strict in (None, True, False):
            spec = {"name": "n", "schema": schema, **({} if strict is None else {"strict": strict})}
            r = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": PARIS, "response_format": {"type": "json_schema", "json_schema": spec}})
            assert r.status_code == 200, r.text
            sent = server.engine.params[-1].response_format["json_schema"]
            expected = strict if strict is not None else (False if lenient else None)
            assert sent.get("strict") == expected and sent["schema"] == schema


def test_in_progress_heartbeats_while_the_engine_is_silent(monkeypatch):
    """Codex gives up on a stream after 5 minutes without an event: response.in_progress goes out again
    whenever `heartbeat_s` passes without a chunk, and the SDK's helper takes the stream as usual."""
    import functools

    import specdec.server.app as app_module

    monkeypatch.setattr(app_module, "ResponseTranslator",
                        functools.partial(app_module.ResponseTranslator, heartbeat_s=0.05))
    with LiveServer(FakeEngine(step_delay=0.3, tokens_per_step=20)) as server:
        r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "stream": True}, timeout=20)
        kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in r.text.strip().split("\n\n")]
        assert kinds.count("response.in_progress") >= 4 and kinds[-1] == "response.completed"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with client.responses.stream(model=MODEL, input="hi") as stream:
            assert stream.get_final_response().output_text.startswith("Héllo")
