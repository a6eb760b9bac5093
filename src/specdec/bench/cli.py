"""`specdec bench TARGET ...` (compare speculation methods), `specdec bench serve ...` (load-test a server) and
`specdec bench agent ...` (an agent's edit session against servers, side by side)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.llm_args import add_llm_arguments, build_llm, pull_if_needed
from specdec.methods import Model

DATASET_PROMPTS = 10  # prompts taken from a shipped data set unless --num-prompts says otherwise


def add_prompt_arguments(parser: argparse.ArgumentParser, num_prompts_default: str) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompts", help='JSONL file, one {"prompt": TEXT} or {"messages": [...]} a line, '
                                          'optionally with "category"')
    source.add_argument("--dataset", help="a shipped data set: humaneval (the default), spec-bench or "
                                          "spec-bench:CATEGORY")
    parser.add_argument("--num-prompts", type=int, help=f"use the first N prompts (default: {num_prompts_default})")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt, at most")
    parser.add_argument("--out", default="bench-report", help="folder for report.md, report.json and the plots")


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="target model: path (HF folder or .gguf) or known name")
    add_prompt_arguments(parser, f"all of a file, {DATASET_PROMPTS} of a data set")
    parser.add_argument("--methods", help="comma-separated: plain, ngram, suffix, draft:MODEL, medusa, eagle, each "
                                          "with options :k=K, :adaptive, :tree, :dynamic (heads), :local (suffix), e.g. "
                                          "draft:qwen2.5-coder-0.5b-instruct:k=4 (default: plain, ngram, suffix, the "
                                          "default draft and the shipped heads where the target has them)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs must equal plain's)")
    parser.add_argument("--seed", type=int, default=0, help="every request's seed, when sampling")
    return add_llm_arguments(parser, speculation=False)  # the methods say how to speculate


def load_prompts(args: argparse.Namespace) -> list:
    from specdec.bench.prompts import dataset_prompts, read_prompts

    prompts = read_prompts(args.prompts) if args.prompts else dataset_prompts(args.dataset or "humaneval")
    n = args.num_prompts or (len(prompts) if args.prompts else DATASET_PROMPTS)
    if n < 1:
        raise ValueError("--num-prompts must be >= 1")
    return prompts[:n]


def source_name(args: argparse.Namespace) -> str:
    return Path(args.prompts).name if args.prompts else (args.dataset or "humaneval")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the plots need matplotlib: pip install 'specdec[bench]'") from None


def run_bench(args: argparse.Namespace) -> int:
    """Compare the methods on the prompts; write the report and plots; print the table and the
    recommended serve command. Exit status 1 when a greedy output differed from plain decoding's."""
    from specdec.bench.compare import run_methods, summarize
    from specdec.bench.methods import default_methods, parse_methods
    from specdec.bench.plots import write_plots
    from specdec.bench.report import method_table, recommend, serve_command, warnings, write_report
    from specdec.config import SamplingParams

    methods = parse_methods(args.methods or default_methods(args.model), args.model)
    prompts = load_prompts(args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    require_matplotlib()
    for method in methods:
        if method.spec is not None and method.spec.record.model is Model.DRAFT_MODEL:
            pull_if_needed(method.spec.model)
    llm = build_llm(args, args.model)
    engines = [llm.engine_for(m.spec) for m in methods]
    runs = run_methods(methods, engines, [p.token_ids(llm.tokenizer) for p in prompts], params)
    summaries = summarize(runs, prompts, params.greedy)

    out = Path(args.out)
    dtype = str(llm.dtype).removeprefix("torch.")
    info = {"target": args.model, "source": source_name(args), "prompts": len(prompts), "max_tokens": args.max_tokens,
            "temperature": args.temperature, "setup": f"on {llm.device}, target weights {llm.quantization}, "
                                                      f"activations {dtype}",
            "target_pass_ms": pass_costs(engines)}
    sampling = "greedy" if params.greedy else f"temperature {args.temperature}"
    subtitle = f"{args.model}, {len(prompts)} prompts ({info['source']}), {args.max_tokens} tokens max, {sampling}"
    plots = write_plots(out, summaries, subtitle)
    report = write_report(out, summaries, info, plots)
    print("\n".join(method_table(summaries) + [f"\nwarning: {w}" for w in warnings(summaries)]))
    print(f"\nreport: {report}  plots: {', '.join(str(p) for p in plots)}")
    best = recommend(summaries)
    print(f"recommended: {best.name}\n{serve_command(args.model, best)}")
    return 0 if all(s.identical in (None, len(prompts)) for s in summaries) else 1


def pass_costs(engines) -> dict[int, float]:
    """Milliseconds of a target pass by its rows, as the engines' controllers measured them (running means at the
    depth of their last steps; the lowest across the methods' engines). What verifying a draft of rows - 1 tokens
    costs on this target: flat-ish for a dense model, growing faster for a mixture of experts (each row reads its
    own experts)."""
    seen: dict[int, float] = {}
    for engine in engines:
        for rows, seconds in engine.costs.verify.items():
            seen[rows] = min(seen.get(rows, seconds), seconds)
    return {rows: round(1e3 * seen[rows], 3) for rows in sorted(seen)}


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="the model name to request (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="sent as a bearer token")
    add_prompt_arguments(parser, "all of a file; of a data set, as many as the levels' rounds send")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="rounds per level, new prompts each round")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per round")
    parser.set_defaults(max_tokens=64, out="bench-serve-report")
    return parser


def run_bench_serve(args: argparse.Namespace) -> int:
    """Load-test the server level by level; write the report; print the table."""
    from specdec.bench.serve import load_test, write_serve_report

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency takes numbers >= 1, e.g. 1,4,16")
    if args.num_prompts is None and not args.prompts:
        args.num_prompts = max(levels) * args.requests_per_client * args.rounds
    prompts = load_prompts(args)
    require_matplotlib()
    rows = load_test(args.url, prompts, levels, model=args.model, api_key=args.api_key, max_tokens=args.max_tokens,
                     temperature=args.temperature, requests_per_client=args.requests_per_client,
                     rounds=args.rounds, timeout=args.timeout)
    report = write_serve_report(Path(args.out), rows, {"url": args.url, "source": source_name(args),
                                                       "max_tokens": args.max_tokens, "temperature": args.temperature})
    print(report.read_text())
    print(json.dumps({"benchmark": "serve", "results": rows}))
    return 0 if not any(r["errors"] for r in rows) else 1


def add_bench_agent_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", action="append", required=True,
                        help="a server's base URL (repeat for several; the first is the baseline)")
    parser.add_argument("--name", action="append", help="a name for each --url, in order (default: the URLs)")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the model name to request")
    parser.add_argument("--api-key", help="sent as a bearer token")
    return parser


def run_bench_agent(args: argparse.Namespace) -> int:
    """The session on every server; a table, then one JSON line. Exit status 1 when an edit was wrong."""
    from specdec.bench.agent import run_session, session_table, summary

    names = args.name or args.url
    if len(names) != len(args.url):
        raise ValueError("give one --name per --url, or none")
    results = run_session(dict(zip(names, args.url)), args.model, api_key=args.api_key,
                          progress=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(session_table(results)))
    print(json.dumps({"benchmark": "agent", "results": summary(results)}))
    return 0 if all(r["correct"] for rows in results.values() for r in rows) else 1
