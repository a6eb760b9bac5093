"""Where a coding agent's per-session text (its working directory, the date, git status, the first prompt...)
falls in the prompt that `specdec serve` renders from its requests: the prefix cache shares a prompt's tokens
across sessions only up to the first token that differs, so everything after it is computed again by another
session. Results and what they mean: docs/benchmarks.md, "Per-session text in agents' prompts".

    .venv/bin/python benchmarks/bench_session_prefix.py [--clients claude,codex] [--prompt "say hi"] [--save DIR]
    .venv/bin/python benchmarks/bench_session_prefix.py --replay DIR   # re-render requests saved by --save

No model runs: each agent is pointed at `specdec serve`'s own app over a fake engine whose tokenizer is the
default target's (Qwen2.5-Coder-1.5B-Instruct's GGUF, which must be pulled: `specdec models pull
qwen2.5-coder-1.5b-instruct`; only its tokenizer is read) and which first calls the agent's shell tool (`echo
hi`), then answers "hi" (`--no-tool-turn`: at once), so a one-shot sends two requests. The app logs every request
body. Each agent runs its one-shot in six sessions, in this order:

    A       `--prompt` in <tmp>/alpha-project (a git repo with one commit)
    A'      the same again (a new process: a retry, or the same after a server restart)
    A+day   the same with TZ set to a time zone whose date today is another (UTC+14 or UTC-12)
    A+task  `--other-prompt` there
    A+edit  `--prompt` there after an untracked file appears
    B       `--prompt` in <tmp>/beta-service, a git repo equal to A's (same files, commit and hash) but for its name

Clients (`--clients`): Claude Code (`claude -p`, the Messages API; its configuration in a temporary
CLAUDE_CONFIG_DIR shared by the sessions) and Codex (`codex exec`, the Responses API; a temporary CODEX_HOME with a
provider pointing here), and Claude Code with settings that take per-session text out (see CLIENTS). An agent
that is not on PATH is skipped, saying so. Each request is rendered into prompt ids as the server does
(`/v1/messages` -> `MessagesRequest.to_chat`, `/v1/responses` -> `ResponsesRequest.to_chat`, then
`chat_prompt_ids` with the chat template), checked equal to the ids the fake engine received, and compared:
request i of A with request i of each other session (the first token index where they differ, the text there),
and each request of A with the one before it. Across sessions the prefix cache reuses whole 16-token blocks, so
the share in brackets is the first differing index rounded down to a block, over the prompt's length. Prints a
table (with where today's date first appears in each prompt), the text at each difference, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

TARGET = "qwen2.5-coder-1.5b-instruct"
MODEL = "qwen2.5-coder-1.5b-instruct"  # the name the agents ask for (any name is served)
ANSWER = "hi"
BLOCK = 16  # specdec.engine.prefix_cache.BLOCK_SIZE


# ---- a fake engine with the real tokenizer -------------------------------------------------------------------


class RecordingEngine:
    """The engine interface `AsyncEngine` drives (add_request / abort_request / has_unfinished_requests /
    num_queued / step), answering in one step: with a `tool_call` set, a prompt without a tool's result yet
    gets that call (as Qwen2.5's template writes one), every other prompt `ANSWER`; then EOS. `prompts` keeps
    every prompt's ids."""

    def __init__(self, tokenizer, max_model_len: int = 1 << 20):
        from specdec.engine.metrics import SpecMetrics

        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, tokenizer.vocab_size, max_model_len
        self.metrics = SpecMetrics()
        self.answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
        self.tool_call: dict | None = None
        self.waiting: deque = deque()
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None) -> None:
        from specdec.engine.metrics import SpecMetrics
        from specdec.engine.output_text import OutputText

        answer = self.answer
        if self.tool_call is not None and "<tool_response>" not in self.tokenizer.decode(prompt_token_ids):
            call = f"<tool_call>\n{json.dumps(self.tool_call)}\n</tool_call>"
            answer = self.tokenizer.encode(call, add_special_tokens=False) + [self.tokenizer.eos_token_ids[0]]
        with self.lock:
            self.prompts.append(list(prompt_token_ids))
            self.waiting.append(dict(id=request_id, prompt=list(prompt_token_ids), aborted=False, answer=answer,
                                     output=OutputText(self.tokenizer, params, self.tokenizer.eos_token_ids),
                                     metrics=SpecMetrics(prompt_tokens=len(prompt_token_ids))))

    def abort_request(self, request_id) -> None:
        with self.lock:
            for seq in self.waiting:
                if seq["id"] == request_id:
                    seq["aborted"] = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def num_queued(self) -> int:
        return 0

    def step(self) -> list:
        from specdec.engine.outputs import RequestOutput

        outputs = []
        with self.lock:
            while self.waiting:
                seq = self.waiting.popleft()
                output = seq["output"]
                if seq["aborted"]:
                    output.abort()
                    new = []
                else:
                    new = output.append(seq["answer"][: output.params.max_tokens])
                    seq["metrics"].record_step(0, 0, len(new))
                    self.metrics.merge(seq["metrics"])
                outputs.append(RequestOutput(request_id=seq["id"], prompt_token_ids=seq["prompt"], new_token_ids=new,
                                             new_text=output.new_text(), token_ids=new, text=output.text,
                                             finished=True, finish_reason=output.finish_reason or "length",
                                             stop_reason=output.stop_reason, metrics=seq["metrics"]))
        return outputs


class BodyLog:
    """ASGI middleware: keeps (path, body, headers) of every POST, passing the body on unchanged."""

    def __init__(self, app):
        self.app, self.requests = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        messages, body, more = [], b"", True
        while more:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            more = message.get("more_body", False) and message["type"] == "http.request"
        self.requests.append((scope["path"], body, {k.decode(): v.decode() for k, v in scope["headers"]}))
        pending = iter(messages)

        async def replay():
            return next(pending, None) or await receive()

        return await self.app(scope, replay, send)


class FakeServer:
    """`specdec serve`'s app over `RecordingEngine`, under uvicorn in a thread on a free local port."""

    def __init__(self, tokenizer):
        import socket

        import uvicorn

        from specdec.server.app import build_app
        from specdec.server.async_engine import AsyncEngine
        from specdec.server.limits import uvicorn_config

        self.engine = RecordingEngine(tokenizer)
        self.log = BodyLog(build_app(AsyncEngine(self.engine), MODEL))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn_config(self.log, "127.0.0.1", port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# ---- the agents ----------------------------------------------------------------------------------------------


def git_repo(path: Path) -> Path:
    """A git repo with one file and one commit, byte for byte the same whatever the folder's name."""
    path.mkdir(parents=True)
    (path / "README.md").write_text("# demo\n\nA small project.\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "Dev", "GIT_AUTHOR_EMAIL": "dev@example.com",
           "GIT_COMMITTER_NAME": "Dev", "GIT_COMMITTER_EMAIL": "dev@example.com",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    for command in (["init", "-q", "-b", "main"], ["add", "README.md"], ["commit", "-q", "-m", "Initial commit"]):
        subprocess.run(["git", *command], cwd=path, env=env, check=True, capture_output=True)
    return path


def other_day_tz() -> str:
    """A time zone whose date today is not this machine's (UTC+14 and UTC-12 are 26 hours apart: one differs)."""
    from zoneinfo import ZoneInfo

    today = datetime.date.today()
    return next(tz for tz in ("Etc/GMT-14", "Etc/GMT+12") if datetime.datetime.now(ZoneInfo(tz)).date() != today)


def run_claude(url: str, prompt: str, home: Path, work: Path, env: dict, flags: list[str]
               ) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": MODEL,
           "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "CLAUDE_CONFIG_DIR": str(home / "config"), "DISABLE_AUTOUPDATER": "1",
           **env}
    return subprocess.run([shutil.which("claude"), *flags, "--allowedTools", "Bash(echo:*)", "-p", prompt], env=env,
                          cwd=work, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def run_codex(url: str, prompt: str, home: Path, work: Path, env: dict, flags: list[str]
              ) -> subprocess.CompletedProcess:
    codex_home = home / "config"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "specdec"\n\n[model_providers.specdec]\nname = "specdec"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    return subprocess.run([shutil.which("codex"), "exec", *flags, prompt], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "CODEX_HOME": str(codex_home), **env}, timeout=300,
                          stdin=subprocess.DEVNULL)


CLAUDE_BASH = {"name": "Bash", "arguments": {"command": "echo hi", "description": "Say hi"}}
NO_HEADER = {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}
# client -> (program, how it runs, its environment and flags, the call of its shell tool the fake model makes first)
CLIENTS = {
    "claude": ("claude", run_claude, {}, [], CLAUDE_BASH),
    "codex": ("codex", run_codex, {}, [], {"name": "exec_command", "arguments": {"cmd": "echo hi"}}),
    # Claude Code without its first system block, `x-anthropic-billing-header: cc_version=<version>.<3
    # characters that vary with the first prompt>; cc_entrypoint=...;`: what a server that dropped it would render
    "claude-no-header": ("claude", run_claude, NO_HEADER, [], CLAUDE_BASH),
    # and without the git status in its system prompt (`includeGitInstructions: false` in its settings)
    "claude-no-header-no-git": ("claude", run_claude, {**NO_HEADER, "CLAUDE_CODE_DISABLE_GIT_INSTRUCTIONS": "1"}, [],
                                CLAUDE_BASH),
    # and with its system prompt replaced (`--system-prompt`): the environment block and git status go with it
    "claude-no-header-own-system": ("claude", run_claude, NO_HEADER,
                                    ["--system-prompt", "You are a coding agent. Use the tools."], CLAUDE_BASH),
}
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
ROUTES = ("/v1/messages", "/v1/responses")


def capture(client: str, prompt: str, other_prompt: str, tokenizer, tmp: Path, tool_turn: bool = True
            ) -> dict[str, list[dict]]:
    """Session name -> the client's generating requests in that session (path, body, the engine's prompt ids).
    The sessions, in this order: A (`prompt` in alpha-project), A' (the same again), A+day (the same with a time
    zone whose date is another), A+task (`other_prompt` there), A+edit (`prompt` after an untracked file appears
    in the repo), B (`prompt` in beta-service)."""
    program, run, client_env, flags, call = CLIENTS[client]
    home = tmp / client
    home.mkdir()
    alpha, beta = git_repo(home / "alpha-project"), git_repo(home / "beta-service")
    sessions = [("A", alpha, {}, prompt), ("A'", alpha, {}, prompt), ("A+day", alpha, {"TZ": other_day_tz()}, prompt),
                ("A+task", alpha, {}, other_prompt), ("A+edit", alpha, {}, prompt), ("B", beta, {}, prompt)]
    out: dict[str, list[dict]] = {}
    with FakeServer(tokenizer) as server:
        server.engine.tool_call = call if tool_turn else None
        for session, work, env, text in sessions:
            if session == "A+edit":
                (work / "notes.txt").write_text("todo\n")
            first_body, first_prompt = len(server.log.requests), len(server.engine.prompts)
            done = run(server.url, text, home, work, {**client_env, **env}, flags)
            if done.returncode != 0:
                raise RuntimeError(f"{client} failed in session {session}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
            bodies = [{"path": path, "body": json.loads(body)} for path, body, _ in server.log.requests[first_body:]
                      if path in ROUTES]
            seen = server.engine.prompts[first_prompt:]
            for request in bodies:
                request["ids"] = render(request["path"], request["body"], tokenizer)
                if request["ids"] not in seen:
                    raise AssertionError(f"{client}: a rendered request is not among the prompts the engine received")
            out[session] = bodies
    return out


# ---- rendering and comparing ---------------------------------------------------------------------------------


def render(path: str, body: dict, tokenizer) -> list[int]:
    """The prompt ids `specdec serve` computes for a request to `path` (a new Responses request: no history)."""
    from specdec.server.anthropic import MessagesRequest
    from specdec.server.prompts import chat_prompt_ids
    from specdec.server.responses import ResponsesRequest

    text = json.dumps(body)
    req = MessagesRequest.model_validate_json(text).to_chat() if path == "/v1/messages" else \
        ResponsesRequest.model_validate_json(text).to_chat([])
    return chat_prompt_ids(tokenizer, req.template_messages(), req.template_tools())


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def text_at(tokenizer, ids: list[int], i: int, before: int = 6, after: int = 14) -> str:
    """The text around token i, with `|` where token i starts."""
    shown = tokenizer.decode(ids[max(0, i - before): i]) + "|" + tokenizer.decode(ids[i: i + after])
    return shown.replace("\n", "\\n")


def date_position(tokenizer, ids: list[int], today: datetime.date) -> int | None:
    """The index of the token where today's date first appears (as 2026-12-07, 2026/12/07, 12/7/2026, "December 7,
    2026" etc.), or None."""
    text = tokenizer.decode(ids)
    forms = [today.isoformat(), today.isoformat().replace("-", "/"), f"{today.month}/{today.day}/{today.year}",
             today.strftime("%B ") + f"{today.day}, {today.year}", f"{today.day} " + today.strftime("%B %Y"),
             today.strftime("%a %b ") + f"{today.day}"]
    found = [text.find(form) for form in forms if text.find(form) >= 0]
    if not found:
        return None
    at = min(found)
    lo, hi = 0, len(ids)  # the first token whose prefix's text reaches past `at`
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[: mid + 1])) > at:
            hi = mid
        else:
            lo = mid + 1
    return lo


def label(request: dict) -> str:
    body = request["body"]
    tools = len(body.get("tools") or ())
    return f"{request['path'].removeprefix('/v1/')}, {tools} tools"


COMPARED = {"A'": "same folder again", "A+day": "same folder, another date", "A+task": "same folder, another prompt",
            "A+edit": "same folder, file added", "B": "another folder"}


def compare(client: str, sessions: dict[str, list[dict]], tokenizer, today: datetime.date) -> list[dict]:
    """One row per request of session A: its length, where today's date is, and for each other session the
    first index where that session's same request differs (None: equal), the text there and the share of
    whole blocks before it; for a request after the first, the same against the request before it."""
    rows = []
    a = sessions["A"]
    for other in COMPARED:
        if other in sessions and len(sessions[other]) != len(a):
            print(f"{client}: session {other} sent {len(sessions[other])} requests, A sent {len(a)}: the first "
                  f"{min(len(a), len(sessions[other]))} are compared")

    def diff(ids: list[int], other: list[int]) -> dict:
        d = first_difference(ids, other)
        equal = d == len(ids) == len(other)
        return {"first_diff": None if equal else d, "text": "" if equal else text_at(tokenizer, ids, d),
                "reusable": (len(ids) if equal else d // BLOCK * BLOCK) / len(ids)}

    for i, request in enumerate(a):
        ids = request["ids"]
        row = {"client": client, "request": i + 1, "kind": label(request), "tokens": len(ids),
               "date_at": date_position(tokenizer, ids, today), "vs": {}}
        for other in COMPARED:
            if i < len(sessions.get(other, ())):
                row["vs"][other] = diff(ids, sessions[other][i]["ids"])
        if i > 0:  # within the session: what this request shares with the one before it
            row["vs"]["previous request"] = diff(ids, a[i - 1]["ids"])
            row["vs"]["previous request"]["previous_tokens"] = len(a[i - 1]["ids"])
        rows.append(row)
    return rows


def table(rows: list[dict]) -> None:
    """The first differing token of each request against each other session (`=`: equal; in brackets: the
    share of the prompt in whole blocks before it), then the text at each difference."""
    columns = [*COMPARED, "previous request"]
    print(f"{'client':27} {'req':>3} {'request':16} {'tokens':>6} {'date at':>7}  " +
          "  ".join(f"{c:>15}" for c in columns))
    for r in rows:
        cells = []
        for c in columns:
            v = r["vs"].get(c)
            cells.append("-" if v is None else "=" if v["first_diff"] is None else
                         f"{v['first_diff']} ({v['reusable']:.0%})")
        print(f"{r['client']:27} {r['request']:>3} {r['kind']:16} {r['tokens']:>6} {str(r['date_at']):>7}  " +
              "  ".join(f"{c:>15}" for c in cells))
    print()
    print("the text at each first difference (| marks it):")
    for r in rows:
        for c, v in r["vs"].items():
            if v["first_diff"] is not None:
                print(f"  {r['client']} request {r['request']} vs {c}: {v['text'][:120]}")


def versions() -> dict[str, str]:
    out = {}
    for program in ("claude", "codex"):
        if shutil.which(program):
            done = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=60)
            out[program] = done.stdout.strip()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default=",".join(CLIENTS), help=f"of {', '.join(CLIENTS)}")
    ap.add_argument("--prompt", default="say hi")
    ap.add_argument("--other-prompt", default="say hello", help="session A+task's prompt")
    ap.add_argument("--no-tool-turn", action="store_true", help="the fake model answers at once: one request each")
    ap.add_argument("--model", default=TARGET, help="whose tokenizer renders the prompts: a known name or a .gguf")
    ap.add_argument("--save", type=Path, help="write the captured requests here (one JSON file per client)")
    ap.add_argument("--replay", type=Path, help="render requests saved by --save instead of running the agents")
    args = ap.parse_args()

    from specdec.models.gguf_file import GGUFFile
    from specdec.models.store import resolve_model
    from specdec.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(resolve_model(args.model)))
    rows, skipped, agents = [], {}, versions()
    with tempfile.TemporaryDirectory(prefix="session-prefix-") as tmp:
        for client in args.clients.split(","):
            today = datetime.date.today()
            program = CLIENTS[client][0]
            if args.replay:
                saved = json.loads((args.replay / f"{client}.json").read_text())
                today, agents[program] = datetime.date.fromisoformat(saved["date"]), saved["version"]
                sessions = {name: [{**r, "ids": render(r["path"], r["body"], tokenizer)} for r in requests]
                            for name, requests in saved["sessions"].items()}
            elif shutil.which(program) is None or shutil.which("node") is None:
                skipped[client] = f"`{program}` is not on PATH (npm i -g {PACKAGES[program]})"
                print(f"{client}: skipped: {skipped[client]}")
                continue
            else:
                sessions = capture(client, args.prompt, args.other_prompt, tokenizer, Path(tmp),
                                   tool_turn=not args.no_tool_turn)
                if args.save:
                    args.save.mkdir(parents=True, exist_ok=True)
                    strip = {name: [{"path": r["path"], "body": r["body"]} for r in requests]
                             for name, requests in sessions.items()}
                    (args.save / f"{client}.json").write_text(json.dumps(
                        {"date": today.isoformat(), "version": agents[program], "sessions": strip}, indent=1))
            rows += compare(client, sessions, tokenizer, today)
    table(rows)
    print(json.dumps({"bench": "session_prefix", "prompt": args.prompt, "agents": agents, "block": BLOCK,
                      "rows": rows, "skipped": skipped}))


if __name__ == "__main__":
    sys.exit(main())
