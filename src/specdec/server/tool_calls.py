"""Tool calls in a model's answer: its text split into content and OpenAI `tool_calls`, whole or while it streams.

Two shapes are read, as the default models write them:

    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>     (Qwen2.5's template)
    ```json\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n```                  (Qwen2.5-Coder, greedy)

Tagged calls may be several and stand among text (the last may lack its closing tag when the answer ends).
The second shape is the whole answer: a ```json (or bare ```) fence, or bare JSON, holding one call object
or a list of them. A call object names a declared function and carries `arguments` (or `parameters`), a JSON
object or a string that parses as one; anything else stays content, verbatim. The content is the text outside
the calls, None when calls were found and it is only whitespace.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is JSON text, as OpenAI sends it. `id` is `call_` and 24 random hex digits."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """`{"id", "type": "function", "function": {"name", "arguments"}}`, with `index` first in a stream delta."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolCallParser:
    """Parses answers for calls to `names` (the declared functions); `parallel=False` keeps the first call only
    (as vLLM does for `parallel_tool_calls: false`). Example:

    >>> parser = ToolCallParser(("get_weather",))
    >>> content, calls = parser.parse('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    >>> content, calls[0].name, calls[0].arguments
    ('Sure. ', 'get_weather', '{"city": "Paris"}')
    """

    names: tuple[str, ...]
    parallel: bool = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer: what a stream of it would have sent, all at once."""
        stream = self.stream()
        content, calls = stream.feed(text, final=True)
        return (content or None) if calls else content, calls

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def calls_in(self, body: str) -> list[ToolCall] | None:
        """The calls of a JSON text (one call object or a list of them), or None unless all of it is valid calls."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        objects = value if isinstance(value, list) and value else [value]
        calls = [self._call(obj) for obj in objects]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    def _call(self, obj: Any) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict) or not set(obj) <= {"name", "arguments", "parameters"}:
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def whole_answer_calls(self, text: str) -> list[ToolCall] | None:
        """The calls of an answer that is one fence or bare JSON holding calls, else None."""
        stripped = text.strip()
        fence = _FENCE.fullmatch(stripped)
        return self.calls_in(fence.group(1) if fence else stripped)


class ToolCallStream:
    """Splits an answer into content and calls as its text arrives (`feed`, once per step, the last with
    `final=True`), sending text as soon as it cannot be part of a call:

    - while the answer so far may still be a whole-answer call (it starts, after whitespace, with `{`, `[`,
      or a ```json / ``` fence), everything waits for the end;
    - otherwise text streams, less a tail that may begin `<tool_call>`; a tagged call waits for its closing tag;
    - whitespace waits until content that is not whitespace follows (dropped at the end if calls were found),
      so that a stream sends exactly what `ToolCallParser.parse` returns.

    Example, the answer 'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>' fed in two steps,
    'Sure. <tool' then the rest: ('Sure. ', []), then ('', [the call of f]).
    """

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.text = ""
        self.resolved = 0  # text[:resolved] went out, as content or as calls
        self.num_calls = 0
        self._held_space = ""  # whitespace not sent yet: no content but whitespace so far
        self._sent_content = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Take the answer's next text; return the content and the calls it completes."""
        self.text += delta
        if self.resolved == 0 and _may_be_whole_answer_call(self.text):
            if not final:
                return "", []
            calls = self.parser.whole_answer_calls(self.text)
            if calls is not None:
                self.resolved = len(self.text)
                return self._finish("", self._keep(calls))
        content, calls = [], []
        while True:
            start = self.text.find(START, self.resolved)
            if start < 0:
                end = len(self.text) if final else len(self.text) - _partial_suffix(self.text, START, self.resolved)
                content.append(self._content(self.text[self.resolved:end]))
                self.resolved = end
                break
            content.append(self._content(self.text[self.resolved:start]))
            close = self.text.find(END, start)
            if close < 0 and not final:
                self.resolved = start
                break
            body_end = len(self.text) if close < 0 else close  # an unclosed call ends with the answer
            end = body_end if close < 0 else close + len(END)
            found = self.parser.calls_in(self.text[start + len(START):body_end].strip())
            if found is None:
                content.append(self._content(self.text[start:end]))
            else:
                calls += self._keep(found)
            self.resolved = end
        return self._finish("".join(content), calls) if final else ("".join(content), calls)

    def _content(self, piece: str) -> str:
        if not self._sent_content and not piece.strip():
            self._held_space += piece
            return ""
        self._sent_content = True
        piece, self._held_space = self._held_space + piece, ""
        return piece

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.parser.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return calls

    def _finish(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        """At the end, held whitespace is content unless the answer had calls."""
        if self.num_calls == 0:
            content, self._held_space = self._held_space + content, ""
        return content, calls


def _may_be_whole_answer_call(text: str) -> bool:
    """Whether `text` may begin an answer that is one call fence or bare JSON. Once False, False for any
    continuation. Examples: '  {"na' True, '``' True, '```js' True, '```python' False, 'Sure' False."""
    s = text.lstrip()
    if not s or s[0] in "{[":
        return True
    if not s.startswith("```"):
        return "```".startswith(s)
    info, newline, _ = s[3:].partition("\n")
    info = info.strip().lower()
    return info in ("", "json") if newline else "json".startswith(info)


def _partial_suffix(text: str, token: str, start: int) -> int:
    """The length of the longest end of `text[start:]` that begins `token`.
    Example: ('ab<tool', '<tool_call>', 0) -> 5."""
    for n in range(min(len(token) - 1, len(text) - start), 0, -1):
        if token.startswith(text[len(text) - n:]):
            return n
    return 0
