"""Real coding agents against a live `specdec serve`: Claude Code (`claude -p`, Anthropic's Messages API) and
OpenAI's Codex CLI (`codex exec`, the Responses API), one-shot prompts.

Two layers. Over a fake engine that answers a tool call, then the tool's result (fast, `not real`): each
agent's request is accepted, its tool runs on this machine, and the result comes back to the model and into
the agent's final answer: the whole agent loop through the translation layers; and a task that outgrows the
context, which Claude Code compacts and finishes (on the server's refusal, or before it when told the
window: docs/api.md's settings, checked here). On the real default model
(`real`): a one-shot prompt is answered by `specdec serve` with its defaults (Claude Code's prompt is 21k
tokens, within the default context, the model's 32768; on 2 CPU cores its prefill takes many minutes, so the
test raises Claude Code's stream idle timeout).

The real-model one-shots run only with SPECDEC_AGENT_TESTS=1 (Codex took 263 s, Claude Code 1354 s here: too
long for the default test run). Each needs Node and the agent's npm package on PATH (`npm i -g @anthropic-ai/claude-code @openai/codex`);
skipped with the reason otherwise. The agents' configuration goes to temporary folders (CLAUDE_CONFIG_DIR,
CODEX_HOME), never the user's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from test_server_unit import EOS, MODEL, FakeEngine, LiveServer, free_port

MARKER = "specdec-was-here"
TOOL_CALLS = {  # the agent's shell tool, as each names it
    "claude": {"name": "Bash", "arguments": {"command": f"echo {MARKER}", "description": "Print a marker"}},
    "codex": {"name": "exec_command", "arguments": {"cmd": f"echo {MARKER}"}},
}


def need(program: str) -> str:
    if shutil.which("node") is None:
        pytest.skip("Node is not installed: the agents are npm packages")
    path = shutil.which(program)
    if path is None:
        package = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}[program]
        pytest.skip(f"`{program}` is not on PATH: npm i -g {package}")
    return path


def claude(url: str, prompt: str, tmp_path: Path, timeout: float, *flags: str, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    # Claude Code abandons (and retries) a stream after 5 minutes without a content event (its SDK drops our
    # pings before its watchdog sees them); its 21k-token prompt prefills longer than that on 2 CPU cores
    env = {**os.environ, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
           "CLAUDE_CONFIG_DIR": str(tmp_path / "claude"), "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(int(REAL_TIMEOUT_S * 1000)), **(env or {})}
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([need("claude"), *flags, "-p", prompt], env=env, cwd=work, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def codex(url: str, model: str, prompt: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    home = tmp_path / "codex"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "specdec"\n\n[model_providers.specdec]\nname = "specdec"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([need("codex"), "exec", "--skip-git-repo-check", prompt], env={**os.environ, "CODEX_HOME": str(home)},
                          cwd=work, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ---- the agent loop over a fake engine ---------------------------------------------------------------------


class AgentEngine(FakeEngine):
    """Answers a call of the agent's shell tool; once the prompt holds a tool's result (the fake template writes
    it after `<tool>`), answers with that result. `prompts` keeps every prompt."""

    def __init__(self, agent: str):
        super().__init__(max_model_len=1 << 21, tokens_per_step=64)
        self.call = f"<tool_call>\n{json.dumps(TOOL_CALLS[agent])}\n</tool_call>"
        self.prompts: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None) -> None:
        super().add_request(request_id, prompt_token_ids, params, cache_salt)
        prompt = self.tokenizer.decode(prompt_token_ids)
        self.prompts.append(prompt)
        say = f"The tool said: {prompt.rsplit('<tool>', 1)[1][:200]}" if "<tool>" in prompt else self.call
        self.waiting[-1]["answer"] = list(say.encode()) + [EOS]


def test_claude_code_runs_a_tool_through_v1_messages(tmp_path):
    need("claude")
    with LiveServer(AgentEngine("claude")) as server:
        done = claude(server.url, "Print the marker.", tmp_path, 180, "--allowedTools", "Bash(echo:*)")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"The tool said: {MARKER}" in done.stdout  # the Bash tool ran, its output came back
        assert any(f"<tool>{MARKER}" in p for p in server.engine.prompts)


class GrowingEngine(FakeEngine):
    """A task that outgrows the context: the model calls the shell tool `calls` times, each printing about a
    quarter of the room Claude Code's own prompt leaves in `WINDOW` (so the fourth result overflows it), then
    answers. A compaction request (its last message asks for a "detailed summary") gets a summary."""

    WINDOW = 64_000
    TASK = "Print the numbers with seq, six times."

    def __init__(self, calls: int = 6):
        super().__init__(max_model_len=self.WINDOW, tokens_per_step=512)
        self.calls, self.called, self.command = calls, 0, None
        self.requests: list[tuple[str, int]] = []  # (kind, prompt tokens) of each request the engine took

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None) -> None:
        super().add_request(request_id, prompt_token_ids, params, cache_salt)
        prompt, n = self.tokenizer.decode(prompt_token_ids), len(prompt_token_ids)
        if "detailed summary" in prompt.rsplit("<user>", 1)[-1]:
            kind, say = "compact", f"<analysis>Ran seq.</analysis>\n<summary>1. The user asked: {self.TASK}</summary>"
        elif self.TASK in prompt and self.called < self.calls:
            if self.command is None:  # sized on the first: each output a quarter of the room beside the prompt
                assert n < self.WINDOW // 2, f"Claude Code's own prompt grew to {n} tokens: raise WINDOW"
                last, size = 0, 0
                while size < (self.WINDOW - n) // 4:
                    last += 1
                    size += len(str(last)) + 1
                self.command = f"seq 1 {last}"
            self.called += 1
            call = {"name": "Bash", "arguments": {"command": self.command, "description": "Print numbers"}}
            kind, say = "call", f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            kind, say = ("final", "All six printed.") if self.TASK in prompt else ("other", "ok")
        self.requests.append((kind, n))
        self.waiting[-1]["answer"] = list(say.encode()) + [EOS]


@pytest.mark.parametrize("told", [False, True], ids=["not-told", "told-the-window"])
def test_claude_code_compacts_its_conversation_and_goes_on(tmp_path, told):
    """Not told the window, Claude Code sends the prompt that overflows it; the server answers `prompt is
    too long: N tokens > M maximum`, on which it compacts and finishes the task on the compacted
    conversation. Told the window (docs/api.md's settings), it compacts before: no request is refused. With
    an output reserve of 4096 it compacts at WINDOW - 4096 - 13000 tokens, so in both cases after the fourth
    result (Claude Code 2.1.197; each case a few seconds)."""
    need("claude")
    told_env = {"ANTHROPIC_MODEL": "qwen2.5-coder-1.5b-instruct", "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000",
                "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(GrowingEngine.WINDOW)}
    with LiveServer(GrowingEngine()) as server:
        done = claude(server.url, GrowingEngine.TASK, tmp_path, 300, "--allowedTools", "Bash(seq:*)",
                      env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096", **(told_env if told else {})})
        metrics = httpx.get(server.url + "/metrics").text
    assert done.returncode == 0 and "All six printed." in done.stdout, done.stdout + done.stderr
    kinds = [kind for kind, _ in server.engine.requests if kind != "other"]
    assert kinds == ["call"] * 4 + ["compact"] + ["call"] * 2 + ["final"], server.engine.requests
    refused = re.search(r'specdec:http_requests_total\{[^}]*path="/v1/messages"[^}]*status="400"[^}]*\} (\S+)', metrics)
    assert (refused is None) if told else (refused and float(refused[1]) >= 1), metrics  # the prompt that overflowed
    lengths = [n for kind, n in server.engine.requests if kind != "other"]
    assert lengths[5] < lengths[3]  # the task went on from the compacted conversation


def test_codex_runs_a_tool_through_v1_responses(tmp_path):
    need("codex")
    with LiveServer(AgentEngine("codex")) as server:
        done = codex(server.url, MODEL, "Print the marker.", tmp_path, 180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "The tool said:" in done.stdout and MARKER in done.stdout
        assert any(MARKER in p.rsplit("<tool>", 1)[-1] for p in server.engine.prompts if "<tool>" in p)


# ---- one-shot prompts on the real model --------------------------------------------------------------------

REAL_TIMEOUT_S = 3600  # Claude Code's 21k-token prompt on 2 shared CPU cores: prefill takes many minutes


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    if os.environ.get("SPECDEC_AGENT_TESTS") != "1":  # 5-25 minutes of prefill: kept out of the default run
        pytest.skip("the agents' one-shots on the real model take 5-25 minutes on 2 cores: SPECDEC_AGENT_TESTS=1 runs them")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # serve's defaults, as a user types it (the model's own context, 32768 tokens; auto speculation)
    command = [sys.executable, "-m", "specdec", "serve", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()


def answered_without_errors(log: Path, path: str) -> None:
    lines = [line for line in log.read_text(errors="replace").splitlines() if f'"POST {path}' in line]
    assert lines and all(" 200 " in line for line in lines), lines


@pytest.mark.real
def test_claude_code_one_shot_on_the_real_model(real_server, tmp_path):
    url, log = real_server
    done = claude(url, "Say hello in three words.", tmp_path, REAL_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr
    assert "API Error" not in done.stdout
    answered_without_errors(log, "/v1/messages")


@pytest.mark.real
def test_codex_one_shot_on_the_real_model(real_server, tmp_path):
    url, log = real_server
    done = codex(url, "qwen2.5-coder-1.5b-instruct", "Say hello in three words.", tmp_path, REAL_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr
    answered_without_errors(log, "/v1/responses")
