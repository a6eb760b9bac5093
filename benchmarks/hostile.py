"""Hostile clients against a real `specdec serve` with its defaults (issue 36's goals, measured):

    .venv/bin/python benchmarks/hostile.py [--model qwen2.5-coder-1.5b-instruct] [--trials 10]

1. Idle sockets: 300 sockets that send nothing, kept open for `--idle-s` seconds (reopened as the server's
   headers deadline closes them); meanwhile `/health` and a short greedy chat request every few seconds.
   Goal: each answers in under 1 s (the chat request: its time to first token).
2. A tokenize flood: 8 concurrent 3 MB `/tokenize` calls (English prose), beside one greedy stream
   (`--flood-rounds` times). Goal: each refused (400, context_length_exceeded) in under 0.1 s; the stream's
   text and time as without it.
3. The secret-confirmation probe through suffix drafts: a victim without a `cache_salt` has the model write
   a note holding a sentence with a secret; the prober, also unsalted, asks the model to repeat that
   sentence with the right secret or a wrong one (its prompt shares no prefix with the victim's but the
   chat template's system turn, so that the prefix cache, the other side channel, is not what is measured), and reads its own response's `specdec` field (target passes, accepted draft
   tokens) and its time. `--trials` victims with fresh secrets, one right and one wrong guess each. Run
   against the defaults (unsalted requests draft from their own prompt and output only), then, as the
   control that shows the probe would see a leak, against `--shared-suffix-cache`. Goal: with the defaults,
   right and wrong guesses alike.

Prints a table per part, then one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import socket
import statistics
import string
import tempfile
import threading
import time

import httpx

from load_test import start_server

PROSE = ("The quick brown fox jumps over the lazy dog while the committee reviews its annual budget and "
         "the weather turns colder in the northern valleys. ")
MODEL = [""]  # the served model's name (main sets it)
SENTENCE = "The deployment password for the billing cluster is {secret}, keep it safe."


def chat(url: str, content: str, max_tokens: int = 48, stream: bool = False, **extra) -> dict:
    body = {"model": MODEL[0], "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": stream, **extra}
    t0 = time.monotonic()
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        out = r.json()
        return {"text": out["choices"][0]["message"]["content"], "specdec": out.get("specdec") or {},
                "seconds": time.monotonic() - t0}
    text, first = "", None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
                if delta and first is None:
                    first = time.monotonic() - t0
                text += delta
    return {"text": text, "first": first, "seconds": time.monotonic() - t0}


def _hold(port: int, count: int, stop, opened) -> None:
    """Keep `count` silent sockets open to `port` (reopening those the server closes) until `stop` is set."""
    socks: list[socket.socket] = []
    while not stop.is_set():
        socks = [s for s in socks if s.fileno() != -1 and not _closed(s)]
        while len(socks) < count and not stop.is_set():
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            with opened.get_lock():
                opened.value += 1
        time.sleep(0.2)
    for s in socks:
        s.close()


def idle_sockets(url: str, port: int, count: int, seconds: float) -> dict:
    """Hold `count` silent sockets for `seconds` while timing /health and a short chat's first token. The
    sockets are held by another process, so that the timed client does not wait on its work (the GIL)."""
    stop, opened = multiprocessing.Event(), multiprocessing.Value("i", 0)

    def check(seconds: float) -> tuple[list[float], list[float]]:
        health, first_token = [], []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            health.append(time.monotonic() - t0)
            first_token.append(chat(url, "Say hi.", max_tokens=4, stream=True)["first"])
            time.sleep(3)
        return health, first_token

    check(1)  # warm: the first request pays for what is built once
    _, alone = check(15)
    holder = multiprocessing.Process(target=_hold, args=(port, count, stop, opened))
    holder.start()
    time.sleep(2)
    health, first_token = check(seconds)
    stop.set()
    holder.join()
    return {"sockets": count, "seconds": seconds, "sockets_opened": opened.value, "checks": len(health),
            "health_max_s": round(max(health), 3), "chat_first_token_s": [round(t, 3) for t in first_token],
            "chat_first_token_alone_s": [round(t, 3) for t in alone]}


def _closed(s: socket.socket) -> bool:
    """Whether the server has closed `s` (a read that would not block returns b"")."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def tokenize_flood(url: str, calls: int = 8, size: int = 3_000_000, rounds: int = 1) -> dict:
    """`rounds` times: `calls` concurrent `size`-byte /tokenize calls beside one greedy stream; and that
    stream alone, once. Each round's refusal times sorted, its stream's text compared with the one alone."""
    body = json.dumps({"prompt": (PROSE * (size // len(PROSE) + 1))[:size]}).encode()
    prompt = "Write a Python function that checks whether a number is prime."
    alone = chat(url, prompt, stream=True)
    results = [_flood_round(url, body, prompt, calls) for _ in range(rounds)]
    slowest = [r["refusal_s"][-1] for r in results]
    return {"calls": calls, "bytes": size, "rounds": rounds,
            "refused": sum(r["refused"] for r in results), "refusal_s": [r["refusal_s"] for r in results],
            "slowest_per_round": slowest, "rounds_all_under_0.1_s": sum(s < 0.1 for s in slowest),
            "stream_same_text": all(r["text"] == alone["text"] for r in results),
            "stream_s_alone": round(alone["seconds"], 2),
            "stream_s_beside": [round(r["seconds"], 2) for r in results]}


def _flood_round(url: str, body: bytes, prompt: str, calls: int) -> dict:
    answers: list[tuple[float, int, str]] = []

    def one(client: http.client.HTTPConnection) -> None:
        # the request only: each connection is open beforehand, and the standard library's client sends the
        # body with one sendall (the GIL released), where httpx's 8 threads in this process pushing 3 MB each
        # through h11 took the 2 cores from the server they time: 0.07-0.18 s against 0.03-0.10 s so
        t0 = time.monotonic()
        client.request("POST", "/tokenize", body=body, headers={"content-type": "application/json"})
        r = client.getresponse()
        answer = json.loads(r.read())
        answers.append((time.monotonic() - t0, r.status, answer.get("error", {}).get("code", "")))

    host, port = url.removeprefix("http://").rsplit(":", 1)
    clients = [http.client.HTTPConnection(host, int(port), timeout=60) for _ in range(calls)]
    for client in clients:
        client.connect()
    flood = [threading.Thread(target=one, args=(client,)) for client in clients]
    beside: dict = {}
    streamer = threading.Thread(target=lambda: beside.update(chat(url, prompt, stream=True)))
    streamer.start()
    time.sleep(0.5)  # the stream is under way when the flood comes
    for t in flood:
        t.start()
    for t in [*flood, streamer]:
        t.join()
    for client in clients:
        client.close()
    return {"refused": sum(s == 400 and c == "context_length_exceeded" for _, s, c in answers),
            "refusal_s": sorted(round(t, 3) for t, _, _ in answers), "text": beside["text"],
            "seconds": beside["seconds"]}


def secret_probe(url: str, trials: int, seed: int, victim: str = "note") -> dict:
    """Per trial: a victim's repetition with a fresh secret, then the prober's right and wrong guesses."""
    rng = random.Random(seed)
    secret = lambda: "".join(rng.choices(string.ascii_uppercase + string.digits, k=10))  # noqa: E731
    # the victim's prompt and the prober's differ from their first word, so that the prefix cache (the other
    # side channel, open by default as in vLLM: `--prefix-caching-isolation salt` closes it) shares only the
    # chat template's system turn with either guess; what the prober could learn is the victim's output
    ask = "Repeat this sentence exactly, three times, one per line: {}"
    note = ask if victim == "repeat" else \
        "Write a short note for the operations team. It must contain this sentence word for word: {}"
    rows = {"right": [], "wrong": []}
    for trial in range(trials):
        truth = secret()
        chat(url, note.format(SENTENCE.format(secret=truth)), max_tokens=96)
        guesses = [("right", truth), ("wrong", secret())]
        for kind, guess in guesses if trial % 2 == 0 else guesses[::-1]:  # neither always goes first
            out = chat(url, ask.format(SENTENCE.format(secret=guess)), max_tokens=96)
            spec = out["specdec"]  # the response's own speculative statistics
            rows[kind].append((spec["target_passes"], spec["num_accepted_tokens"], out["seconds"]))
    summary = {}
    for kind, got in rows.items():
        passes, accepted, seconds = zip(*got)
        summary[kind] = {"passes": list(passes), "accepted": list(accepted),
                         "seconds": [round(s, 2) for s in seconds],
                         "mean_passes": round(statistics.mean(passes), 2),
                         "mean_accepted": round(statistics.mean(accepted), 2),
                         "mean_s": round(statistics.mean(seconds), 2),
                         "median_s": round(statistics.median(seconds), 2)}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--idle-s", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="idle,flood,probe", help="which parts to run")
    ap.add_argument("--flood-rounds", type=int, default=1, help="rounds of the tokenize flood, each beside a stream")
    ap.add_argument("--victim", choices=("note", "repeat"), default="note",
                    help="the victim's request: a note holding the sentence (no prompt prefix shared with the "
                         "prober's), or the very repetition the prober asks for (the same prompt: the prefix "
                         "cache's channel adds to the time, not to the passes)")
    ap.add_argument("--serve-args", default="", help="more `specdec serve` arguments for both servers, e.g. "
                    "--prefix-caching-isolation salt (with --victim repeat: the probe then sees the suffix channel only)")
    args = ap.parse_args()
    MODEL[0] = args.model
    log_dir = tempfile.mkdtemp(prefix="specdec-hostile-")
    print(f"server logs in {log_dir}", flush=True)
    result: dict = {}
    for name, serve_args in (("defaults", []), ("shared-suffix-cache", ["--shared-suffix-cache"])):
        proc, url = start_server(serve_args + args.serve_args.split(), log_dir, model=args.model)
        try:
            if name == "defaults" and "idle" in args.parts:
                result["idle"] = idle_sockets(url, int(url.rsplit(":", 1)[1]), 300, args.idle_s)
                print("idle sockets:", result["idle"], flush=True)
            if name == "defaults" and "flood" in args.parts:
                result["flood"] = tokenize_flood(url, rounds=args.flood_rounds)
                print("tokenize flood:", result["flood"], flush=True)
            if "probe" in args.parts:
                result[f"probe {name}"] = secret_probe(url, args.trials, args.seed, args.victim)
                print(f"probe {name}:", result[f"probe {name}"], flush=True)
            else:
                break
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    print(f"\n{'secret probe':28} {'guess':6} {'passes':>7} {'accepted':>9} {'mean s':>7} {'median s':>9}")
    for name in ("defaults", "shared-suffix-cache") if "probe" in args.parts else ():
        for kind, row in result[f"probe {name}"].items():
            print(f"{name:28} {kind:6} {row['mean_passes']:7} {row['mean_accepted']:9} {row['mean_s']:7} {row['median_s']:9}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
