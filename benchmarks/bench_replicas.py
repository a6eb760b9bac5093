"""Replicas and routing under a multi-turn agent workload: `specdec serve` alone, `--replicas 1`, and
`--replicas 2` with Ray Serve's default routing and with cache-aware routing, one after the other on the
same workload, each server started here and stopped after its run.

The workload: `--conversations` conversations, `--turns` turns each, `--concurrency` clients each driving
one conversation at a time (a turn waits for the previous turn's answer, which joins the history as an
agent's does). Every conversation opens with the same system prompt (the agent's rules, from `specdec bench
agent`) and a HumanEval function of its own; later turns ask short follow-ups. Greedy, streamed, short
answers (`--max-tokens`). Per server: output tokens/s, time to first token (p50, p90) and the prefix-cache
hit rate over the run (cached prompt tokens / prompt tokens, from /metrics, summed over replicas).

    python benchmarks/bench_replicas.py                       # the 0.5B model, 8 x 4 turns, 4 clients
    python benchmarks/bench_replicas.py --servers replicas2-default,replicas2-affinity --conversations 16

    python benchmarks/bench_replicas.py --servers replicas2-default,replicas2-affinity --long-turns

`--long-turns` pastes another function into each follow-up, as an agent pastes files and tool outputs: each
turn then adds more to the history than the opening holds, which is where routing matters most.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specdec.bench.agent import SYSTEM
from specdec.bench.prompts import Prompt, dataset_prompts
from specdec.bench.serve import one_request, summarize

SERVERS = {  # name -> `specdec serve` flags past the model's
    "single": [],
    "replicas1": ["--replicas", "1"],
    "replicas2-default": ["--replicas", "2", "--routing", "default"],
    "replicas2-affinity": ["--replicas", "2", "--routing", "affinity"],
}
FOLLOW_UPS = ("Add type hints to it.", "Now write one unit test for it.", "Explain its complexity in one line.",
              "Rename its arguments to clearer names.", "Make it handle empty input.")


def conversations(n: int) -> list[list[dict]]:
    """The opening messages of `n` conversations: the shared system prompt, a HumanEval function each."""
    functions = [p.prompt for p in dataset_prompts("humaneval")]
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Complete this function:\n```python\n{functions[i % len(functions)]}```"}]
            for i in range(n)]


def follow_up(i: int, turn: int, long_turns: bool) -> str:
    """Turn `turn` of conversation i: a short question; with `long_turns`, also another function pasted in
    (as an agent pastes a file or a tool's output), so that each turn adds ~150 tokens to the history."""
    question = FOLLOW_UPS[(i + turn) % len(FOLLOW_UPS)]
    if not long_turns:
        return question
    functions = [p.prompt for p in dataset_prompts("humaneval")]
    return f"Here is a related function:\n```python\n{functions[(37 * i + turn) % len(functions)]}```\n{question}"


async def run_workload(url: str, model: str, openings: list[list[dict]], turns: int, concurrency: int,
                       max_tokens: int, long_turns: bool = False) -> tuple[list[dict], float]:
    """Every conversation's turns in order, `concurrency` conversations at a time: the results and wall time."""
    todo = list(enumerate(openings))
    results: list[dict] = []

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            i, history = todo.pop(0)
            for turn in range(turns):
                if turn:
                    history.append({"role": "user", "content": follow_up(i, turn, long_turns)})
                out = await one_request(http, url, model, Prompt(messages=tuple(history)), max_tokens, 0.0)
                results.append(out)
                history.append({"role": "assistant", "content": out["text"]})

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=3600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def prefix_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found cached) so far, summed over whatever /metrics reports."""
    values = {"specdec:prefix_cache_queries_total": 0.0, "specdec:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values["specdec:prefix_cache_queries_total"], values["specdec:prefix_cache_hits_total"]


def settled_counters(url: str) -> tuple[float, float]:
    """`prefix_counters` once two reads 2 s apart agree (replicas report every second)."""
    previous, value = None, prefix_counters(url)
    while value != previous:
        time.sleep(2)
        previous, value = value, prefix_counters(url)
    return value


def start_server(model: str, flags: list[str], port: int, threads: int, log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "specdec", "serve", model, "--port", str(port), "--max-num-seqs", "4",
               "--max-model-len", "4096", "--replica-threads", str(threads), "--disable-log-requests", *flags]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(command)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy in 900 s: {' '.join(command)}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Killer(threading.Thread):
    """`after` seconds into the run, SIGKILLs the replica of rank 0 and times its return: `recovered_s`, from
    the kill to /health answering 200 with a new process in rank 0."""

    def __init__(self, url: str, after: float):
        super().__init__(daemon=True)
        self.url, self.after, self.recovered_s = url, after, None

    def run(self) -> None:
        time.sleep(self.after)
        victim = next(r["pid"] for r in httpx.get(f"{self.url}/replicas", timeout=30).json()["replicas"]
                      if r["rank"] == 0)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 600:
            listed = httpx.get(f"{self.url}/replicas", timeout=30).json()["replicas"]
            if httpx.get(f"{self.url}/health", timeout=30).status_code == 200 and \
                    victim not in {r["pid"] for r in listed}:
                self.recovered_s = time.monotonic() - killed
                return
            time.sleep(0.5)


def measure(name: str, args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    base, _, kill = name.partition("+")
    with open(f"{args.log_dir}/{name}.log", "w") as log:
        proc = start_server(args.model, SERVERS[base], args.port, args.threads, log)
        try:
            warm = conversations(1)  # one request first, unmeasured: the same for every server
            asyncio.run(run_workload(url, args.model, warm, 1, 1, 4))
            queries, hits = settled_counters(url)
            killer = Killer(url, args.kill_after) if kill else None
            if killer:
                killer.start()
            results, seconds = asyncio.run(run_workload(url, args.model, conversations(args.conversations),
                                                        args.turns, args.concurrency, args.max_tokens,
                                                        args.long_turns))
            if killer:
                killer.join()
            queries_after, hits_after = settled_counters(url)
        finally:
            stop_server(proc)
    row = {"server": name, **summarize(results, seconds),
           "prefix_hit_rate": (hits_after - hits) / max(queries_after - queries, 1.0),
           "prompt_tokens": queries_after - queries}
    if killer:
        row["killed_replica_back_s"] = killer.recovered_s
    print(f"{name}: {row['throughput']:.2f} tokens/s, hit rate {row['prefix_hit_rate']:.3f}, "
          f"{len(row['errors'])} errors", file=sys.stderr, flush=True)
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| server | requests | errors | output tokens/s | TTFT p50 / p90 (s) | prefix-cache hit rate | "
             "prompt tokens | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['requests']} | {len(r['errors'])} | {r['throughput']:.2f} | "
                     f"{r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} | {r['prefix_hit_rate']:.3f} | "
                     f"{r['prompt_tokens']:.0f} | {r['seconds']:.0f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)}; NAME+kill: SIGKILL its replica of rank 0 "
                             "--kill-after seconds into the run")
    parser.add_argument("--kill-after", type=float, default=20.0)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--long-turns", action="store_true",
                        help="paste another function into every follow-up (~150 tokens a turn)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each engine (replica)")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--log-dir", default="/tmp", help="where each server's output goes (NAME.log)")
    args = parser.parse_args()
    names = [n for n in args.servers.split(",") if n]
    unknown = sorted({n.removesuffix("+kill") for n in names} - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(SERVERS)}")
    rows = [measure(name, args) for name in names]
    for r in rows:
        if "killed_replica_back_s" in r:
            print(f"{r['server']}: {len(r['errors'])} failed requests ({', '.join(sorted(set(r['errors'])))}); the "
                  f"killed replica answered again after {r['killed_replica_back_s']} s")
    print("\n".join(table(rows)))
    print(json.dumps({"benchmark": "replicas", "model": args.model, "conversations": args.conversations,
                      "turns": args.turns, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                      "long_turns": args.long_turns,
                      "threads": args.threads, "results": rows}))
    return 0 if not any(r["errors"] for r in rows if "killed_replica_back_s" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())
