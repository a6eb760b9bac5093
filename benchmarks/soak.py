"""Soak test: many streaming clients, valid and invalid requests and disconnects, for minutes, against one server.

    .venv/bin/python benchmarks/soak.py [--duration 180] [--clients 16] [--model qwen2.5-coder-0.5b-instruct]
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000        # a server already running
    .venv/bin/python benchmarks/soak.py --defaults --slow-loris 64          # serve's defaults, hostile sockets

It starts `specdec serve MODEL` (n-gram speculation, `--max-num-seqs 8`) unless given `--url`, computes each
prompt's greedy reference text alone, then runs `--clients` clients for `--duration` seconds. Each client
loops over request kinds, drawn at random (seeded): greedy chat streamed and not, whose text must equal its
reference ("corrupted" otherwise; "lost" if no complete answer came back); seeded sampling with edge-of-range
parameters (a valid answer expected); malformed requests (a 4xx with an OpenAI error object expected); and
streams the client drops after a few events (the server must free them); and 3 MB `/tokenize` calls (a
400 expected at once: the tokenize flood). Beside them, `--slow-loris N` sockets dribble a request head one
byte every 2 s, reopened when the server closes them (its headers deadline). It records the server's RSS
every 10 s. Goal: zero lost or corrupted outputs, no engine-wide failure, no 5xx, RSS flat and within the
memory budget the server states at start (`--defaults`: `serve`'s own settings, auto speculation).

Reports requests by kind and outcome, p50/p99 latency of the greedy requests, RSS at the start and the end;
a table, then one JSON line. Bounded: clients start new requests for `--duration` seconds (those then in
flight finish), each request `--timeout` seconds at most.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import statistics
import tempfile
import time

import httpx

from load_test import rss_bytes, start_server

PROMPTS = [
    "Write a Python function that reverses a string.", "What is a binary search? One paragraph.",
    "Give three uses of a hash map.", "Explain recursion to a child.", "Write FizzBuzz in Python.",
    "What does `git rebase` do?", "Name the SOLID principles.", "Write a SQL query counting rows per day.",
]
INVALID = [  # (path, raw body): each must be answered 4xx with an OpenAI error object
    ("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": ' +
     json.dumps(["s"] * 100).encode() + b"}"),
    ("/v1/completions", b'{"prompt": "' + b"x" * 2_000_000 + b'"}'),
    ("/v1/completions", b'{"prompt": [1, 99999999]}'), ("/v1/completions", b"[" * 10000),
]
SAMPLING = [  # valid, at the edges of their ranges
    {"temperature": 1e-40}, {"temperature": 5e-324, "top_p": 5e-324}, {"temperature": 100, "top_k": 1},
    {"temperature": 0.8, "min_p": 1, "seed": 2**64 - 1, "n": 2}, {"repetition_penalty": 0.01, "logit_bias": {"0": 100}},
    {"temperature": 1, "logprobs": True, "top_logprobs": 20, "frequency_penalty": -2},
]
KINDS = {"greedy stream": 4, "greedy": 2, "sampling": 2, "invalid": 2, "disconnect": 1, "tokenize flood": 1}
FLOOD_BODY = json.dumps({"prompt": " ".join(PROMPTS * 40_000)[:3_000_000]}).encode()


class Soak:
    def __init__(self, url: str, model: str, max_tokens: int, timeout: float, seed: int):
        self.url, self.model, self.max_tokens, self.timeout = url, model, max_tokens, timeout
        self.rng = random.Random(seed)
        self.outcomes: collections.Counter = collections.Counter()  # (kind, outcome) -> count
        self.latency: list[float] = []  # seconds, greedy requests that completed
        self.examples: dict[tuple[str, str], str] = {}  # one detail per (kind, outcome) that went wrong
        self.reference: dict[str, str] = {}
        self.engine_wide = 0  # answers saying the engine failed every request in flight
        self.refusals: list[float] = []  # seconds, tokenize-flood calls
        self.loris = collections.Counter()  # slow-loris sockets: "opened", "closed by the server"

    def body(self, prompt: str, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": self.max_tokens, **extra}

    async def answer(self, c: httpx.AsyncClient, body: dict) -> tuple[str | None, str]:
        """(text, problem): the text of a complete answer, or None and what went wrong."""
        if not body.get("stream"):
            r = await c.post(f"{self.url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}: {r.text[:200]}"
            return r.json()["choices"][0]["message"]["content"], ""
        text, done = "", False
        async with c.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return None, f"error event: {event['error']['message'][:200]}"
                    text += "".join(ch["delta"].get("content", "") for ch in event["choices"])
        return (text, "") if done else (None, "stream ended without [DONE]")

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        self.engine_wide += "aborted every request" in detail
        if detail:
            self.examples.setdefault((kind, outcome), detail)

    async def one(self, c: httpx.AsyncClient, kind: str) -> None:
        prompt = self.rng.choice(PROMPTS)
        if kind in ("greedy stream", "greedy"):
            t0 = time.perf_counter()
            text, problem = await self.answer(c, self.body(prompt, stream=kind == "greedy stream"))
            if text is None:
                self.record(kind, "lost", problem)
            elif text != self.reference[prompt]:
                self.record(kind, "corrupted", f"{prompt!r}: {text[:100]!r}")
            else:
                self.latency.append(time.perf_counter() - t0)
                self.record(kind, "ok")
        elif kind == "sampling":
            text, problem = await self.answer(c, self.body(prompt, stream=self.rng.random() < 0.5,
                                                           **self.rng.choice(SAMPLING)))
            self.record(kind, "ok" if text is not None else "lost", problem)
        elif kind == "tokenize flood":
            t0 = time.perf_counter()
            r = await c.post(f"{self.url}/tokenize", content=FLOOD_BODY, headers={"content-type": "application/json"})
            refused = r.status_code == 400 and r.json().get("error", {}).get("code") == "context_length_exceeded"
            self.refusals.append(time.perf_counter() - t0)
            self.record(kind, "refused" if refused else f"HTTP {r.status_code}", "" if refused else r.text[:200])
        elif kind == "invalid":
            path, raw = self.rng.choice(INVALID)
            r = await c.post(f"{self.url}{path}", content=raw, headers={"content-type": "application/json"})
            good = 400 <= r.status_code < 500 and set(r.json().get("error", {})) >= {"message", "type", "code"}
            self.record(kind, "4xx" if good else f"HTTP {r.status_code}", "" if good else r.text[:200])
        else:  # a stream dropped after a few events
            async with c.stream("POST", f"{self.url}/v1/chat/completions", json=self.body(prompt, stream=True)) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
            self.record(kind, "dropped" if r.status_code == 200 else f"HTTP {r.status_code}")

    async def client(self, deadline: float) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        async with httpx.AsyncClient(timeout=self.timeout) as c:
            while time.monotonic() < deadline:
                kind = self.rng.choices(kinds, weights)[0]
                try:
                    await self.one(c, kind)
                except httpx.HTTPError as e:
                    self.record(kind, "lost", f"{type(e).__name__}: {e}")

    async def slow_loris(self, deadline: float) -> None:
        """One socket at a time that sends a request head one byte every 2 s, until the server closes it."""
        host, port = self.url.split("//")[1].rsplit(":", 1)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        while time.monotonic() < deadline:
            reader, writer = await asyncio.open_connection(host, int(port))
            self.loris["opened"] += 1
            try:
                for byte in head * 100:
                    if time.monotonic() >= deadline or reader.at_eof():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(2)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(reader.read(65536), 0.01)
            except (ConnectionError, OSError):
                pass
            self.loris["closed by the server"] += reader.at_eof()
            writer.close()

    async def run(self, clients: int, duration: float, pid: int | None, slow_loris: int = 0) -> list[tuple[float, int]]:
        """The load, with (seconds, RSS bytes) every 10 s while it lasts (empty without a server pid)."""
        async with httpx.AsyncClient(timeout=self.timeout) as c:
            for prompt in PROMPTS:  # alone: the references
                text, problem = await self.answer(c, self.body(prompt))
                if text is None:
                    raise RuntimeError(f"the reference request failed: {problem}")
                self.reference[prompt] = text
        t0 = time.monotonic()
        rss: list[tuple[float, int]] = []

        async def sample_rss() -> None:
            while pid is not None:
                rss.append((round(time.monotonic() - t0, 1), rss_bytes(pid)))
                await asyncio.sleep(10)

        sampler = asyncio.ensure_future(sample_rss())
        loris = [asyncio.ensure_future(self.slow_loris(t0 + duration)) for _ in range(slow_loris)]
        await asyncio.gather(*(self.client(t0 + duration) for _ in range(clients)), *loris)
        sampler.cancel()
        if pid is not None:
            rss.append((round(time.monotonic() - t0, 1), rss_bytes(pid)))
        return rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--duration", type=float, default=180, help="seconds of load")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-loris", type=int, default=0, help="sockets dribbling request heads beside the load")
    ap.add_argument("--defaults", action="store_true",
                    help="start the server with serve's defaults (auto speculation, the model's context, "
                         "--max-num-seqs 8) instead of n-gram speculation at --max-model-len 1024")
    args = ap.parse_args()
    proc, url = None, args.url
    if url is None:
        log_dir = tempfile.mkdtemp(prefix="specdec-soak-")
        print(f"server log in {log_dir}", flush=True)
        serve_args = ["--max-num-seqs", "8"] + ([] if args.defaults else [
            "--max-model-len", "1024", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
        proc, url = start_server(serve_args, log_dir, model=args.model)
    soak = Soak(url, args.model, args.max_tokens, args.timeout, args.seed)
    try:
        rss = asyncio.run(soak.run(args.clients, args.duration, proc.pid if proc else None, args.slow_loris))
        health = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        by_kind[kind][outcome] = n
    print(f"{'kind':14} outcomes")
    for kind, outcomes in by_kind.items():
        print(f"{kind:14} " + ", ".join(f"{outcome} {n}" for outcome, n in outcomes.items()))
    for (kind, outcome), detail in soak.examples.items():
        print(f"  e.g. {kind} / {outcome}: {detail}")
    lat = sorted(soak.latency)
    p = lambda q: round(lat[min(len(lat) - 1, int(q * (len(lat) - 1)))], 2) if lat else None  # noqa: E731
    lost = sum(n for (_, outcome), n in soak.outcomes.items() if outcome == "lost")
    corrupted = sum(n for (_, outcome), n in soak.outcomes.items() if outcome == "corrupted")
    server_errors = sum(n for (_, outcome), n in soak.outcomes.items() if outcome.startswith("HTTP 5"))
    mib = [round(b / 2**20) for _, b in rss]
    print(f"served {sum(soak.outcomes.values())} requests in {args.duration:g} s with {args.clients} clients; "
          f"lost {lost}, corrupted {corrupted}, 5xx {server_errors}; greedy latency p50 {p(0.5)} s, p99 {p(0.99)} s; "
          f"engine-wide failures {soak.engine_wide}; RSS MiB {mib[0] if mib else '-'} -> {mib[-1] if mib else '-'}; "
          f"/health {health}")
    refusals = sorted(soak.refusals)
    print(f"tokenize flood: {len(refusals)} calls, refused in {refusals[len(refusals) // 2]:.3f} s median, "
          f"{refusals[-1]:.3f} s max" if refusals else "tokenize flood: none")
    print(f"slow loris: {dict(soak.loris)}")
    print(json.dumps({"benchmark": "soak", "model": args.model, "duration_s": args.duration, "clients": args.clients,
                      "max_tokens": args.max_tokens, "requests": sum(soak.outcomes.values()), "by_kind": by_kind,
                      "lost": lost, "corrupted": corrupted, "server_errors": server_errors,
                      "engine_wide_failures": soak.engine_wide, "latency_p50_s": p(0.5), "latency_p99_s": p(0.99),
                      "latency_mean_s": round(statistics.fmean(lat), 2) if lat else None,
                      "rss_mib": mib, "health_after": health, "slow_loris": dict(soak.loris),
                      "tokenize_refusal_s": {"median": round(refusals[len(refusals) // 2], 3),
                                             "max": round(refusals[-1], 3)} if refusals else None}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
