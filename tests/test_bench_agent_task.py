"""`benchmarks/bench_agent_task.py`'s parts that need no model: the scratch repository and the check of the
task's outcome (the agent's work done by hand), the clients' own reports (`claude -p --output-format json`,
`codex exec --json`, as those versions print them) and the servers' request counts."""

from __future__ import annotations

import json

from specdec.bench.agent_task import (FILES, ClientReport, Outcome, Run, check_repo, claude_report, codex_report,
                                      llama_requests, make_repo, specdec_requests, summary, table)


def test_the_scratch_repository_fails_until_the_task_is_done(tmp_path):
    repo = make_repo(tmp_path / "repo")
    assert (repo / ".git").is_dir()
    assert check_repo(repo) == Outcome(greet=False, tests=False, tests_intact=True)
    (repo / "greet.py").write_text('print("Hello!")\n')
    assert check_repo(repo) == Outcome(greet=True, tests=False, tests_intact=True)
    (repo / "calc.py").write_text(FILES["calc.py"].replace("a - b", "a + b"))
    assert check_repo(repo).success


def test_a_test_edited_into_passing_is_no_fix(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "greet.py").write_text("print('hello')\n")
    (repo / "test_calc.py").write_text(FILES["test_calc.py"].replace("== 5", "== -1"))
    outcome = check_repo(repo)
    assert outcome.tests and not outcome.tests_intact and not outcome.success
    (repo / "test_calc.py").unlink()
    assert not check_repo(repo).success


def test_greet_must_print_hello(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "greet.py").write_text("print('bye')\n")
    assert not check_repo(repo).greet


def test_claude_codes_json_result():
    done = {"type": "result", "subtype": "success", "is_error": False, "num_turns": 7, "result": "Done."}
    assert claude_report(json.dumps(done), 0) == ClientReport(True, 7, -1, "Done.")
    failed = {"type": "result", "subtype": "success", "is_error": True, "num_turns": 1, "result": "API Error: 400 nope"}
    assert claude_report(json.dumps(failed), 1) == ClientReport(False, 1, -1, "API Error: 400 nope")
    limit = {"type": "result", "subtype": "error_max_turns", "is_error": False, "num_turns": 13}
    assert claude_report(json.dumps(limit), 1) == ClientReport(False, 13, -1, "error_max_turns")
    assert not claude_report("Segmentation fault", 139).ok


def test_codex_events():
    events = [
        {"type": "thread.started", "thread_id": "t"},
        {"type": "item.completed", "item": {"id": "item_0", "type": "error", "message": "Model metadata ... not found."}},
        {"type": "turn.started"},
        {"type": "item.completed", "item": {"type": "command_execution", "command": "python greet.py", "exit_code": 0}},
        {"type": "item.completed", "item": {"type": "file_change", "changes": [{"path": "calc.py", "kind": "update"}]}},
        {"type": "item.completed", "item": {"type": "agent_message", "text": "All tests pass."}},
        {"type": "turn.completed", "usage": {"input_tokens": 9000, "output_tokens": 200}},
    ]
    out = "\n".join(json.dumps(e) for e in events) + "\nnot json\n"
    assert codex_report(out, 0) == ClientReport(True, 3, 2, "All tests pass.")
    failed = events[:3] + [{"type": "error", "message": "stream disconnected"},
                           {"type": "turn.failed", "error": {"message": "stream disconnected before completion"}}]
    report = codex_report("\n".join(json.dumps(e) for e in failed), 1)
    assert not report.ok and report.message == "stream disconnected before completion"


def test_the_servers_request_counts():
    metrics = ('# HELP specdec:http_requests_total HTTP answers\n'
               'specdec:http_requests_total{method="POST",path="/v1/responses",status="200"} 5.0\n'
               'specdec:http_requests_total{method="POST",path="/v1/responses",status="400"} 1.0\n'
               'specdec:http_requests_total{method="POST",path="/v1/messages",status="200"} 2.0\n')
    assert specdec_requests(metrics, "/v1/responses") == 5 and specdec_requests(metrics, "/v1/messages") == 2
    log = ("0.12.964.722 I slot launch_slot_: id  0 | task 0 | processing task, is_child = 0\n"
           "0.28.680.699 I slot print_timing: id  0 | task 0 |       total time =   15715.82 ms /    40 tokens\n"
           "0.29.777.815 I slot launch_slot_: id  0 | task 9 | processing task, is_child = 0\n")
    assert llama_requests(log) == 2


def test_the_table_and_summary():
    run = Run("codex", "specdec", Outcome(True, True, True), ClientReport(True, 4, 3, "done"), 5, 123.4, False)
    lines = table([run])
    assert lines[-1] == "| codex | specdec | yes | yes / yes / yes | 4 | 3 | 5 | 123 | ok |"
    assert summary([run])[0]["success"] and summary([run])[0]["wall_s"] == 123.4
