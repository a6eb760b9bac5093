"""Claude Code's one-shot (`claude -p`) through `specdec serve`, before and after a restart of the server: with
the prefix cache's disk tier, the restarted server reads the agent's long system prompt and tool list back
from disk instead of computing them.

    .venv/bin/python benchmarks/bench_restart_agent.py [--prompt "Say hello in three words."]

Needs Node and `claude` on PATH (`npm i -g @anthropic-ai/claude-code`). Starts `specdec serve` (its defaults:
the default target, auto speculation, the model's whole context) with a new disk-tier folder, runs `claude -p`,
stops the server (SIGTERM), starts it again on the same folder and runs `claude -p` again. Prints each call's
wall time, the prompt tokens the server read and found cached (from /metrics), and whether the answers are
equal (Claude Code sends its own temperature, so they may differ); then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kv: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port),
                                 "--prefix-cache-dir", str(kv)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("specdec serve did not come up")
        time.sleep(1)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("specdec:prompt_tokens_total", "specdec:prefix_cache_hits_total",
                          "specdec:prefix_cache_disk_hits_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def claude(url: str, prompt: str, home: Path) -> tuple[float, str, int]:
    env = {**os.environ, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
           "CLAUDE_CONFIG_DIR": str(home / "claude"), "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(3_600_000)}
    work = home / "work"
    work.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    done = subprocess.run([shutil.which("claude"), "-p", prompt], env=env, cwd=work, capture_output=True, text=True,
                          timeout=3600, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t0, done.stdout.strip(), done.returncode


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default="Say hello in three words.")
    args = ap.parse_args()
    if shutil.which("claude") is None:
        sys.exit("claude is not on PATH: npm i -g @anthropic-ai/claude-code")
    home = Path(tempfile.mkdtemp(prefix="specdec-restart-agent-"))
    kv, log = home / "kv", home / "serve.log"
    rows = []
    for label in ("first start", "after a restart"):
        t0 = time.perf_counter()
        proc, url = start(kv, log)
        up = time.perf_counter() - t0
        try:
            seconds, answer, rc = claude(url, args.prompt, home)
            c = counters(url)
        finally:
            stop(proc)
        rows.append({"run": label, "start_s": round(up, 1), "claude_s": round(seconds, 1), "rc": rc, "answer": answer,
                     "prompt_tokens": c.get("specdec:prompt_tokens_total", 0),
                     "cached": c.get("specdec:prefix_cache_hits_total", 0),
                     "from_disk": c.get("specdec:prefix_cache_disk_hits_total", 0)})
        print(f"{label}: server up in {up:.1f} s, claude -p {seconds:.1f} s (exit {rc})", flush=True)
    print(f"\nserver log: {log}")
    print("\n| run | server start, s | claude -p, s | prompt tokens read | cached (from disk) | answer |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['start_s']} | {r['claude_s']} | {r['prompt_tokens']:.0f} | {r['cached']:.0f} "
              f"({r['from_disk']:.0f}) | {r['answer'][:60]!r} |")
    print(json.dumps({"first_s": rows[0]["claude_s"], "restarted_s": rows[1]["claude_s"],
                      "restart_vs_first": round(rows[1]["claude_s"] / rows[0]["claude_s"], 4),
                      "prompt_tokens": [r["prompt_tokens"] for r in rows], "cached": [r["cached"] for r in rows],
                      "from_disk": [r["from_disk"] for r in rows], "same_answer": rows[0]["answer"] == rows[1]["answer"],
                      "exit_codes": [r["rc"] for r in rows]}))


if __name__ == "__main__":
    main()
