"""Record the default target's greedy answers to tool-calling chats: the fixtures of tests/test_tool_calls.py.

    PYTHONPATH=src python scripts/record_tool_outputs.py tests/data/qwen_tool_outputs.json

Each case is a conversation, the tools it declares and the model's raw text (`LLM.chat(..., tools=...)`, greedy,
at most 80 tokens); the file also keeps the model's chat template. The parser's tests read what the model really
writes, not what its template asks for (it asks for `<tool_call>` tags; the 1.5B Coder answers in a ```json fence).
"""

from __future__ import annotations

import json
import sys

from specdec.api import LLM
from specdec.config import SamplingParams

MODEL = "qwen2.5-coder-1.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
PARIS = [{"role": "user", "content": "What's the weather like in Paris today?"}]
CALLED = PARIS + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
CASES = {
    "weather": (PARIS, [WEATHER]),
    "calculator": ([{"role": "user", "content": "What is 1234 multiplied by 5678?"}], [MULTIPLY]),
    "two_calls": ([{"role": "user", "content": "What's the weather in Paris and in Tokyo?"}], [WEATHER]),
    "no_tool": ([{"role": "user", "content": "Write a Python function that reverses a string."}], [WEATHER, MULTIPLY]),
    "greeting": ([{"role": "user", "content": "Hello! Who are you?"}], [WEATHER]),
    "tool_result": (CALLED + [{"role": "tool", "tool_call_id": "call_1",
                               "content": '{"temperature_c": 18, "condition": "sunny"}'}], [WEATHER]),
    "tool_result_text": (CALLED + [
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees Celsius and sunny"}], [WEATHER]),
}


def main(path: str) -> None:
    llm = LLM(MODEL)
    params = SamplingParams(temperature=0, max_tokens=80)
    records = []
    for name, (messages, tools) in CASES.items():
        out = llm.chat(messages, params, tools=tools)[0]
        records.append({"case": name, "messages": messages, "tools": tools, "text": out.text,
                        "finish_reason": out.finish_reason})
        print(f"--- {name} ({out.finish_reason}, {len(out.token_ids)} tokens)\n{out.text}", flush=True)
    with open(path, "w") as f:
        json.dump({"model": MODEL, "sampling": "greedy, max_tokens=80", "chat_template": llm.tokenizer.chat_template,
                   "records": records}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
