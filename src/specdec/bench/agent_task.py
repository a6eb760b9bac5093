"""A multi-step task for real coding agents (Claude Code, Codex): the scratch repository, the check of the
outcome, and what each client and server says about the session (`benchmarks/bench_agent_task.py` runs them).

A one-word reply proves the protocol; an agent's value is a loop of tool calls. The task asks for three
steps in a tiny Python project: create `greet.py` that prints hello, run it, and fix the bug in `calc.py`
that makes `test_calc.py` fail. The outcome is checked here, not taken from the agent's word: `greet.py`
prints hello, `python -m pytest -q` passes, and the test file is the one we wrote (a test deleted or
edited into passing is no fix).

Example, on a repository an agent has finished:

    >>> repo = make_repo(Path("/tmp/scratch"))       # calc.py subtracts; test_calc.py fails
    >>> ... the agent runs in `repo` ...
    >>> check_repo(repo)
    Outcome(greet=True, tests=True, tests_intact=True)    # .success is True

Turns are counted twice, from each side: the client's own count (Claude Code's `num_turns` in
`--output-format json`; Codex's `--json` events: its tool calls and messages) and the model requests the
server answered (specdec's `/metrics`, llama.cpp's log of the tasks it started).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = ("Create a file greet.py that prints hello, and run it with python. Then run "
               "`python -m pytest -q`: a test fails because of a bug in calc.py. Fix calc.py (do not change "
               "test_calc.py) so that `python -m pytest -q` passes.")

FILES = {
    "calc.py": 'def add(a, b):\n    """The sum of a and b."""\n    return a - b\n\n\n'
               'def mul(a, b):\n    """The product of a and b."""\n    return a * b\n',
    "test_calc.py": "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                    "def test_mul():\n    assert mul(2, 3) == 6\n",
    "README.md": "# calc\n\nA tiny calculator. Run the tests with `python -m pytest -q`.\n",
}


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", *args], cwd=repo,
                   check=True, capture_output=True)


def make_repo(path: Path) -> Path:
    """A git repository at `path` holding FILES, committed: the buggy project the agent starts from."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (path / name).write_text(text)
    _git(path, "init", "-q")
    _git(path, "add", *FILES)
    _git(path, "commit", "-q", "-m", "calc with a failing test")
    return path


@dataclass(frozen=True)
class Outcome:
    """The task's three checks on the repository as the agent left it."""
    greet: bool         # greet.py exists and `python greet.py` prints hello (any case)
    tests: bool         # `python -m pytest -q` passes
    tests_intact: bool  # test_calc.py is the file we wrote

    @property
    def success(self) -> bool:
        return self.greet and self.tests and self.tests_intact


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def check_repo(repo: Path) -> Outcome:
    """Checks the task in `repo` with this interpreter (which has pytest), not the agent's word for it."""
    greet = (repo / "greet.py").is_file() and re.search(r"hello", _run(repo, "greet.py").stdout, re.I) is not None
    tests = _run(repo, "-m", "pytest", "-q", "-p", "no:cacheprovider").returncode == 0
    test_file = repo / "test_calc.py"
    intact = test_file.is_file() and test_file.read_text() == FILES["test_calc.py"]
    return Outcome(greet=greet, tests=tests, tests_intact=intact)


@dataclass(frozen=True)
class ClientReport:
    """What a client said about its session."""
    ok: bool          # the client finished without an error of its own (API error, turn limit, crash)
    turns: int        # Claude Code: its num_turns; Codex: the model's answers (tool calls and messages)
    tool_calls: int   # commands run and files changed (Codex); Claude Code's JSON does not list them: -1
    message: str      # the final answer, or the error


def claude_report(stdout: str, returncode: int) -> ClientReport:
    """`claude -p --output-format json`'s one JSON object: `is_error`, `num_turns`, `result`. Output that
    is not that object (a crash) reports the exit code and the output's end."""
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return ClientReport(False, 0, -1, f"exit {returncode}: {stdout[-300:]}")
    ok = returncode == 0 and not result.get("is_error", True) and result.get("subtype") == "success"
    message = str(result.get("result") or result.get("subtype", ""))
    return ClientReport(ok, int(result.get("num_turns", 0)), -1, message)


TOOL_ITEMS = ("command_execution", "file_change", "mcp_tool_call", "web_search")


def codex_report(stdout: str, returncode: int) -> ClientReport:
    """`codex exec --json`'s events, one JSON object a line: `item.completed` items (tool calls:
    TOOL_ITEMS; answers: `agent_message`), `turn.failed` / `error` on failure. Each tool call and each
    message is one answer of the model (a tool call's answer may carry several: counted each)."""
    tools = messages = 0
    error, last = "", ""
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("type")
        if kind == "item.completed":
            item = event.get("item", {})
            if item.get("type") in TOOL_ITEMS:
                tools += 1
            elif item.get("type") == "agent_message":
                messages += 1
                last = item.get("text", "")
        elif kind == "turn.failed":
            error = event.get("error", {}).get("message", "turn failed")
        elif kind == "error" and not error:
            error = event.get("message", "error")
    ok = returncode == 0 and not error
    return ClientReport(ok, tools + messages, tools, last if ok else error or f"exit {returncode}")


def specdec_requests(metrics: str, path: str) -> int:
    """Requests to `path` that specdec answered with 200, from its /metrics text
    (`specdec:http_requests_total{method=..., path=..., status=...}`)."""
    total = 0.0
    for m in re.finditer(r'^specdec:http_requests_total\{([^}]*)\} (\S+)$', metrics, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if labels.get("path") == path and labels.get("status") == "200":
            total += float(m[2])
    return int(total)


def llama_requests(log: str) -> int:
    """Requests llama-server started answering, from its log: one `launch_slot_: ... processing task` line
    each (this build logs no request lines; the route cannot be told, so count one client's run at a time)."""
    return len(re.findall(r"launch_slot_: .*processing task", log))


@dataclass(frozen=True)
class Run:
    """One client's session against one server."""
    client: str
    server: str
    outcome: Outcome
    report: ClientReport
    requests: int     # model requests the server took: specdec's 200s on the client's route, llama.cpp's tasks
    wall_s: float
    timed_out: bool


def table(runs: list[Run]) -> list[str]:
    """A markdown table of the runs, for people."""
    lines = ["| client | server | success | greet.py / tests / test file intact | client turns | tool calls | "
             "server requests | wall s | client's end |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        o = r.outcome
        checks = " / ".join("yes" if ok else "no" for ok in (o.greet, o.tests, o.tests_intact))
        end = "timed out" if r.timed_out else ("ok" if r.report.ok else "error")
        tools = "" if r.report.tool_calls < 0 else str(r.report.tool_calls)
        lines.append(f"| {r.client} | {r.server} | {'yes' if o.success else 'no'} | {checks} | {r.report.turns} | "
                     f"{tools} | {r.requests} | {r.wall_s:.0f} | {end} |")
    return lines


def summary(runs: list[Run]) -> list[dict]:
    """The runs as JSON-ready dicts, for the benchmark's last line."""
    return [{"client": r.client, "server": r.server, "success": r.outcome.success, "greet": r.outcome.greet,
             "tests": r.outcome.tests, "tests_intact": r.outcome.tests_intact, "client_ok": r.report.ok,
             "turns": r.report.turns, "tool_calls": r.report.tool_calls, "requests": r.requests,
             "wall_s": round(r.wall_s, 1), "timed_out": r.timed_out, "message": r.report.message[:300]}
            for r in runs]
