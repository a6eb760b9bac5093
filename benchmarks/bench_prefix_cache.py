"""Prefix caching on an agent-like session: every turn resends the system prompt, a file and the whole
conversation, plus a new instruction; streamed against `specdec serve` with and without prefix caching, and
against llama.cpp's server (its per-slot prompt cache) when its binary is there.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--turns 5] [--max-tokens 64] [--llama-server PATH]

Each mode gets its own server (the default pair: the 1.5B target drafted by the 0.5B, K = 5 fixed; llama.cpp
with the same GGUF files and K), one at a time, warmed up by a short request on another prompt sent twice
(the second a hit; not measured). The session is greedy; each mode's history holds its own answers, so
specdec's two runs must answer alike turn for turn (prefix caching changes only speed). Per turn: prompt
tokens, cached tokens (as the server reports them), time to first token and total time. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

from load_test import free_port, launch
from specdec.bench.agent import stream_chat
from specdec.data import DATA_DIR

TARGET, DRAFT, K = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", 5
LLAMA_SERVER = Path(__file__).resolve().parents[2] / "shared" / "tools" / "llama.cpp-avx2" / "llama-server"
SYSTEM = ("You are a coding agent working in a Python repository. You are shown one file of the repository, "
          "then the user's instructions one at a time. Answer each with code or a short explanation; keep "
          "answers brief and to the point, and do not repeat the file.")
INSTRUCTIONS = [
    "Summarize what each function in utils.py does, one line each.",
    "Implement has_close_elements.",
    "Write a pytest test for separate_paren_groups.",
    "Implement truncate_number.",
    "Which function would you refactor first, and why?",
    "Implement below_zero.",
    "Write a docstring for mean_absolute_deviation.",
]


def the_file() -> str:
    """utils.py: the first five HumanEval problems, one after the other (~600 tokens)."""
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(5))]
    return "\n\n".join(r["prompt"].strip() for r in rows)


def server_command(mode: str, port: int, llama_server: Path) -> list[str]:
    if mode == "llama.cpp":
        from specdec.models.store import resolve_model

        return [str(llama_server), "-m", str(resolve_model(TARGET)), "-md", str(resolve_model(DRAFT)),
                "--spec-type", "draft-simple", "--spec-draft-n-max", str(K), "-t", "2", "-c", "4096",
                "--host", "127.0.0.1", "--port", str(port)]
    flags = ["--no-enable-prefix-caching"] if mode == "specdec, no cache" else []
    return [sys.executable, "-m", "specdec", "serve", TARGET, "--speculative-model", DRAFT, "--num-speculative-tokens",
            str(K), "--max-num-seqs", "1", "--max-model-len", "4096", "--port", str(port), *flags]


def turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request: its text, time to first token, total time and usage."""
    return stream_chat(url, TARGET, messages, max_tokens)


def session(url: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": f"{SYSTEM}\n\nutils.py:\n```python\n{the_file()}\n```"}]
    results = []
    for instruction in INSTRUCTIONS[:turns]:
        messages.append({"role": "user", "content": instruction})
        result = turn(url, messages, max_tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        results.append(result)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=5, choices=range(1, len(INSTRUCTIONS) + 1))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER,
                    help="llama.cpp's server binary (that mode is skipped if it is absent)")
    args = ap.parse_args()
    modes = ["specdec, cache", "specdec, no cache"] + (["llama.cpp"] if args.llama_server.is_file() else [])
    log_dir = tempfile.mkdtemp(prefix="specdec-prefix-")
    print(f"server logs in {log_dir}", flush=True)
    runs = {}
    for mode in modes:
        port = free_port()
        proc = launch(server_command(mode, port, args.llama_server), port, log_dir)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(2):  # one-time costs (the second: of a hit), not measured
                turn(url, [{"role": "user", "content": "Say hi."}], 4)
            runs[mode] = session(url, args.turns, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        for i, r in enumerate(runs[mode], 1):
            cached = "-" if r["cached_tokens"] is None else r["cached_tokens"]
            print(f"{mode:18} turn {i}  prompt {r['prompt_tokens']:5}  cached {cached:>5}  out {r['completion_tokens']:3}"
                  f"  ttft {r['ttft']:6.2f}s  total {r['seconds']:6.2f}s", flush=True)
    totals = {mode: sum(r["seconds"] for r in rs) for mode, rs in runs.items()}
    ttfts = {mode: sum(r["ttft"] for r in rs[1:]) for mode, rs in runs.items()}
    speedup = totals["specdec, no cache"] / totals["specdec, cache"]
    differing = [i for i, (a, b) in enumerate(zip(runs["specdec, cache"], runs["specdec, no cache"]), 1)
                 if a["text"] != b["text"]]
    print()
    print(f"{'mode':18} {'session':>9} {'ttft, turns 2+':>15}")
    for mode in modes:
        print(f"{mode:18} {totals[mode]:8.1f}s {ttfts[mode]:14.1f}s")
    print(f"prefix caching: session {speedup:.2f}x faster; answers that differ with and without: "
          f"{', '.join(f'turn {i}' for i in differing) or 'none'}")
    for i in differing[:1]:
        a, b = runs["specdec, cache"][i - 1]["text"], runs["specdec, no cache"][i - 1]["text"]
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  turn {i}, from character {at}: {a[at:at + 60]!r} (cache) vs {b[at:at + 60]!r} (no cache)")
    print(json.dumps({"benchmark": "prefix_cache", "turns": args.turns, "max_tokens": args.max_tokens,
                      "session_seconds": {m: round(t, 2) for m, t in totals.items()},
                      "ttft_turns_2_on_seconds": {m: round(t, 2) for m, t in ttfts.items()},
                      "speedup": round(speedup, 3), "outputs_identical": not differing,
                      "per_turn": {m: [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "text"}
                                       for r in rs] for m, rs in runs.items()}}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
