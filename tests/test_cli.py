"""`specdec generate` end to end on a tiny GGUF written by the test."""

from __future__ import annotations

import json

import pytest

from specdec.cli import main
from test_tokenizer import write_tiny_gguf


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return str(path)


def test_generate_json_with_speculation(tiny_gguf, capsys):
    args = ["generate", tiny_gguf, "--prompt", "ab", "--max-tokens", "7", "--quantization", "none",
            "--dtype", "float32", "--json", "--temperature", "0"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--speculative-model", tiny_gguf, "--num-speculative-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert len(plain["token_ids"]) <= 7 and plain["finish_reason"] in ("stop", "length")
    assert spec["metrics"]["num_drafts"] >= 1 and spec["metrics"]["acceptance_rate"] == 1.0  # its own draft


def test_memory_report(tiny_gguf, capsys):
    assert main(["generate", tiny_gguf, "--memory-report", "--quantization", "none", "--speculative-model",
                 tiny_gguf]) == 0
    out = capsys.readouterr().out
    assert "target weights" in out and "draft KV cache" in out and "sequences of up to" in out


def test_bad_input_is_a_clear_error(tiny_gguf, capsys):
    assert main(["generate", tiny_gguf, "--prompt", "", "--quantization", "none"]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "no-such-model", "--prompt", "x"]) == 2
    assert "no-such-model" in capsys.readouterr().err
