"""Load generator: concurrent streaming clients against `specdec serve` on 127.0.0.1, per speculation mode.
The clients and figures are `specdec bench serve`'s (`specdec.bench.serve`, one server); this program adds
the servers, one per mode, and the modes' turns.

    .venv/bin/python benchmarks/load_test.py [--concurrency 1,2,4,8,16] [--max-tokens 48] [--rounds 3]

For each mode (speculation off, fixed K=5, adaptive) it starts its own server (batching up to the largest
concurrency), all at once, and warms each up with one short request (not counted). Then, for each
concurrency level, it runs `--rounds` rounds; in each round every mode in turn (the order rotating from
round to round) gets that many clients at once, each sending `--requests-per-client` streaming chat
requests (HumanEval prompts, greedy; the same prompts for every mode within a round, new ones in the next
round). Taking turns this way spreads the machine's drift over the modes alike, and the rounds average it
out: one round of one request per client is too short to tell a few percent apart here.

Reports per level and mode, over all its rounds: output tokens/s (all tokens over all the time), time to
first token and time per output token (median, p90), acceptance rate (from /metrics) and the server's
memory (RSS); then adaptive / the best of the others, pooled and round by round. Failed requests are
counted apart (their tokens are not throughput) and each server's log is kept in a temporary folder
(printed). Bounded: a fixed number of requests, and `--timeout` seconds per round.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from specdec.bench.prompts import Prompt, dataset_prompts
from specdec.bench.serve import run_round, spec_counters, summarize

MODEL = "qwen2.5-coder-1.5b-instruct"
MODES = {
    "off": ["--num-speculative-tokens", "0"],  # plain decoding (no flags at all is auto speculation)
    "fixed K=5": ["--speculative-model", "qwen2.5-coder-0.5b-instruct", "--num-speculative-tokens", "5"],
    "adaptive": ["--speculative-model", "qwen2.5-coder-0.5b-instruct"],
    "auto": [],  # serve's defaults
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts() -> list[Prompt]:
    """HumanEval 0-99 (100+ is the shipped heads' training split), as chat requests."""
    return [Prompt(messages=({"role": "user", "content": f"Complete this function:\n{p.prompt}"},))
            for p in dataset_prompts("humaneval")]


def start_server(serve_args: list[str], log_dir: str, model: str = MODEL) -> tuple[subprocess.Popen, str]:
    """`specdec serve model *serve_args` on a free port, its log in `log_dir`; (process, url) once healthy.
    A port taken by another process between choosing it and binding it (Ray's workers take random ports)
    is given up for another."""
    for _ in range(5):
        port = free_port()
        cmd = [sys.executable, "-m", "specdec", "serve", model, *serve_args, "--port", str(port)]
        try:
            return launch(cmd, port, log_dir), f"http://127.0.0.1:{port}"
        except PortTaken:
            continue
    raise RuntimeError("no free port could be bound in 5 tries")


class PortTaken(RuntimeError):
    pass


def launch(cmd: list[str], port: int, log_dir: str) -> subprocess.Popen:
    """Run the server `cmd` (listening on `port`), its log in `log_dir`; the process once /health answers."""
    log = open(os.path.join(log_dir, f"server-{port}.log"), "w")  # the server's own log, for what went wrong
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:  # /health of this process: its /v1/models lists models (another process may hold the port)
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200 and \
                    "data" in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json():
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            log.flush()
            if "address already in use" in open(log.name).read():
                raise PortTaken(port)
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)} (log in {log_dir})")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy in 600 s")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per round")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    texts = prompts()
    log_dir = tempfile.mkdtemp(prefix="specdec-load-")
    print(f"server logs in {log_dir}", flush=True)
    rows = []
    servers = {}
    try:
        for mode in modes:  # all up at once (an idle server waits on its inbox: it takes no CPU)
            servers[mode] = start_server([*MODES[mode], "--max-num-seqs", str(max(levels)), "--max-model-len", "1024"],
                                         log_dir)
        for mode in modes:  # first requests pay one-time costs (allocator, kernels): not measured
            asyncio.run(run_round(servers[mode][1], MODEL, texts[-1:], 1, 1, 8, 0.0, args.timeout))
        for c in levels:
            n = c * args.requests_per_client
            done: dict[str, list] = {mode: [] for mode in modes}  # per mode: (results, seconds) per round
            counters = {mode: dict.fromkeys(("drafts", "drafted", "accepted"), 0.0) for mode in modes}
            for r in range(args.rounds):
                batch = [texts[(r * n + i) % len(texts)] for i in range(n)]  # new prompts each round
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # who goes first rotates
                    url = servers[mode][1]
                    before = spec_counters(url)
                    done[mode].append(asyncio.run(run_round(url, MODEL, batch, c, args.requests_per_client,
                                                            args.max_tokens, 0.0, args.timeout)))
                    for name, value in spec_counters(url).items():
                        counters[mode][name] += value - before[name]
            for mode in modes:
                every = [x for results, _ in done[mode] for x in results]
                row = summarize(every, sum(seconds for _, seconds in done[mode]))
                drafted, accepted = counters[mode]["drafted"], counters[mode]["accepted"]
                row.update(mode=mode, concurrency=c, rounds=args.rounds,
                           drafting_steps=int(counters[mode]["drafts"]),
                           round_throughput=[round(sum(x["tokens"] for x in res if x["error"] is None) / sec, 3)
                                             for res, sec in done[mode]],
                           rss_gib=round(rss_bytes(servers[mode][0].pid) / 2 ** 30, 2),
                           acceptance_rate=round(accepted / drafted, 3) if drafted else None)
                rows.append(row)
                print(f"{mode:10} c={c:<3} {row['throughput']:7.2f} tok/s  ttft {row['ttft_p50']:.2f}/"
                      f"{row['ttft_p90']:.2f}s  tpot {row['tpot_p50'] * 1e3:.0f}/{row['tpot_p90'] * 1e3:.0f}ms  "
                      f"accept {row['acceptance_rate']} ({row['drafting_steps']} drafting steps)  "
                      f"rss {row['rss_gib']} GiB  rounds {row['round_throughput']}"
                      + (f"  FAILED {len(row['errors'])}: {row['errors'][0]}" if row["errors"] else ""), flush=True)
            level = {x["mode"]: x for x in rows if x["concurrency"] == c}
            if "adaptive" in level and len(level) > 1:
                others = [m for m in level if m != "adaptive"]
                best = max(level[m]["throughput"] for m in others)
                per_round = [a / max(level[m]["round_throughput"][i] for m in others)
                             for i, a in enumerate(level["adaptive"]["round_throughput"])]
                level["adaptive"]["vs_best_other"] = round(level["adaptive"]["throughput"] / best, 3)
                level["adaptive"]["vs_best_other_by_round"] = [round(x, 3) for x in per_round]
                print(f"{'':10} c={c:<3} adaptive / best of the others: {level['adaptive']['vs_best_other']:.2f} "
                      f"(by round: {' '.join(f'{x:.2f}' for x in per_round)})", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    single = {x["mode"]: x["throughput"] for x in rows if x["concurrency"] == 1}
    for x in rows:
        if x["concurrency"] > 1 and x["mode"] in single:  # batched vs the same requests one client at a time
            x["vs_single_client"] = round(x["throughput"] / single[x["mode"]], 3)
    print(json.dumps({"benchmark": "load", "max_tokens": args.max_tokens, "rounds": args.rounds, "results": rows}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
