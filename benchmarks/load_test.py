"""Load generator: concurrent streaming clients against `specdec serve` on 127.0.0.1, per speculation mode.

    .venv/bin/python benchmarks/load_test.py [--concurrency 1,2,4,8,16] [--max-tokens 48] [--requests-per-client 1]

For each mode (speculation off, fixed K=5, adaptive) it starts its own server (batching up to the largest
concurrency), all at once; then for each concurrency level, mode after mode, runs that many clients at
once against that mode's server, each sending
`--requests-per-client` streaming chat requests (HumanEval prompts, greedy). Reports output tokens/s,
time to first token and time per output token (median, p95), acceptance rate (from /metrics) and the
server's memory (RSS); failed requests are counted apart (their tokens are not throughput) and each
server's log is kept in a temporary folder (printed). Bounded: a fixed number of requests, and
`--timeout` seconds per level.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MODES = {
    "off": [],
    "fixed K=5": ["--speculative-model", "qwen2.5-coder-0.5b-instruct", "--num-speculative-tokens", "5"],
    "adaptive": ["--speculative-model", "qwen2.5-coder-0.5b-instruct"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts() -> list[str]:
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    return [f"Complete this function:\n{r['prompt']}" for r in rows[:32]]


def start_server(mode_args: list[str], max_num_seqs: int, log_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specdec", "serve", "qwen2.5-coder-1.5b-instruct", *mode_args, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--max-model-len", "1024"]
    log = open(os.path.join(log_dir, f"server-{port}.log"), "w")  # the server's own log, for what went wrong
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy in 600 s")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "qwen2.5-coder-1.5b-instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    error = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # the server failed the request mid-stream
                error = chunk["error"].get("message", str(chunk["error"]))
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens, "end": end,
            "error": error if r.status_code == 200 else f"HTTP {r.status_code}"}


async def run_level(url: str, concurrency: int, per_client: int, max_tokens: int, timeout: float) -> dict:
    texts = prompts()
    async with httpx.AsyncClient(timeout=timeout) as client:
        async def client_loop(c: int) -> list[dict]:
            return [await one_request(client, url, texts[(c * per_client + i) % len(texts)], max_tokens)
                    for i in range(per_client)]

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(client_loop(c) for c in range(concurrency))), timeout)
        elapsed = time.perf_counter() - start
    every = [r for rs in results for r in rs]
    flat = [r for r in every if r["error"] is None]
    if not flat:
        raise RuntimeError(f"every request failed: {every[0]['error']}")
    ttft = sorted(r["ttft"] for r in flat)
    tpot = sorted(r["tpot"] for r in flat)

    def p95(xs):
        return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]

    return {"throughput": sum(r["tokens"] for r in flat) / elapsed, "ttft_median": statistics.median(ttft),
            "ttft_p95": p95(ttft), "tpot_median": statistics.median(tpot), "tpot_p95": p95(tpot),
            "requests": len(every), "errors": [r["error"] for r in every if r["error"] is not None]}


def spec_counters(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in ("specdec:spec_decode_num_draft_tokens_total", "specdec:spec_decode_num_accepted_tokens_total"):
                values[sample.name] = sample.value
    return values.get("specdec:spec_decode_num_draft_tokens_total", 0.0), \
        values.get("specdec:spec_decode_num_accepted_tokens_total", 0.0)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    log_dir = tempfile.mkdtemp(prefix="specdec-load-")
    print(f"server logs in {log_dir}", flush=True)
    rows = []
    servers = {}
    try:
        for mode in modes:  # all up at once (an idle server waits on its inbox: it takes no CPU)
            servers[mode] = start_server(MODES[mode], max(levels), log_dir)
        for c in levels:  # the modes side by side at each level: the machine drifts less between them
            for mode in modes:
                proc, url = servers[mode]
                drafted0, accepted0 = spec_counters(url)
                row = asyncio.run(run_level(url, c, args.requests_per_client, args.max_tokens, args.timeout))
                drafted, accepted = spec_counters(url)
                row.update(mode=mode, concurrency=c, rss_gib=round(rss_bytes(proc.pid) / 2 ** 30, 2),
                           acceptance_rate=round((accepted - accepted0) / (drafted - drafted0), 3)
                           if drafted > drafted0 else None)
                rows.append(row)
                print(f"{mode:10} c={c:<3} {row['throughput']:7.2f} tok/s  ttft {row['ttft_median']:.2f}/"
                      f"{row['ttft_p95']:.2f}s  tpot {row['tpot_median'] * 1e3:.0f}/{row['tpot_p95'] * 1e3:.0f}ms  "
                      f"accept {row['acceptance_rate']}  rss {row['rss_gib']} GiB"
                      + (f"  FAILED {len(row['errors'])}: {row['errors'][0]}" if row["errors"] else ""), flush=True)
            level = {r["mode"]: r["throughput"] for r in rows if r["concurrency"] == c}
            if "adaptive" in level and len(level) > 1:
                best = max(v for m, v in level.items() if m != "adaptive")
                print(f"{'':10} c={c:<3} adaptive / best of the others: {level['adaptive'] / best:.2f}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"benchmark": "load", "max_tokens": args.max_tokens, "results": rows}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
