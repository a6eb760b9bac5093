"""Claude Code's one-shot (`claude -p`) through `specdec serve`, before and after a restart of the server: with
the prefix cache's disk tier, the restarted server reads the agent's long system prompt and tool list back
from disk instead of computing them.

    .venv/bin/python benchmarks/bench_restart_agent.py [--prompt "Say hello in three words."] [--home DIR]

Needs Node and `claude` on PATH (`npm i -g @anthropic-ai/claude-code`). Starts `specdec serve` (its defaults:
the default target, auto speculation, the model's whole context) with a new disk-tier folder, runs `claude -p`,
stops the server (SIGTERM), starts it again on the same folder and runs `claude -p` again. Prints each call's
wall time, the prompt tokens the server read and found cached (from /metrics), and whether the answers are
equal (Claude Code sends its own temperature, so they may differ); then one JSON line.

`--home DIR` keeps the run's folder (the disk tier in DIR/kv, Claude Code's config and working directory) at
DIR; where DIR/kv already holds blocks, the first start (the cold pass: ~485 s of two cores) is skipped and only
the restart is run, on those blocks. Claude Code's prompt holds its working directory and the date, so a
folder is reused on the same path, its Claude Code state is put back as the first run left it (its prompt
changes with that state), and `--tz` (a TZ for Claude Code, e.g. Etc/GMT+12) keeps the date the one the blocks
were written on. The server's per-request timings (`serve --log-requests`) are in DIR/serve.log.
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


def start(kv: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port),
                                 "--prefix-cache-dir", str(kv), *extra], stdout=out, stderr=subprocess.STDOUT)
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


def claude(url: str, prompt: str, home: Path, tz: str | None) -> tuple[float, str, int]:
    env = {**os.environ, **({"TZ": tz} if tz else {}), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
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
    ap.add_argument("--home", type=Path, default=None,
                    help="the run's folder, kept; where its kv/ holds blocks, only the restart is run")
    ap.add_argument("--tz", default=None, help="TZ for Claude Code (its prompt holds the date)")
    ap.add_argument("--serve-args", default="--log-requests",
                    help="flags for specdec serve, in one string (default: its per-request timings in the log)")
    args = ap.parse_args()
    if shutil.which("claude") is None:
        sys.exit("claude is not on PATH: npm i -g @anthropic-ai/claude-code")
    home = args.home.resolve() if args.home else Path(tempfile.mkdtemp(prefix="specdec-restart-agent-"))
    home.mkdir(parents=True, exist_ok=True)
    kv, log = home / "kv", home / "serve.log"
    warm = kv.is_dir() and any(f.is_file() and not f.name.startswith(".") for f in kv.rglob("*"))
    labels = ("after a restart",) if warm else ("first start", "after a restart")
    if warm:
        print(f"{kv} holds blocks: the first start is skipped", flush=True)
    state, kept = home / "claude", home / "claude.after-first"
    if warm and kept.is_dir():  # Claude Code's state as the cold run left it: its prompt as the restart's was
        shutil.rmtree(state, ignore_errors=True)
        shutil.copytree(kept, state)
    rows = []
    for label in labels:
        if label == "after a restart" and not warm and state.is_dir():
            shutil.copytree(state, kept, dirs_exist_ok=True)
        t0 = time.perf_counter()
        proc, url = start(kv, log, args.serve_args.split())
        up = time.perf_counter() - t0
        try:
            seconds, answer, rc = claude(url, args.prompt, home, args.tz)
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
    first, restarted = (rows[0] if len(rows) > 1 else None), rows[-1]
    print(json.dumps({"first_s": first and first["claude_s"], "restarted_s": restarted["claude_s"],
                      "restart_vs_first": first and round(restarted["claude_s"] / first["claude_s"], 4),
                      "prompt_tokens": [r["prompt_tokens"] for r in rows], "cached": [r["cached"] for r in rows],
                      "from_disk": [r["from_disk"] for r in rows], "same_answer": first and first["answer"] == restarted["answer"],
                      "exit_codes": [r["rc"] for r in rows]}))


if __name__ == "__main__":
    main()
