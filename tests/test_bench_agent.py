"""`specdec bench agent`'s checks of an edit (the fenced block parses and holds the edit) and its session (each
server keeps its own history, the servers take turns), on canned answers: no model, no server."""

from __future__ import annotations

import specdec.bench.agent as agent
from specdec.bench.agent import SESSION, answer_code, correct, module_source, run_session, session_table, summary


def test_an_edit_is_correct_only_when_its_block_parses_and_holds_it():
    rename, typed = SESSION[0].check, SESSION[1].check
    code = module_source("colorsys")
    renamed = code.replace("_v(", "_hue_to_value(")
    assert correct(f"colorsys.py\n```python\n{renamed}```", rename)
    assert not correct(f"colorsys.py\n```python\n{code}```", rename)  # not done
    assert not correct(renamed, rename)  # no fenced block
    assert not correct(f"```python\n{renamed[:-200]}```", rename)  # cut off: does not parse
    hinted = code.replace("def rgb_to_hsv(r, g, b):", "def rgb_to_hsv(r: float, g: float, b: float) -> tuple:")
    assert not correct(f"```python\n{hinted}```", typed)  # hsv_to_rgb still bare
    hinted = hinted.replace("def hsv_to_rgb(h, s, v):", "def hsv_to_rgb(h: float, s: float, v: float) -> tuple:")
    assert correct(f"```python\n{hinted}```", typed)
    assert answer_code("a\n```\nx = 1\n```\nb\n```python\ny = 2\nz = 3\n```") == "y = 2\nz = 3\n"


def test_the_session_keeps_each_servers_history_and_takes_turns(monkeypatch):
    calls = []

    def fake_chat(url, model, messages, max_tokens, api_key=None):
        calls.append((url, [m["role"] for m in messages]))
        return {"text": f"answer of {url}", "ttft": 0.1, "seconds": 2.0 if url == "a" else 1.0, "prompt_tokens": 10,
                "completion_tokens": 50, "cached_tokens": 0}

    monkeypatch.setattr(agent, "stream_chat", fake_chat)
    results = run_session({"slow": "a", "fast": "b"}, "m")
    assert [url for url, _ in calls] == ["a", "b"] * 3  # turn by turn
    assert calls[2][1] == ["system", "user", "assistant", "user"] and calls[4][1] == ["system", "user"]
    assert all(not r["correct"] for rows in results.values() for r in rows)  # "answer of a" holds no code
    s = summary(results)
    assert (s["slow"]["seconds"], s["fast"]["seconds"], s["fast"]["speedup_vs_slow"]) == (6.0, 3.0, 2.0)
    table = session_table(results)
    assert table[2].startswith("| slow |") and "2.00x" in table[3] and "0/3" in table[3]
