"""`specdec bench agent`: a coding agent's edit session replayed against OpenAI-compatible servers, side by
side, with each edit checked.

Each turn sends what an agent in whole-file edit mode sends (the mode of aider's "whole" format; the words are
ours): a system prompt with the rules, the file, the conversation so far and the instruction; the answer is the
whole updated file in one fenced block. The session edits two files of this interpreter's standard library
(code nobody here wrote): `colorsys.py` (~1.1k tokens) twice in one conversation, then `fnmatch.py` in a new
one. An answer counts as correct when its block parses as Python and holds the edit (the new names there, the
old ones gone). Requests are greedy and streamed; the servers take turns, turn by turn, so that a slow spell of
the machine falls on all of them.

    specdec bench agent --url http://127.0.0.1:8000 --url http://127.0.0.1:8080 --name specdec --name llama.cpp

`benchmarks/bench_agent.py` starts the servers itself (specdec with its defaults, plain, the seed's command,
and llama.cpp's server on the same GGUF).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import time
from dataclasses import dataclass
from typing import Callable

SYSTEM = (
    "Act as an expert software developer. You edit the files the user shows you, as they ask.\n"
    "Always answer with the COMPLETE updated file: its name on a line of its own, then the whole file in a "
    "```python fenced block. Never elide or abbreviate any part of the file, even the parts you do not change; "
    "do not add comments about what you changed. After the block, nothing else."
)


def _renamed(old: str, new: str) -> Callable[[str], bool]:
    return lambda code: re.search(rf"\b{re.escape(new)}\b", code) is not None and \
        re.search(rf"\b{re.escape(old)}\b", code) is None


def _typed(*functions: str) -> Callable[[str], bool]:
    def check(code: str) -> bool:
        defs = {n.name: n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}
        return all(f in defs and defs[f].returns is not None and all(a.annotation is not None for a in defs[f].args.args)
                   for f in functions)
    return check


@dataclass(frozen=True)
class Turn:
    module: str  # the file: this standard-library module's source
    instruction: str
    check: Callable[[str], bool]
    new_conversation: bool  # a fresh conversation (else: the previous turn's, its answer in the history)


SESSION = (
    Turn("colorsys", "Rename the helper function `_v` to `_hue_to_value` everywhere in colorsys.py.",
         _renamed("_v", "_hue_to_value"), True),
    Turn("colorsys", "Now add type hints to `rgb_to_hsv` and `hsv_to_rgb`: float parameters, a tuple of three "
                     "floats returned.", _typed("rgb_to_hsv", "hsv_to_rgb"), False),
    Turn("fnmatch", "Rename the parameter `pat` to `pattern` in every function of fnmatch.py.",
         _renamed("pat", "pattern"), True),
)


def module_source(name: str) -> str:
    return inspect.getsource(importlib.import_module(name))


def answer_code(text: str) -> str | None:
    """The answer's fenced block (the longest, if several), or None."""
    blocks = re.findall(r"```[a-zA-Z]*\n(.*?)```", text, flags=re.S)
    return max(blocks, key=len) if blocks else None


def correct(text: str, check: Callable[[str], bool]) -> bool:
    code = answer_code(text)
    if code is None:
        return False
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return bool(check(code))


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int, api_key: str | None = None) -> dict:
    """One streamed greedy chat request: its text, time to first token, total time and usage (llama.cpp's
    server also reports `timings.cache_n`, its cached prompt tokens)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    first, text, usage, timings = None, "", {}, {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"])
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if content:
                first = first or time.perf_counter()
                text += content
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {"text": text, "ttft": (first or end) - start, "seconds": end - start,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens", timings.get("cache_n"))}


def run_session(servers: dict[str, str], model: str, turns: tuple[Turn, ...] = SESSION, api_key: str | None = None,
                progress: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """The session on every server ({name: base URL}), the servers taking turns turn by turn; each keeps its own
    history (its own answers). Returns {name: [per-turn result: seconds, tokens, correct, ...]}."""
    history: dict[str, list[dict]] = {name: [] for name in servers}
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for i, turn in enumerate(turns):
        source = module_source(turn.module)
        for name, url in servers.items():
            if turn.new_conversation:
                history[name] = [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{turn.module}.py\n```python\n{source}```\n\n"
                                                             f"{turn.instruction}"}]
            else:
                history[name].append({"role": "user", "content": turn.instruction})
            max_tokens = len(source) // 2 + 256  # the whole file again (colorsys.py: 4062 characters, 1736 tokens)
            out = stream_chat(url, model, history[name], max_tokens, api_key)
            history[name].append({"role": "assistant", "content": out["text"]})
            out.update(turn=i + 1, file=turn.module, correct=correct(out["text"], turn.check),
                       finished=out["completion_tokens"] is not None and out["completion_tokens"] < max_tokens)
            results[name].append(out)
            if progress:
                progress(f"turn {i + 1} {name}: {out['completion_tokens']} tokens in {out['seconds']:.1f} s "
                         f"({out['completion_tokens'] / out['seconds']:.2f}/s), correct: {out['correct']}")
    return results


def session_table(results: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: per server, per turn seconds and the whole session's tokens/s, against the first server."""
    names = list(results)
    base = sum(r["seconds"] for r in results[names[0]])
    turns = len(results[names[0]])
    lines = ["| server | " + " | ".join(f"turn {t + 1} s" for t in range(turns)) +
             " | session s | tokens/s | vs " + names[0] + " | correct |",
             "|---" * (turns + 5) + "|"]
    for name in names:
        rows = results[name]
        total = sum(r["seconds"] for r in rows)
        tokens = sum(r["completion_tokens"] or 0 for r in rows)
        lines.append(f"| {name} | " + " | ".join(f"{r['seconds']:.1f}" for r in rows) +
                     f" | {total:.1f} | {tokens / total:.2f} | {base / total:.2f}x | "
                     f"{sum(r['correct'] for r in rows)}/{len(rows)} |")
    return lines


def summary(results: dict[str, list[dict]]) -> dict:
    """The JSON line's content: per server, the session's seconds, tokens/s, speed-up over the first server."""
    names = list(results)
    base = sum(r["seconds"] for r in results[names[0]])
    out = {}
    for name, rows in results.items():
        total = sum(r["seconds"] for r in rows)
        out[name] = {"seconds": round(total, 2), "turn_seconds": [round(r["seconds"], 2) for r in rows],
                     "ttft": [round(r["ttft"], 2) for r in rows],
                     "prompt_tokens": [r["prompt_tokens"] for r in rows],
                     "completion_tokens": [r["completion_tokens"] for r in rows],
                     "tokens_per_s": round(sum(r["completion_tokens"] or 0 for r in rows) / total, 3),
                     "speedup_vs_" + names[0]: round(base / total, 3),
                     "correct": [r["correct"] for r in rows]}
    return out
