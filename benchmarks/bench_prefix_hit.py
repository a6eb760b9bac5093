"""Time to first token on a prefix-cache hit of a long prompt: `specdec serve` with its defaults against
llama.cpp's server (its per-slot prompt cache) on the same GGUF and threads.

    .venv/bin/python benchmarks/bench_prefix_hit.py [--depth 10240] [--threads 2] [--llama-server PATH]

The prompt is `depth` tokens of real source text (Python standard-library modules, tokenized by the
target's tokenizer) sent as token ids, so both servers read the same tokens. Each server, one at a time:
a short warm-up request, the prompt cold (its whole prefill: the slow part), then one output token for
  - the same prompt again;
  - the prompt with its last token changed;
  - the prompt and 32 more tokens (an agent's next turn: the previous request's prompt and answer are a
    prefix of it).
Per request: wall time (one output token, so the time to first token), and the prompt tokens the server
reports as cached. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

from bench_prefix_cache import LLAMA_SERVER, TARGET
from load_test import free_port, launch

STDLIB = ("argparse.py", "typing.py", "dataclasses.py", "inspect.py", "pathlib.py", "subprocess.py")
CASES = ("cold", "same prompt again", "last token changed", "32 more tokens")


def prompt_ids(depth: int) -> list[int]:
    """`depth` + 32 tokens of standard-library source."""
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.store import resolve_model
    from specdec.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(resolve_model(TARGET)))
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in STDLIB:
        ids += tokenizer.encode((lib / name).read_text())
        if len(ids) >= depth + 32:
            return ids[:depth + 32]
    raise SystemExit(f"the standard-library files hold {len(ids)} tokens, fewer than {depth + 32}")


def requests(ids: list[int], depth: int) -> dict[str, list[int]]:
    prompt = ids[:depth]
    return {"cold": prompt, "same prompt again": prompt,
            "last token changed": prompt[:-1] + [(prompt[-1] + 1) % 30000], "32 more tokens": ids[:depth + 32]}


def ask_specdec(client: httpx.Client, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={"model": TARGET, "prompt": ids, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def ask_llama(client: httpx.Client, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post("/completion", json={"prompt": ids, "n_predict": 1, "cache_prompt": True, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["timings"]["cache_n"]


def run_server(name: str, depth: int, threads: int, llama_server: Path, ids: list[int], log_dir: str) -> dict:
    from specdec.models.store import resolve_model

    port = free_port()
    if name == "llama.cpp":
        cmd = [str(llama_server), "-m", str(resolve_model(TARGET)), "-t", str(threads), "-c", str(depth + 1024),
               "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
        ask = ask_llama
    else:
        cmd = [sys.executable, "-m", "specdec", "serve", TARGET, "--port", str(port)]
        ask = ask_specdec
    proc = launch(cmd, port, log_dir)
    out = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=7200) as client:
            ask(client, ids[depth + 32 - 16:])  # warm-up: other tokens, not measured
            for case, prompt in requests(ids, depth).items():
                seconds, cached = ask(client, prompt)
                out[case] = {"seconds": round(seconds, 3), "cached": cached, "prompt": len(prompt)}
                print(f"{name:8} {case:20} prompt {len(prompt):6}  cached {cached:6}  {seconds:8.2f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=10240)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's -t (specdec uses the machine's cores)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER,
                    help="llama.cpp's server binary (skipped if it is absent)")
    args = ap.parse_args()
    ids = prompt_ids(args.depth)
    log_dir = tempfile.mkdtemp(prefix="specdec-prefix-hit-")
    print(f"server logs in {log_dir}", flush=True)
    names = ["specdec"] + (["llama.cpp"] if args.llama_server.is_file() else [])
    results = {name: run_server(name, args.depth, args.threads, args.llama_server, ids, log_dir) for name in names}
    print()
    print(f"{'request':20} " + " ".join(f"{name + ' s':>12}" for name in names) + ("  llama.cpp / specdec" if len(names) > 1 else ""))
    for case in CASES:
        row = [results[name][case]["seconds"] for name in names]
        ratio = f"  {row[1] / row[0]:18.2f}x" if len(row) > 1 else ""
        print(f"{case:20} " + " ".join(f"{s:12.2f}" for s in row) + ratio)
    print(json.dumps({"benchmark": "prefix_hit", "depth": args.depth, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
