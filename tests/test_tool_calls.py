"""Tool calls: the parser on the default target's real answers and on malformed ones, streaming against parsing
whole, request validation, and the server's answers over a fake engine that says what a test scripts.

The real answers (`data/qwen_tool_outputs.json`, with the model's chat template) were recorded by
`scripts/record_tool_outputs.py`: greedy `LLM.chat(..., tools=...)` on qwen2.5-coder-1.5b-instruct.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from specdec.models.tokenizer import Tokenizer
from specdec.server.tool_calls import ToolCallParser, _may_be_whole_answer_call
from test_server_unit import EOS, MODEL, ByteTokenizer, FakeEngine, LiveServer, assert_error, sse_events

RECORDED = json.loads((Path(__file__).parent / "data" / "qwen_tool_outputs.json").read_text())
REAL = {r["case"]: r for r in RECORDED["records"]}
WEATHER, MULTIPLY = REAL["weather"]["tools"][0], REAL["calculator"]["tools"][0]
PARIS = REAL["weather"]["messages"]


def tagged(name: str, arguments: dict) -> str:
    """A call as Qwen2.5's template asks for it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---- the parser ---------------------------------------------------------------------------------------------


def test_real_answers():
    """The 1.5B Coder answers in a ```json fence, never in the template's <tool_call> tags; it calls only the
    first of two cities, calls a tool for a greeting, and answers a tool result with the call again."""
    expected = {
        "weather": [("get_weather", {"city": "Paris"})],
        "calculator": [("multiply", {"a": 1234, "b": 5678})],
        "two_calls": [("get_weather", {"city": "Paris"})],
        "greeting": [("get_weather", {"city": "New York"})],
        "tool_result_text": [("get_weather", {"city": "Paris"})],
        "no_tool": [],  # a ```python fence
        "tool_result": [],  # a ```json fence of a call object with a "response" key: not a call
    }
    assert set(expected) == set(REAL)
    for case, record in REAL.items():
        assert record["text"].startswith("```"), case  # what the model really writes
        parser = ToolCallParser(tuple(t["function"]["name"] for t in record["tools"]))
        content, calls = parser.parse(record["text"])
        assert calls_of(calls) == expected[case], case
        assert content == (None if calls else record["text"]), case
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)


PARSER = ToolCallParser(("get_weather", "multiply"))
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOKYO = {"name": "get_weather", "arguments": {"city": "Tokyo"}}

PARSES = [
    # (text, content, calls)
    (tagged("get_weather", {"city": "Paris"}), None, [CALL]),
    ("Let me check.\n" + tagged("get_weather", {"city": "Paris"}) + "\nOne moment.", "Let me check.\n\nOne moment.",
     [CALL]),
    (tagged("get_weather", {"city": "Paris"}) + "\n" + tagged("get_weather", {"city": "Tokyo"}) + "\n", None,
     [CALL, TOKYO]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [CALL]),  # unclosed at the end
    (json.dumps(CALL), None, [CALL]),  # bare JSON
    ("\n " + json.dumps([CALL, TOKYO]), None, [CALL, TOKYO]),  # a list
    ("```json\n" + json.dumps([CALL, TOKYO], indent=2) + "\n```", None, [CALL, TOKYO]),
    ("```\n" + json.dumps(CALL) + "\n```", None, [CALL]),  # a fence without a language
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [CALL]),  # arguments as JSON text
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [CALL]),
    ('{"name": "multiply", "arguments": {"a": 2, "b": 3.5}}', None,
     [{"name": "multiply", "arguments": {"a": 2, "b": 3.5}}]),
]

STAYS_CONTENT = [
    tagged("get_time", {}),  # an undeclared function
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # bad JSON
    '{"name": "get_weather", "arguments": ["Paris"]}',  # arguments not an object
    '{"name": "get_weather", "arguments": "Paris"}',  # arguments text that is not a JSON object
    '{"name": "get_weather"}',  # no arguments
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "response": {"temperature_c": 18}}',  # another key
    json.dumps([CALL, {"name": "get_time", "arguments": {}}]),  # a list with one bad call: all content
    "[]",
    '{"city": "Paris"}',
    "```json\n" + json.dumps(CALL) + "\n```\nThis asks for the weather.",  # a fence is a call only as the whole answer
    json.dumps(CALL) + " and more",
    "```python\nprint('hi')\n```",
    "The weather in Paris is sunny.",
    "",
    "  \n",
]


@pytest.mark.parametrize("text,content,calls", PARSES)
def test_parse(text, content, calls):
    got_content, got_calls = PARSER.parse(text)
    assert got_content == content and calls_of(got_calls) == [(c["name"], c["arguments"]) for c in calls]
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text", STAYS_CONTENT)
def test_malformed_calls_stay_content(text):
    assert PARSER.parse(text) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = tagged("get_weather", {"city": "Paris"}) + tagged("get_weather", {"city": "Tokyo"})
    content, calls = ToolCallParser(("get_weather",), parallel=False).parse(text)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = ToolCallParser(("get_weather",), parallel=False).parse(json.dumps([CALL, TOKYO]))
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


STREAMED = [r["text"] for r in REAL.values()] + [t for t, _, _ in PARSES] + STAYS_CONTENT + [
    "Sure <tool_ca", "a <tool_call> b", "x </tool_call> y " + tagged("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("text", STREAMED)
def test_streaming_sends_what_parsing_whole_returns(text, size):
    stream = PARSER.stream()
    steps = pieces(text, size)
    sent = [stream.feed(p, final=i == len(steps) - 1) for i, p in enumerate(steps)]
    content, calls = PARSER.parse(text)
    assert "".join(c for c, _ in sent) == (content or "")
    assert calls_of([c for _, cs in sent for c in cs]) == calls_of(calls)


def test_streaming_holds_back_only_what_may_be_a_call():
    stream = PARSER.stream()
    assert stream.feed("The weather") == ("The weather", [])  # plain text goes at once
    assert stream.feed(" is <tool") == (" is ", [])  # '<tool' may begin <tool_call>
    assert stream.feed("_call>\n" + json.dumps(CALL)) == ("", [])  # a call waits for its closing tag
    content, calls = stream.feed("\n</tool_call>")
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert stream.feed(" <b>", final=True) == (" <b>", [])
    stream = PARSER.stream()
    assert stream.feed("\n```") == ("", []) and stream.feed("json\n{") == ("", [])  # may be a fenced call
    stream = PARSER.stream()
    assert stream.feed("```") == ("", []) and stream.feed("python\ndef f") == ("```python\ndef f", [])


@pytest.mark.parametrize("text,may", [
    ("", True), ("  ", True), ("  {", True), ("[", True), ("`", True), ("``", True), ("```", True), ("```js", True),
    ("```JSON\n", True), ("```\n", True), ("`a", False), ("```python", False), ("```json x\n", False), ("Sure", False),
    ("\n```jsonx", False),
])
def test_may_be_whole_answer_call(text, may):
    assert _may_be_whole_answer_call(text) is may


# ---- the server, over a fake engine that says what a test scripts ------------------------------------------


class QwenTemplateBytes(ByteTokenizer):
    """Byte tokens, prompts rendered by the recorded Qwen2.5 template (tools, tool calls, tool messages)."""

    template = Tokenizer(None, special_tokens={}, eos_token_ids=(EOS,), chat_template=RECORDED["chat_template"])

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None) -> str:
        return self.template.apply_chat_template(messages, add_generation_prompt, tools)


class SayEngine(FakeEngine):
    """Answers `say`; `prompts` keeps each request's prompt text."""

    def __init__(self):
        super().__init__(max_model_len=4096, tokens_per_step=4)
        self.tokenizer = QwenTemplateBytes()
        self.say, self.prompts, self.params = "", [], []

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None) -> None:
        super().add_request(request_id, prompt_token_ids, params, cache_salt)
        self.waiting[-1]["answer"] = list(self.say.encode()) + [EOS]
        self.prompts.append(self.tokenizer.decode(prompt_token_ids))
        self.params.append(params)


@pytest.fixture(scope="module")
def live():
    with LiveServer(SayEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, timeout=20) as c:
        yield c


def chat(client, live, say: str, stream: bool = False, **body) -> dict | list[dict]:
    """The answer to PARIS when the model says `say`: the body, or the stream's chunks."""
    live.engine.say = say
    body = {"model": MODEL, "messages": PARIS, "stream": stream, **body}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        r.read()
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_tool_call_answer(client, live):
    body = chat(client, live, REAL["weather"]["text"], tools=[WEATHER])
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert set(call) == {"id", "type", "function"} and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert live.engine.prompts[-1] == QwenTemplateBytes().apply_chat_template(PARIS, tools=[WEATHER])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in live.engine.prompts[-1]


def test_tool_call_streamed():
    """The whole fenced call is held back, then sent as one tool-call delta with the finish reason."""
    with LiveServer(SayEngine()) as live, httpx.Client(base_url=live.url, timeout=20) as client:
        chunks = chat(client, live, REAL["weather"]["text"], stream=True, tools=[WEATHER])
    first, *rest = [c["choices"][0] for c in chunks]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert [c["delta"] for c in rest if "content" in c["delta"]] == []
    (last,) = rest  # nothing is sent until the call is known
    (delta,) = last["delta"]["tool_calls"]
    assert delta["index"] == 0 and delta["id"].startswith("call_") and delta["type"] == "function"
    assert delta["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert last["finish_reason"] == "tool_calls"


def test_text_streams_at_once_and_tagged_calls_follow(client, live):
    say = "Let me look that up for you.\n" + tagged("get_weather", {"city": "Paris"}) + tagged("get_weather",
                                                                                               {"city": "Lyon"})
    chunks = chat(client, live, say, stream=True, tools=[WEATHER])
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    text = [d["content"] for d in deltas if d.get("content")]
    assert "".join(text) == "Let me look that up for you.\n" and len(text) > 3  # in pieces, not at the end
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["index"], json.loads(t["function"]["arguments"])) for t in calls] == [(0, {"city": "Paris"}),
                                                                                     (1, {"city": "Lyon"})]
    assert len({t["id"] for t in calls}) == 2 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = chat(client, live, say, tools=[WEATHER])["choices"][0]
    assert whole["message"]["content"] == "Let me look that up for you.\n" and len(whole["message"]["tool_calls"]) == 2
    one = chat(client, live, say, tools=[WEATHER], parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]
    assert [json.loads(t["function"]["arguments"]) for t in one] == [{"city": "Paris"}]


def test_no_call_is_plain_content(client, live):
    for stream in (False, True):
        answer = chat(client, live, REAL["no_tool"]["text"], stream=stream, tools=[WEATHER, MULTIPLY])
        if stream:
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in answer)
            choice = answer[-1]["choices"][0]
        else:
            (choice,) = answer["choices"]
            content = choice["message"]["content"]
            assert "tool_calls" not in choice["message"]
        assert content == REAL["no_tool"]["text"] and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", ["none", "auto", "required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice(client, live, tool_choice, monkeypatch):
    """"none": the tools are in the prompt (as vLLM does) and nothing is parsed; "auto": parsed; "required" and
    a named function: parsed, and the engine gets a response format that makes the answer a call (the fake
    engine ignores it: the real model's enforcement is in test_server_real)."""
    import specdec.server.request_params as params_module

    compiled = []
    monkeypatch.setattr(params_module.Grammar, "from_response_format", lambda rf, *args: compiled.append(rf))
    body = chat(client, live, REAL["weather"]["text"], tools=[WEATHER, MULTIPLY], tool_choice=tool_choice)
    assert "get_weather" in live.engine.prompts[-1]
    (choice,) = body["choices"]
    if tool_choice == "none":
        assert choice["message"] == {"role": "assistant", "content": REAL["weather"]["text"]}
        assert choice["finish_reason"] == "stop"
    else:
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    rf = live.engine.params[-1].response_format
    if tool_choice in ("none", "auto"):
        assert rf is None and not compiled
        return
    assert compiled == [rf]
    schema = rf["json_schema"]["schema"]
    if tool_choice == "required":  # a list of one or more calls of any declared function
        assert schema["type"] == "array" and schema["minItems"] == 1
        names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
        assert names == ["get_weather", "multiply"]
        assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    else:  # one call of the named function
        assert schema["properties"]["name"] == {"const": "get_weather"} and schema["required"] == ["name", "arguments"]


def test_a_required_call_with_a_response_format_is_refused(client, live):
    r = client.post("/v1/chat/completions", json={"messages": PARIS, "tools": [WEATHER], "tool_choice": "required",
                                                  "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_round_trip_with_the_openai_client(live):
    """The assistant message as the client got it (arguments as JSON text) goes back with the tool's result;
    the template gets the arguments as a dict, as `LLM.chat` gives them."""
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=live.url + "/v1", api_key="unused")
    live.engine.say = REAL["weather"]["text"]
    r = oa.chat.completions.create(model=MODEL, messages=PARIS, tools=[WEATHER])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    live.engine.say = "It is sunny and 18 degrees in Paris."
    tool = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "condition": "sunny"}'}
    r = oa.chat.completions.create(model=MODEL, messages=[*PARIS, message, tool], tools=[WEATHER])
    assert r.choices[0].message.content == live.engine.say and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    question, called, result = REAL["tool_result"]["messages"]  # the same conversation, as LLM.chat got it
    called = {**called, "tool_calls": [{**called["tool_calls"][0], "id": call.id}]}
    expected = [question, called, {**result, "tool_call_id": call.id}]
    assert live.engine.prompts[-1] == QwenTemplateBytes().apply_chat_template(expected, tools=[WEATHER])
    assert '"arguments": {"city": "Paris"}}\n</tool_call>' in live.engine.prompts[-1]

    stream = oa.chat.completions.create(model=MODEL, messages=[*PARIS, message, tool], tools=[WEATHER], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == live.engine.say


TOOL_MESSAGE = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
BAD = [
    # (body fields, param)
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (dict(tools=[{"type": "function"}]), "tools[0].function"),
    (dict(tools=[{"type": "function", "function": {"name": "get weather!"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "returns": "x"}}]), "tools[0].function"),
    (dict(tools={"type": "function"}), "tools"),
    (dict(tool_choice="auto"), "tool_choice"),
    (dict(tool_choice="required", tools=[]), "tool_choice"),
    (dict(tool_choice="sometimes", tools=[WEATHER]), "tool_choice"),
    (dict(tool_choice={"type": "function", "function": {"name": "get_time"}}, tools=[WEATHER]), "tool_choice"),
    (dict(tool_choice={"type": "function"}, tools=[WEATHER]), "tool_choice"),
    (dict(parallel_tool_calls="yes", tools=[WEATHER]), "parallel_tool_calls"),
    (dict(functions=[WEATHER["function"]]), "functions"),  # the legacy form: refused
    (dict(function_call="auto"), "function_call"),
    (dict(messages=[*PARIS, {"role": "tool", "content": "sunny"}]), "messages[1]"),
    (dict(messages=[*PARIS, {"role": "user", "content": "x", "tool_call_id": "call_1"}]), "messages[1]"),
    (dict(messages=[{"role": "user", "content": None}]), "messages[0]"),
    (dict(messages=[*PARIS, {"role": "assistant", "content": None}]), "messages[1]"),
    (dict(messages=[{**PARIS[0], "tool_calls": CALLED["tool_calls"]}]), "messages[0]"),
    (dict(messages=[*PARIS, {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "type": "retrieval"}]}]),
     "messages[1].tool_calls[0].type"),
    (dict(messages=[*PARIS, {**CALLED, "tool_calls": [{"id": "c", "type": "function",
                                                     "function": {"name": "f", "arguments": "{city"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (dict(messages=[*PARIS, {**CALLED, "tool_calls": [{"id": "c", "type": "function",
                                                     "function": {"name": "f", "arguments": {"city": "Paris"}}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("fields,param", BAD)
def test_bad_tool_requests(client, live, fields, param):
    error = assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": PARIS, **fields}),
                         400, param)
    assert "Value error" not in error["message"]


def test_a_conversation_with_calls_and_results_is_accepted(client, live):
    body = chat(client, live, "Sunny.", messages=[*PARIS, CALLED, TOOL_MESSAGE, TOOL_MESSAGE], tools=[WEATHER])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    assert live.engine.prompts[-1].count("<tool_response>\nsunny\n</tool_response>") == 2
