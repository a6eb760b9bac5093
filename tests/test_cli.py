"""`specdec generate` end to end on a tiny GGUF written by the test."""

from __future__ import annotations

import argparse
import json

import pytest

from specdec.cli import main
from specdec.server.cli import add_serve_arguments, load_for_serving, read_chat_template
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


def test_train_heads_then_generate_with_them(tiny_gguf, tmp_path, capsys):
    """`specdec train-heads` on the tiny model, then `generate` with the heads (EAGLE, dynamic tree):
    the same tokens as plain decoding; the memory report counts the heads; other targets are refused."""
    out = tmp_path / "eagle"
    assert main(["train-heads", tiny_gguf, "--method", "eagle", "--out", str(out), "--corpus-tokens", "600",
                 "--self-distill-prompts", "0", "--seq-len", "32", "--epochs", "1", "--vocab-size", "64",
                 "--held-out-tasks", "2", "--held-out-text", "answers", "--self-distill-tokens", "8",
                 "--quantization", "none", "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["method"] == "eagle" and report["steps"] >= 1 and (out / "model.safetensors").is_file()
    # HumanEval tasks 0-1, read by no training: the target's answers to them
    assert report["windows"]["held_out"] == 2 and "greedy answers" in report["windows"]["held_out_from"]

    args = ["generate", tiny_gguf, "--prompt", "ab", "--max-tokens", "7", "--quantization", "none",
            "--dtype", "float32", "--json", "--temperature", "0"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    config = json.dumps({"method": "eagle", "model": str(out), "num_speculative_tokens": 3, "tree": "dynamic"})
    assert main(args + ["--speculative-config", config]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["metrics"]["num_drafts"] >= 1

    assert main(["generate", tiny_gguf, "--memory-report", "--quantization", "none", "--speculative-config",
                 config]) == 0
    assert "heads weights" in capsys.readouterr().out

    cfg = json.loads((out / "config.json").read_text())
    cfg["target_fingerprint"] = "0" * 16  # as if trained for another target
    (out / "config.json").write_text(json.dumps(cfg))
    assert main(args + ["--speculative-config", config]) == 2
    assert "were trained for target" in capsys.readouterr().err


def test_the_seeds_vllm_serve_command_is_accepted(tiny_gguf, capsys):
    """`serve TARGET --speculative-model DRAFT --num-speculative-tokens 5 --gpu-memory-utilization 0.95`,
    as a vLLM user types it, plus vLLM's other common flags (a dry run: load, report, exit)."""
    args = ["serve", tiny_gguf, "--speculative-model", tiny_gguf, "--num-speculative-tokens", "5",
            "--gpu-memory-utilization", "0.95", "--seed", "0", "--tensor-parallel-size", "1",
            "--max-num-batched-tokens", "64", "--disable-log-requests", "--uvicorn-log-level", "warning",
            "--trust-remote-code", "--enforce-eager", "--dry-run"]
    assert main(args) == 0
    assert "speculative" in capsys.readouterr().out.lower()


def test_vllm_flags_that_cannot_apply_are_refused_clearly(tiny_gguf, tmp_path, capsys):
    assert main(["serve", tiny_gguf, "--tensor-parallel-size", "2", "--dry-run"]) == 2
    assert "one device" in capsys.readouterr().err
    assert main(["serve", tiny_gguf, "--chat-template", "no-such-file", "--dry-run"]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_chat_template_flag_replaces_the_models_template(tiny_gguf, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args([tiny_gguf, "--chat-template", str(template)])
    llm = load_for_serving(args, tiny_gguf, None)
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
    assert read_chat_template("{{ messages }}") == "{{ messages }}"


def test_generation_config_gives_the_defaults_of_parameters_requests_leave_out(tmp_path):
    from specdec.server.cli import generation_defaults

    parse = add_serve_arguments(argparse.ArgumentParser()).parse_args
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "bos_token_id": 1}))
    expected = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert generation_defaults(parse([]), tmp_path) == expected  # auto: the model folder's
    assert generation_defaults(parse([]), tmp_path / "model.gguf") == {}  # a GGUF file has none
    assert generation_defaults(parse(["--generation-config", "vllm"]), tmp_path) == {}
    assert generation_defaults(parse(["--generation-config", str(tmp_path)]), "elsewhere") == expected
    args = parse(["--override-generation-config", '{"temperature": 0.2, "max_new_tokens": 64}'])
    assert generation_defaults(args, tmp_path) == {**expected, "temperature": 0.2, "max_new_tokens": 64}
    for bad in (["--generation-config", str(tmp_path / "none")], ["--override-generation-config", "[1]"],
                ["--override-generation-config", '{"tempreature": 1}']):
        with pytest.raises(ValueError):
            generation_defaults(parse(bad), tmp_path)


def test_prefix_caching_is_on_unless_turned_off_and_lasts_across_generate_calls(tiny_gguf):
    """`serve` caches prefixes (in what the memory budget leaves) unless `--no-enable-prefix-caching`; the LLM's
    cache outlives a `generate` call, and `reset_prefix_cache` empties it."""
    from specdec.config import SamplingParams

    parser = add_serve_arguments(argparse.ArgumentParser())
    llm = load_for_serving(parser.parse_args([tiny_gguf, "--memory-utilization", "0.02"]), tiny_gguf, None)
    assert llm.memory_plan.prefix_cache_blocks > 0 and llm.engine.prefix_cache is not None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = "a quick brown fox jumps over the lazy dog"  # 38 tokens: 2 whole blocks and a tail of 5 before the last
    first, again = (llm.generate(prompt, params)[0] for _ in range(2))
    assert len(first.prompt_token_ids) == 38
    assert (first.metrics.cached_tokens, again.metrics.cached_tokens) == (0, 37)
    assert again.token_ids == first.token_ids
    llm.reset_prefix_cache()
    assert llm.generate(prompt, params)[0].metrics.cached_tokens == 0
    off = load_for_serving(parser.parse_args([tiny_gguf, "--no-enable-prefix-caching"]), tiny_gguf, None)
    assert off.memory_plan.prefix_cache_blocks == 0 and off.engine.prefix_cache is None


# ------------------------------------------------------------------ one set of model flags for generate, serve, bench
ACCEPTED = [
    ["--speculative-model", "d", "--num-speculative-tokens", "5"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
     "--speculative-disable-by-batch-size", "4"],
    ["--dtype", "half"], ["--dtype", "bf16"], ["--quantization", "none"], ["--device", "cpu"],
    ["--max-model-len", "256"], ["--gpu-memory-utilization", "0.5"], ["--memory-utilization", "1"],
    ["--max-num-batched-tokens", "64"], ["--no-enable-prefix-caching"], ["--prefill-itl-factor", "3"],
    ["--prefill-itl-factor", "0"], ["-tp", "1", "--pipeline-parallel-size", "1", "--trust-remote-code", "--enforce-eager"],
    ["--kv-cache-dtype", "q8_0"],
]
REFUSED_BY_THE_PARSER = [
    ["--dtype", "float8"], ["--quantization", "awq"], ["--kv-cache-dtype", "fp8"], ["--gpu-memory-utilization", "0"],
    ["--gpu-memory-utilization", "1.5"], ["--max-model-len", "0"], ["--max-num-batched-tokens", "0"],
    ["--num-speculative-tokens", "x"], ["--prefill-itl-factor", "1"], ["--prefill-itl-factor", "-2"],
    ["--prefill-itl-factor", "inf"],
]
REFUSED_BEFORE_LOADING = [  # (flags, the reason given)
    (["-tp", "2"], "one device"), (["--pipeline-parallel-size", "2"], "one device"),
    (["--speculative-config", "[1]", "--speculative-disable-by-batch-size", "2"], "must be a JSON object"),
    (["--speculative-config", "{bad", "--speculative-disable-by-batch-size", "2"], "not valid JSON"),
]


def parsed(command: str, flags: list[str]) -> argparse.Namespace:
    from specdec.cli import build_parser

    return build_parser().parse_args([command, "m", *flags])


@pytest.mark.parametrize("flags", ACCEPTED, ids=" ".join)
def test_generate_serve_and_bench_read_the_model_flags_alike(flags):
    """The same flags give the same LLM arguments from `generate` and `serve` (and from `bench`, which takes
    the model flags but none of the speculation flags: its methods say how to speculate), but for the disk
    tier of the prefix cache, which only `serve` turns on by default."""
    from specdec.llm_args import llm_kwargs

    generate, serve = parsed("generate", flags), parsed("serve", flags)
    expected = llm_kwargs(generate, "m", generate.speculative_model)
    served = llm_kwargs(serve, "m", serve.speculative_model)
    assert (served.pop("prefix_cache_disk"), served.pop("prefix_cache_dir")) == (True, None)
    assert "prefix_cache_disk" not in expected and served == expected
    if not any(flag.startswith("--speculative") or flag.startswith("--num-spec") for flag in flags):
        assert llm_kwargs(parsed("bench", flags), "m", None) == expected
    else:
        with pytest.raises(SystemExit):
            parsed("bench", flags)


def test_prefill_itl_factor_zero_turns_riding_prompts_off():
    from specdec.llm_args import llm_kwargs

    assert "prefill_itl_factor" not in llm_kwargs(parsed("serve", []), "m", None)  # the LLM's default (2)
    assert llm_kwargs(parsed("serve", ["--prefill-itl-factor", "3"]), "m", None)["prefill_itl_factor"] == 3.0
    assert llm_kwargs(parsed("serve", ["--prefill-itl-factor", "0"]), "m", None)["prefill_itl_factor"] is None


@pytest.mark.parametrize("flags", REFUSED_BY_THE_PARSER, ids=" ".join)
@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_bad_model_flag_values_are_refused_by_every_command(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        parsed(command, flags)
    assert exit_.value.code == 2 and flags[0] in capsys.readouterr().err


@pytest.mark.parametrize("flags,reason", REFUSED_BEFORE_LOADING, ids=[" ".join(f) for f, _ in REFUSED_BEFORE_LOADING])
def test_flags_that_cannot_apply_are_refused_alike_before_loading(flags, reason):
    from specdec.llm_args import llm_kwargs

    for command in ("generate", "serve"):
        with pytest.raises(ValueError, match=reason):
            llm_kwargs(parsed(command, flags), "m", None)


def test_generate_and_serve_load_and_refuse_the_same_command_lines(tiny_gguf, capsys):
    """End to end on the tiny model: the same model flags load with both commands (generate's memory report,
    serve's dry run), and a speculation that cannot be built is refused by both with the same reason."""
    flags = ["--dtype", "float", "--quantization", "none", "--device", "cpu", "--gpu-memory-utilization", "0.5",
             "--max-model-len", "128", "--max-num-batched-tokens", "32", "--speculative-model", tiny_gguf,
             "--num-speculative-tokens", "2", "--speculative-disable-by-batch-size", "4", "-tp", "1"]
    assert main(["generate", tiny_gguf, "--memory-report", *flags]) == 0
    assert "draft KV cache" in capsys.readouterr().out
    assert main(["serve", tiny_gguf, "--dry-run", *flags]) == 0
    assert "draft KV cache" in capsys.readouterr().out
    for bad, reason in ((["--num-speculative-tokens", "3"], "needs --speculative-model"),
                        (["--speculative-config", "{bad"], "not valid JSON"),
                        (["--speculative-model", "no-such-draft"], "no-such-draft")):
        assert main(["generate", tiny_gguf, "--memory-report", "--quantization", "none", *bad]) == 2
        assert reason in capsys.readouterr().err
        assert main(["serve", tiny_gguf, "--dry-run", "--quantization", "none", *bad]) == 2
        assert reason in capsys.readouterr().err


def test_every_dtype_name_the_flags_take_resolves():
    import torch

    from specdec.config import DTYPES
    from specdec.models.loading import resolve_dtype

    assert {name: resolve_dtype(name, "cpu") for name in ("half", "float", "bf16")} == \
        {"half": torch.float16, "float": torch.float32, "bf16": torch.bfloat16}
    assert all(isinstance(resolve_dtype(name, "cpu"), torch.dtype) for name in DTYPES)
