"""What suffix decoding's drafter costs: microseconds per appended token and per drafted token, for the C++
trie and its Python reference, on real code (modules of this interpreter's standard library, tokenized with
the default target's tokenizer).

    .venv/bin/python benchmarks/bench_suffix_trie.py [--modules textwrap,shlex,fnmatch] [--depth 24]

The trie reads the modules (the "prompt"), token by token as the engine appends them; then a decode is
replayed over an edited copy (every `def` renamed, so that the drafts break at the edits), as the proposer
works: at each step it speculates (K = 24) from the last `depth` tokens, the draft is compared with the text
that follows, the accepted tokens plus one are appended, and so on. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import time

from specdec.models.gguf_file import GGUFFile
from specdec.models.store import resolve_model
from specdec.models.tokenizer import Tokenizer
from specdec.speculative.suffix import PySuffixTrie, SuffixTrie, load_library


def tokens_of(tokenizer, modules: list[str]) -> tuple[list[int], list[int]]:
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)
    edited = text.replace("def ", "def renamed_")
    return tokenizer.encode(text), tokenizer.encode(edited)


def replay(trie, prompt: list[int], answer: list[int], depth: int, k: int) -> dict:
    t0 = time.perf_counter()
    for i in range(0, len(prompt)):  # one token at a time, as decoding appends them
        trie.extend(0, prompt[i:i + 1])
    append_s = time.perf_counter() - t0
    context = list(prompt)
    pos, calls, drafted, accepted, spec_s, appended = 0, 0, 0, 0, 0.0, 0
    while pos < len(answer):
        t0 = time.perf_counter()
        draft = trie.speculate(context[-depth:], k)
        spec_s += time.perf_counter() - t0
        calls += 1
        drafted += len(draft.tokens)
        n = 0
        while n < len(draft.tokens) and pos + n < len(answer) and draft.tokens[n] == answer[pos + n]:
            n += 1
        accepted += n
        new = answer[pos:pos + n + 1]
        t0 = time.perf_counter()
        trie.extend(0, new)
        append_s += time.perf_counter() - t0
        appended += len(new)
        context += new
        pos += len(new)
    total = len(prompt) + appended
    return {"append_us_per_token": 1e6 * append_s / total, "speculate_us_per_call": 1e6 * spec_s / calls,
            "us_per_drafted_token": 1e6 * spec_s / max(drafted, 1), "drafted_per_call": drafted / calls,
            "accepted_per_call": accepted / calls, "tokens": total, "nodes_per_token": trie.num_nodes / total,
            "bytes_per_token": trie.memory_bytes / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", default="textwrap,shlex,fnmatch")
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--k", type=int, default=24)
    parser.add_argument("--reference-tokens", type=int, default=3000, help="the Python trie reads only this many")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_gguf(GGUFFile(resolve_model("qwen2.5-coder-1.5b-instruct")))
    prompt, answer = tokens_of(tokenizer, args.modules.split(","))
    lib = load_library()
    rows = {"c++": replay(SuffixTrie(args.depth, lib), prompt, answer, args.depth, args.k)}
    n = args.reference_tokens
    rows["python reference"] = replay(PySuffixTrie(args.depth), prompt[:n], answer[:n], args.depth, args.k)
    print(f"modules {args.modules}: {len(prompt)} tokens read, then a decode of the edited copy replayed; "
          f"depth {args.depth}, K = {args.k}\n")
    print("| trie | append, us/token | speculate, us/call | us per drafted token | drafted / call | "
          "accepted / call | nodes / token | bytes / token |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['append_us_per_token']:.2f} | {r['speculate_us_per_call']:.1f} | "
              f"{r['us_per_drafted_token']:.2f} | {r['drafted_per_call']:.2f} | {r['accepted_per_call']:.2f} | "
              f"{r['nodes_per_token']:.1f} | {r['bytes_per_token']:.0f} |")
    print(json.dumps({"benchmark": "suffix_trie", "depth": args.depth, "k": args.k,
                      "results": {k: {m: round(v, 3) for m, v in r.items()} for k, r in rows.items()}}))


if __name__ == "__main__":
    main()
