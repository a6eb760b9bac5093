"""Real coding agents on a multi-step task (`specdec.bench.agent_task`): Claude Code and Codex, each in a new
scratch git repository, asked to create greet.py, run it and fix the bug that fails a test, against
`specdec serve` and against llama.cpp's `llama-server --jinja` on the same GGUF. Reports per client and
server: success (checked here: greet.py prints hello, pytest passes, the test file untouched), turns, the
model requests the server answered, and wall time.

    .venv/bin/python benchmarks/bench_agent_task.py [--clients claude,codex] [--servers specdec,llama.cpp]
        [--cap-s 1200] [--max-turns 12] [--llama-server PATH]

Servers, one at a time (each started, used by every client in turn, stopped; 2 threads for llama.cpp):
    specdec    specdec serve TARGET --max-model-len 32768 --override-generation-config '{"temperature": 0}'
               (auto speculation, its defaults otherwise)
    llama.cpp  llama-server -m TARGET.gguf --jinja -c 32768 -np 1 -t 2 --temp 0 --metrics
The context fits Claude Code's ~21k-token system prompt and tools. Temperature 0 on both sides: Codex sends
none (the servers' default applies: pinned above), Claude Code sends 1 unless told otherwise, and its
CLAUDE_CODE_EXTRA_BODY='{"temperature": 0}' overrides that (the extra body is merged last).

Clients (configuration in temporary folders, never the user's; tools allowed without asking, which is why
each runs in a scratch repository):
    claude  claude -p TASK --output-format json --dangerously-skip-permissions --max-turns N
    codex   codex exec --json --dangerously-bypass-approvals-and-sandbox -C REPO TASK
            (a provider at the server's /v1 with wire_api = "responses", model_context_window = 32768)
A run that passes --cap-s is killed (its process group) and checked as it stands. Needs Node, `claude`
and `codex` on PATH. Prints a table, then one JSON line. Minutes per run on a small CPU: a prompt of 6k
(Codex) to 21k (Claude Code) tokens is read first.
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

from load_test import free_port, launch
from specdec.bench.agent_task import (INSTRUCTION, ClientReport, Run, check_repo, claude_report, codex_report,
                                      llama_requests, make_repo, specdec_requests, summary, table)

TARGET = "qwen2.5-coder-1.5b-instruct"
CONTEXT = 32768
ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT.parent / "shared" / "tools" / "llama.cpp-avx2" / "llama-server"
ROUTES = {"claude": "/v1/messages", "codex": "/v1/responses"}
LONG_MS = str(3_600_000)  # the clients' stream and request timeouts: a 21k-token prefill on 2 cores is minutes


def server_command(server: str, port: int, llama_server: Path) -> list[str]:
    if server == "llama.cpp":
        from specdec.models.store import resolve_model

        return [str(llama_server), "-m", str(resolve_model(TARGET)), "--jinja", "-c", str(CONTEXT), "-np", "1",
                "-t", "2", "--temp", "0", "--metrics", "--host", "127.0.0.1", "--port", str(port)]
    return [sys.executable, "-m", "specdec", "serve", TARGET, "--max-model-len", str(CONTEXT),
            "--override-generation-config", json.dumps({"temperature": 0}), "--port", str(port)]


def client_command(client: str, url: str, repo: Path, home: Path, max_turns: int) -> tuple[list[str], dict]:
    """The client's command line and environment, its configuration under `home`."""
    if client == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": TARGET,
               "CLAUDE_CONFIG_DIR": str(home / "claude"), "DISABLE_AUTOUPDATER": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": LONG_MS,
               "API_TIMEOUT_MS": LONG_MS, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096",
               "CLAUDE_CODE_EXTRA_BODY": json.dumps({"temperature": 0}),
               "IS_SANDBOX": "1"}  # --dangerously-skip-permissions refuses root otherwise
        return [shutil.which("claude"), "-p", INSTRUCTION, "--output-format", "json",
                "--dangerously-skip-permissions", "--max-turns", str(max_turns)], env
    codex_home = home / "codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{TARGET}"\nmodel_provider = "bench"\nmodel_context_window = {CONTEXT}\n\n'
        f'[model_providers.bench]\nname = "bench"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        f'stream_idle_timeout_ms = {LONG_MS}\n')
    return [shutil.which("codex"), "exec", "--json", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", "-C", str(repo), INSTRUCTION], {"CODEX_HOME": str(codex_home)}


def run_client(cmd: list[str], env: dict, cwd: Path, cap_s: float, log: Path) -> tuple[str, int, float, bool]:
    """(stdout, exit code, wall seconds, timed out); the client's stderr to `log`. On the cap its whole
    process group (the client and the commands it runs) is killed."""
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=cwd, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=cap_s)
            return out, proc.returncode, time.perf_counter() - t0, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return out, -9, time.perf_counter() - t0, True


def requests_answered(server: str, url: str, log: Path, route: str) -> int:
    if server == "llama.cpp":
        return llama_requests(log.read_text(errors="replace"))
    return specdec_requests(httpx.get(url + "/metrics", timeout=30).text, route)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 120 s: llama-server finishes the prompt batch it is reading first, which
    takes minutes on a loaded machine."""
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="claude,codex")
    ap.add_argument("--servers", default="specdec,llama.cpp")
    ap.add_argument("--cap-s", type=float, default=1200, help="wall-time cap per run, seconds")
    ap.add_argument("--max-turns", type=int, default=12, help="Claude Code's --max-turns (Codex has none)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    args = ap.parse_args()
    clients, servers = args.clients.split(","), args.servers.split(",")
    if set(clients) - set(ROUTES) or set(servers) - {"specdec", "llama.cpp"}:
        raise SystemExit("clients: claude, codex; servers: specdec, llama.cpp")
    for client in clients:
        if shutil.which(client) is None:
            raise SystemExit(f"`{client}` is not on PATH: npm i -g @anthropic-ai/claude-code @openai/codex")
    if "llama.cpp" in servers:  # the AVX2 build's shared libraries sit beside it
        os.environ["LD_LIBRARY_PATH"] = f"{args.llama_server.parent / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    work = Path(tempfile.mkdtemp(prefix="bench-agent-task-"))
    runs: list[Run] = []
    for server in servers:
        port = free_port()
        proc = launch(server_command(server, port, args.llama_server), port, str(work))
        url, server_log = f"http://127.0.0.1:{port}", work / f"server-{port}.log"
        try:  # one-time costs (pages of the weights, buffers): not measured
            httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "model": TARGET, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
            for client in clients:
                name = f"{client}-{server}"
                repo = make_repo(work / name / "repo")
                cmd, env = client_command(client, url, repo, work / name, args.max_turns)
                before = requests_answered(server, url, server_log, ROUTES[client])
                print(f"{name}: running (cap {args.cap_s:.0f} s) in {repo}", file=sys.stderr, flush=True)
                out, rc, wall, timed_out = run_client(cmd, env, repo, args.cap_s, work / name / "client.log")
                (work / name / "client.out").write_text(out)
                report: ClientReport = (claude_report if client == "claude" else codex_report)(out, rc)
                requests = requests_answered(server, url, server_log, ROUTES[client]) - before
                runs.append(Run(client, server, check_repo(repo), report, requests, wall, timed_out))
                print(f"{name}: success={runs[-1].outcome.success} {wall:.0f} s, {report.message[:200]!r}",
                      file=sys.stderr, flush=True)
        finally:
            stop(proc)
    print("\n".join(table(runs)))
    print(json.dumps({"benchmark": "agent_task", "target": TARGET, "work": str(work), "runs": summary(runs)}))


if __name__ == "__main__":
    main()
