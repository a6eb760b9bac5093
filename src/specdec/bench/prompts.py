"""The prompts a bench runs: a JSONL file of the user's own, or a data set shipped with specdec.

A JSONL line holds `prompt` (text, completed as it is) or `messages` (a chat, rendered by the model's
template), and optionally `category` (the report then shows speedup by category):

    {"prompt": "def fib(n):", "category": "code"}
    {"messages": [{"role": "user", "content": "Name three rivers."}], "category": "qa"}

`--dataset humaneval` gives HumanEval's function prompts (raw completions), `spec-bench` the first turn of
Spec-Bench's questions as chats, categories taking turns, and `spec-bench:CATEGORY` one category. Only the
half the shipped heads never saw is used (`specdec.training.prompt_split`).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specdec.data import DATA_DIR

DATASETS = ("humaneval", "spec-bench")


@dataclass(frozen=True)
class Prompt:
    prompt: str | None = None  # raw text
    messages: tuple[dict, ...] | None = None  # a chat
    category: str | None = None

    def token_ids(self, tokenizer) -> list[int]:
        """What the target reads: the text as `LLM.generate` encodes it, or the chat as `LLM.chat` renders it."""
        if self.messages is not None:
            return tokenizer.encode(tokenizer.apply_chat_template(list(self.messages)), add_special_tokens=False)
        return tokenizer.encode(self.prompt, add_special_tokens=True)

    def request_body(self) -> dict:
        """The OpenAI request fields for it: `prompt` (for /v1/completions) or `messages` (chat)."""
        return {"messages": list(self.messages)} if self.messages is not None else {"prompt": self.prompt}


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts of a JSONL file; a line without `prompt` or `messages` is an error naming the line."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise ValueError(f"{path}:{n}: each line needs one of 'prompt' (text) or 'messages' (a chat)")
            if "prompt" in row and not isinstance(row["prompt"], str):
                raise ValueError(f"{path}:{n}: 'prompt' must be a string")
            if "messages" in row and not (isinstance(row["messages"], list) and row["messages"]):
                raise ValueError(f"{path}:{n}: 'messages' must be a non-empty list of {{role, content}}")
            category = row.get("category")
            prompts.append(Prompt(row.get("prompt"), tuple(row["messages"]) if "messages" in row else None,
                                  None if category is None else str(category)))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def dataset_prompts(name: str) -> list[Prompt]:
    """`humaneval`, `spec-bench` or `spec-bench:CATEGORY`: the evaluation half of a shipped data set."""
    base, _, category = name.partition(":")
    if base == "humaneval" and not category:
        with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f][:100]  # 100+ is the heads' training split
        return [Prompt(prompt=r["prompt"], category="humaneval") for r in rows]
    if base != "spec-bench":
        raise ValueError(f"unknown data set {name!r}; choose humaneval, spec-bench or spec-bench:CATEGORY")
    with open(DATA_DIR / "spec_bench" / "question.jsonl") as f:
        rows = [json.loads(line) for line in f]
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    if category and category not in by_category:
        raise ValueError(f"Spec-Bench has no category {category!r}; it has {', '.join(by_category)}")
    halves = [group[:len(group) // 2] for c, group in by_category.items() if not category or c == category]
    interleaved = []
    for i in range(max(map(len, halves))):  # the categories take turns
        interleaved += [group[i] for group in halves if i < len(group)]
    return [Prompt(messages=({"role": "user", "content": r["turns"][0]},), category=r["category"]) for r in interleaved]
