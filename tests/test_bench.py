"""`specdec bench`: method names, prompt files, the summaries and recommendation on hand-made metrics, the
whole command on the tiny model (files written, figures consistent with the metrics), and `bench serve`
against the fake-engine server."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from specdec.api import build_speculative_config
from specdec.bench.compare import MethodRun, recommend, summarize
from specdec.bench.methods import Method, parse_method, parse_methods
from specdec.bench.prompts import Prompt, dataset_prompts, read_prompts
from specdec.bench.report import render
from specdec.bench.serve import load_test, write_serve_report
from specdec.cli import main
from specdec.config import SpeculativeConfig
from specdec.engine.metrics import SpecMetrics
from test_cli import tiny_gguf  # noqa: F401 (a fixture)
from test_server_unit import FakeEngine, LiveServer

TARGET = "qwen2.5-coder-1.5b-instruct"
PNG = b"\x89PNG\r\n\x1a\n"


def test_method_names_map_to_speculative_configs():
    m = parse_method("draft:qwen2.5-coder-0.5b-instruct:k=4", TARGET)
    assert m.spec == SpeculativeConfig(method="draft_model", model="qwen2.5-coder-0.5b-instruct",
                                       num_speculative_tokens=4, adaptive=False, suffix=False)
    assert not m.spec.with_suffix  # the draft model alone; with `suffix`, as --speculative-model runs it
    both = parse_method("draft:d:suffix", TARGET)
    assert both.spec.with_suffix and both.name == "draft:d:k=3:suffix"
    auto = parse_method("auto:local", TARGET)
    assert (auto.name, auto.spec.method, auto.spec.model, auto.spec.suffix_decoding_max_cached_requests) == \
        ("auto:k=3:local", "auto", None, 0)
    assert parse_method("suffix:shared", TARGET).spec.suffix_decoding_share_unsalted
    assert not parse_method("suffix", TARGET).spec.suffix_decoding_share_unsalted
    assert m.name == "draft:qwen2.5-coder-0.5b-instruct:k=4"
    assert parse_method("ngram", TARGET).name == "ngram:k=3"  # the default K, spelled out
    eagle = parse_method("eagle:dynamic:k=2", TARGET)
    assert (eagle.name, eagle.spec.model, eagle.spec.tree) == ("eagle:k=2:dynamic", f"{TARGET}-eagle3", "dynamic")
    medusa = parse_method("medusa:my-heads:tree", TARGET)
    assert (medusa.name, medusa.spec.model, medusa.spec.tree) == ("medusa:my-heads:k=3:tree", "my-heads", "default")
    assert parse_method("draft:d:k=5:adaptive", TARGET).spec.adaptive
    assert parse_method("draft:d:vocab=65536", TARGET).spec.draft_vocab_size == 65536
    q4 = parse_method("draft:d:quant=q4_0:k=4", TARGET)
    assert (q4.name, q4.spec.draft_quantization) == ("draft:d:k=4:quant=q4_0", "q4_0")
    heads_q4 = parse_method("eagle:h:quant=q4_0", TARGET)  # the heads' matrices (`load_heads`)
    assert (heads_q4.name, heads_q4.spec.model, heads_q4.spec.draft_quantization) == \
        ("eagle:h:k=3:quant=q4_0", "h", "q4_0")
    suffix = parse_method("suffix:tree:local", TARGET)  # K defaults to the trie's depth, as in vLLM
    assert suffix.name == "suffix:k=24:tree:local"
    assert (suffix.spec.tree, suffix.spec.suffix_decoding_max_cached_requests) == ("dynamic", 0)
    # every method's --speculative-config builds the same config back
    for name in ("ngram:k=2", "draft:d:k=5:adaptive", "medusa:k=2:tree", "eagle:k=4:dynamic", "draft:d",
                 "suffix:k=8", "suffix:adaptive:tree", "suffix:local", "draft:d:k=4:vocab=32768",
                 "draft:d:k=4:vocab=32768:quant=q4_0", "draft:d:suffix", "auto", "auto:heads:k=2:local",
                 "auto:shared", "suffix:shared", "draft:d:suffix:shared", "medusa:k=2:quant=q4_0"):
        method = parse_method(name, TARGET)
        assert build_speculative_config(None, None, method.config_json) == method.spec
    assert parse_method("plain", TARGET) == Method("plain", None) and Method("plain", None).config_json is None


def test_bad_method_names_are_refused_clearly():
    for bad, message in [("lookahead", "unknown method"), ("draft", "name the draft model"),
                         ("draft:d:k=0", "k must be"), ("ngram:x", "ngram takes no model"),
                         ("suffix:x", "suffix takes no model"), ("ngram:local", "ngram takes no model"),
                         ("plain:k=2", "plain takes no options"), ("draft:d:e", "unknown option"),
                         ("draft:d:vocab=0", "vocab must be"), ("ngram:vocab=8", "ngram takes no model"),
                         ("suffix:quant=q4_0", "suffix takes no model"),
                         ("draft:d:quant=q3", "draft_quantization must be one of")]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad, TARGET)
    with pytest.raises(ValueError, match="listed twice"):
        parse_methods("ngram,ngram:k=3", TARGET)
    methods = parse_methods("ngram, draft:d", TARGET)  # plain is added, first: the baseline
    assert [m.name for m in methods] == ["plain", "ngram:k=3", "draft:d:k=3"]


def test_prompt_files_and_shipped_data_sets(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f():", "category": "code"}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert read_prompts(path) == [Prompt("def f():", None, "code"),
                                  Prompt(None, ({"role": "user", "content": "hi"},), None)]
    for line, message in [('{"text": "x"}', ":1: each line needs one of"), ("{", ":1: not JSON"),
                          ('{"prompt": "x", "messages": []}', "one of"), ('{"messages": []}', "non-empty list")]:
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            read_prompts(path)
    humaneval = dataset_prompts("humaneval")
    assert len(humaneval) == 100 and humaneval[0].prompt.startswith("from typing import List")
    spec_bench = dataset_prompts("spec-bench")
    assert len(spec_bench) == 240 and len({p.category for p in spec_bench[:13]}) == 13  # categories take turns
    coding = dataset_prompts("spec-bench:coding")
    assert len(coding) == 5 and {p.category for p in coding} == {"coding"} and coding[0].messages[0]["role"] == "user"
    with pytest.raises(ValueError, match="no category 'cooking'"):
        dataset_prompts("spec-bench:cooking")


def metrics(emitted: int, passes: int, decode_s: float, drafts: int = 0, drafted: int = 0, accepted: int = 0,
            per_position=(), draft_s: float = 0.0) -> SpecMetrics:
    """Hand-made metrics: 1 s of prefill, `decode_s` of decoding of which `draft_s` drafting, 80% of the rest
    the target."""
    return SpecMetrics(num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                       accepted_per_position=list(per_position), target_passes=passes, emitted_tokens=emitted,
                       prefill_time=1.0, draft_time=draft_s, target_time=0.8 * (decode_s - draft_s),
                       total_time=1.0 + decode_s)


def test_summaries_and_recommendation_on_known_metrics():
    """Plain: 20 tokens in 2 s then 20 in 4 s (10 and 5 tokens/s); a draft: the same tokens in 1 s and 2 s,
    8 passes each (3 drafts of 3, 7 accepted, 3 / 2 / 2 by position); a second draft, faster still but
    with one output that differs."""
    prompts = [Prompt("a", category="x"), Prompt("b", category="y")]
    plain = MethodRun(Method("plain", None), 0, [metrics(20, 20, 2.0), metrics(20, 20, 4.0)], [[1, 2], [3]])
    draft_metrics = [metrics(20, 8, 1.0, 3, 9, 7, (3, 2, 2), 0.5), metrics(20, 8, 2.0, 3, 9, 7, (3, 2, 2), 1.0)]
    draft = MethodRun(parse_method("draft:d", TARGET), 2**20, draft_metrics, [[1, 2], [3]])
    wrong = MethodRun(parse_method("ngram", TARGET), 0, [metrics(20, 5, 0.5), metrics(20, 5, 0.5)], [[1, 2], [4]])
    base, s, bad = summarize([plain, draft, wrong], prompts, greedy=True)
    assert base.tokens_per_s == pytest.approx(40 / 6) and base.speedup == 1 and base.identical == 2
    assert s.tokens_per_s == pytest.approx(40 / 3) and s.speedup == pytest.approx(2.0)
    assert s.speedup_per_prompt == pytest.approx([2.0, 2.0])
    assert s.speedup_by_category == pytest.approx({"x": 2, "y": 2})
    assert s.tokens_per_pass == pytest.approx(40 / 16) and s.pooled.acceptance_rate == pytest.approx(14 / 18)
    assert s.per_position == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert s.time_split == pytest.approx((0.5, 0.4, 0.1)) and s.identical == 2 and s.memory_bytes == 2**20
    assert bad.identical == 1 and bad.speedup == pytest.approx(40 / 1 / (40 / 6))
    assert recommend([base, s, bad]) is s  # the faster one changed an output: never recommended
    assert recommend([base]) is base
    sampled = summarize([plain, draft], prompts, greedy=False)
    assert sampled[1].identical is None

    text = render([base, s, bad], {"target": TARGET, "source": "t.jsonl", "prompts": 2, "max_tokens": 20,
                                   "temperature": 0.0, "setup": "cpu", "target_pass_ms": {"1": 10.0, "4": 25.0}}, [])
    assert "## Target pass cost by rows" in text and "| 4 | 25.00 | 2.50 |" in text
    assert "| draft:d:k=3 | 13.33 | 2.00x (2.00-2.00) | 2.50 | 0.78 | 50% / 40% / 10% | 1 MiB | 2/2 |" in text
    assert "| ngram:k=3 |" in text and "1/2 **NO**" in text and "This is a bug" in text
    # 4 tokens per pass cannot make decoding 6x faster: the timing is flagged (2x with 2.5 per pass is not)
    assert "ngram:k=3 measured 6.00x with 4.00 tokens per target pass: more than speculation can give" in text
    assert "draft:d:k=3 measured" not in text
    assert "| draft:d:k=3 | 1.00 | 0.67 | 0.67 |" in text  # acceptance by position
    assert text.rstrip().endswith(f"specdec serve {TARGET} --speculative-config '{s.config_json}'\n```")


def test_bench_command_on_the_tiny_model(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """Four methods on three prompts of two categories: the report, its JSON and the plots are written;
    the figures follow from the metrics; greedy outputs all equal plain decoding's; the recommended line
    parses back to the recommended method."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abc abc abc", "category": "repeat"}\n'
                       '{"messages": [{"role": "user", "content": "hello"}], "category": "chat"}\n'
                       '{"prompt": "hello world", "category": "repeat"}\n')
    out = tmp_path / "report"
    assert main(["bench", tiny_gguf, "--prompts", str(prompts), "--methods", f"ngram:k=2,suffix:k=4,draft:{tiny_gguf}",
                 "--max-tokens", "12", "--quantization", "none", "--dtype", "float32", "--max-model-len", "128",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("speedup.png", "acceptance.png", "categories.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG)
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    plain_tps = report["methods"][0]["metrics"]["tokens_per_second"]
    assert [m["method"] for m in report["methods"]] == ["plain", "ngram:k=2", "suffix:k=4", f"draft:{tiny_gguf}:k=3"]
    for m in report["methods"]:
        pooled = m["metrics"]
        decode = pooled["total_time_s"] - pooled["prefill_time_s"]
        assert m["tokens_per_s"] == pytest.approx(pooled["emitted_tokens"] / decode, rel=1e-2)
        assert m["tokens_per_pass"] == pytest.approx(pooled["emitted_tokens"] / pooled["target_passes"], abs=1e-4)
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / plain_tps, rel=1e-2)
        assert sum(m["time_split"].values()) == pytest.approx(1, abs=1e-3)
        assert m["identical"] == 3 and len(m["speedup_per_prompt"]) == 3
        assert set(m["speedup_by_category"]) == {"chat", "repeat"}
        assert f"| {m['method']} | {m['tokens_per_s']:.2f} | {m['speedup']:.2f}x" in md
        assert f"| {m['tokens_per_pass']:.2f} |" in md
    plain, ngram, suffix, draft = report["methods"]
    assert suffix["metrics"]["num_drafts"] > 0  # "abc abc abc" repeats
    assert plain["tokens_per_pass"] == 1 and plain["memory_bytes"] == 0 and plain["metrics"]["num_drafts"] == 0
    assert draft["metrics"]["acceptance_rate"] == 1.0 and draft["per_position"] == [1.0, 1.0, 1.0]  # its own draft
    assert draft["memory_bytes"] > 0 and "3/3" in md and "**NO**" not in md
    assert "## Speedup by category" in md and "![speedup](speedup.png)" in md
    passes = report["target_pass_ms"]  # as the controllers measured them: one row and the drafts' widths
    assert "1" in passes and len(passes) > 1 and all(ms > 0 for ms in passes.values())
    assert "## Target pass cost by rows" in md

    command = md.rstrip().splitlines()[-2]  # the last line in the closing code block
    assert command == printed.rstrip().splitlines()[-1] and command.startswith(f"specdec serve {tiny_gguf}")
    best = next(m for m in report["methods"] if m["method"] == report["recommended"])
    args = shlex.split(command)
    if best["speculative_config"] is None:
        assert args == ["specdec", "serve", tiny_gguf]
    else:
        assert args[3] == "--speculative-config" and args[4] == best["speculative_config"]
        assert build_speculative_config(None, None, args[4]) == parse_method(best["method"], tiny_gguf).spec


def test_bench_serve_against_the_fake_server(tmp_path):
    """Two levels on the fake engine (it answers every request, counting 2 of 3 drafted tokens accepted):
    every request succeeds, chats and plain prompts alike, and the report and its plot are written."""
    prompts = [Prompt(messages=({"role": "user", "content": "hi"},)), Prompt(prompt="def f():")] * 3
    with LiveServer(FakeEngine(max_batch_size=4)) as server:
        rows = load_test(server.url, prompts, [1, 3], max_tokens=12, rounds=2)
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in rows] == [(1, 2, []), (3, 6, [])]
    for r in rows:
        assert r["throughput"] > 0 and r["acceptance_rate"] == pytest.approx(2 / 3, abs=1e-3)
        assert 0 < r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"] and r["tpot_p50"] <= r["tpot_p99"]
    path = write_serve_report(tmp_path, rows, {"url": server.url, "source": "test", "max_tokens": 12,
                                               "temperature": 0.0})
    text = path.read_text()
    assert re.search(r"^\| 3 \| [\d.]+ \| [\d. /]+ \| [\d /]+ \| 0\.67 \| 6 \| 0 \|$", text, re.M)
    assert (tmp_path / "serve.png").read_bytes().startswith(PNG)
    assert json.loads((tmp_path / "report.json").read_text())["results"][1]["requests"] == 6
