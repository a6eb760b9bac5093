"""`specdec generate | serve | bench | models | convert | train-heads`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specdec.llm_args import add_llm_arguments, add_weight_arguments, build_llm
from specdec.methods import METHODS


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.config import SamplingParams

    llm = build_llm(args, args.model, args.speculative_model)
    if args.memory_report:
        print(llm.memory_plan.report())
        return 0
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, stop=tuple(args.stop or ()),
    )
    tok = llm.tokenizer
    if args.chat:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
    else:
        ids = tok.encode(args.prompt, add_special_tokens=True)
    engine = llm.engine
    engine.add_request("cli", ids, params)
    start = time.perf_counter()
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not args.json:
                print(out.new_text, end="", flush=True)
    elapsed = time.perf_counter() - start
    m = out.metrics
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "elapsed_s": round(elapsed, 3), "metrics": m.to_dict()}))
        return 0
    summary = f"{len(out.token_ids)} tokens in {elapsed:.2f}s: {len(out.token_ids) / elapsed:.2f} tokens/s " \
              f"(decode {m.tokens_per_second:.2f} tokens/s, prefill {m.prefill_time:.2f}s)"
    if llm.spec is not None:
        summary += f"; acceptance rate {m.acceptance_rate:.2f}, mean acceptance length " \
                   f"{m.mean_acceptance_length:.2f}, {m.target_passes} target passes"
    print(f"\n\n[{summary}]", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specdec.models.store import list_models, pull

    if args.action == "pull":
        for name in args.names:
            print(pull(name))
        return 0
    for row in list_models():
        print(f"{row['name']:32} {row['role']:8} {'pulled' if row['pulled'] else 'not pulled':11} {row.get('path') or ''}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from specdec.models.loading import convert_gguf

    print(convert_gguf(args.gguf, args.out_dir))
    return 0


def cmd_train_heads(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from specdec.api import default_device, load_model
    from specdec.data import DATA_DIR
    from specdec.models.loading import resolve_dtype
    from specdec.models.quant import resolve_quantization
    from specdec.models.store import KNOWN_MODELS, pull
    from specdec.heads.files import resolve_heads
    from specdec.training import TrainConfig, train_heads

    if args.model in KNOWN_MODELS:
        pull(args.model)
    device = torch.device(args.device) if args.device else default_device()
    quantization = resolve_quantization(args.quantization, device)
    dtype = torch.bfloat16 if quantization != "none" else resolve_dtype(args.dtype, device)
    target, tokenizer, _ = load_model(args.model, dtype, device, quantization)
    cfg = TrainConfig(
        method=args.method, out=Path(args.out), features=Path(args.features) if args.features else None,
        corpus_tokens=args.corpus_tokens, self_distill_prompts=args.self_distill_prompts,
        self_distill_tokens=args.self_distill_tokens, seq_len=args.seq_len, vocab_size=args.vocab_size,
        num_heads=args.num_heads, intermediate_size=args.intermediate_size, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr,
        eagle_cls_weight=args.cls_weight, feature_layers=tuple(args.feature_layers), ttt_steps=args.ttt_steps,
        soft_labels=args.soft_labels,
        curve_every=args.curve_every, solutions=args.solutions, distill_batch_size=args.distill_batch_size,
        distill_functions=args.distill_functions,
        held_out_tasks=args.held_out_tasks, held_out_text=args.held_out_text,
        init_from=Path(resolve_heads(args.init_from)) if args.init_from else None, threads=args.threads,
        data_dir=Path(args.data_dir) if args.data_dir else DATA_DIR,
    )
    report = train_heads(target, tokenizer, args.model, cfg)
    print(json.dumps(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`specdec`'s parser, every command but `bench serve` (which `main` parses on its own)."""
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("model", help="target model: path (HF folder or .gguf) or known name")
    gen.add_argument("--prompt", default="")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--memory-report", action="store_true", help="print the memory breakdown and exit")
    add_llm_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    from specdec.server.cli import add_serve_arguments, run_serve

    serve = sub.add_parser("serve", help="OpenAI-compatible server (default: the default model pair)")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)

    from specdec.bench.cli import add_bench_arguments, run_bench

    bench = sub.add_parser("bench", help="compare speculation methods on your prompts: report and plots "
                                         "(`specdec bench serve --help`: load-test a server; `specdec bench "
                                         "agent --help`: an agent's edit session against servers)")
    add_bench_arguments(bench).set_defaults(func=run_bench)

    models = sub.add_parser("models", help="pull or list known models")
    models.add_argument("action", choices=["pull", "list"])
    models.add_argument("names", nargs="*")
    models.set_defaults(func=cmd_models)

    conv = sub.add_parser("convert", help="convert a GGUF file to a Hugging Face folder (safetensors)")
    conv.add_argument("gguf")
    conv.add_argument("out_dir")
    conv.set_defaults(func=cmd_convert)

    heads = sub.add_parser("train-heads", help="train Medusa or EAGLE draft heads for a target")
    heads.add_argument("model", help="target model: path or known name")
    heads.add_argument("--method", required=True, choices=[m.name for m in METHODS.values() if m.training])
    heads.add_argument("--out", required=True, help="folder for the heads (resumes from its checkpoint)")
    heads.add_argument("--features", help="folder of cached target features (default OUT/features)")
    heads.add_argument("--corpus-tokens", type=int, default=24_000, help="standard-library tokens")
    heads.add_argument("--self-distill-prompts", type=int, default=24, help="training-split prompts answered by the target")
    heads.add_argument("--self-distill-tokens", type=int, default=128)
    heads.add_argument("--seq-len", type=int, default=256)
    heads.add_argument("--vocab-size", type=int, default=8192, help="reduced output vocabulary")
    heads.add_argument("--num-heads", type=int, default=3, help="Medusa heads")
    heads.add_argument("--soft-labels", type=float, default=0.0,
                       help="EAGLE-3: the share of the loss against the target's distribution over the heads' "
                            "vocabulary instead of its greedy choice alone (0-1)")
    heads.add_argument("--intermediate-size", type=int, default=0,
                       help="EAGLE: units of the head's MLP (default: --init-from's, else 2/3 of the hidden size); "
                            "wider than --init-from's grows that head")
    heads.add_argument("--epochs", type=int, default=4)
    heads.add_argument("--batch-size", type=int, default=4)
    heads.add_argument("--lr", type=float, default=1e-3)
    heads.add_argument("--cls-weight", type=float, default=0.1, help="EAGLE: token loss weight (feature loss: 1)")
    heads.add_argument("--feature-layers", type=int, nargs="*", default=[],
                       help="EAGLE-3 style: target layers fused with the final hidden state (e.g. 2 14)")
    heads.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3: steps of training-time test")
    heads.add_argument("--curve-every", type=int, default=0, help="held-out top-1 every N steps (report's curve)")
    heads.add_argument("--distill-batch-size", type=int, default=4, help="self-distillation requests at a time")
    heads.add_argument("--solutions", type=int, default=0,
                       help="HumanEval training-split tasks (prompt + reference solution) added as windows")
    heads.add_argument("--distill-functions", type=int, default=0,
                       help="the target's own answers (--self-distill-tokens each) to N standard-library "
                            "functions' def line and docstring, added as windows after the others (a rerun "
                            "with a larger N adds the rest)")
    heads.add_argument("--held-out-tasks", type=int, default=0,
                       help="held-out windows: HumanEval eval-split tasks 0..N-1 (prompt + reference solution), "
                            "which no run trains on, and every window trains (default: a random 8%% of them)")
    heads.add_argument("--held-out-text", choices=("solutions", "answers"), default="solutions",
                       help="with --held-out-tasks: the tasks' reference solutions, or the target's own greedy "
                            "answers to their prompts (--self-distill-tokens each), where the report's walk "
                            "figure is the tokens per pass greedy decoding makes")
    heads.add_argument("--init-from", help="EAGLE-3: start from these EAGLE heads, EAGLE-1 or EAGLE-3 over the same "
                                           "--feature-layers (a folder or shipped name)")
    heads.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    heads.add_argument("--data-dir", help="the prompt sets (default: the ones shipped in specdec/data)")
    add_weight_arguments(heads)
    heads.set_defaults(func=cmd_train_heads)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # a command of its own beside `bench TARGET`
        from specdec.bench.cli import add_bench_serve_arguments, run_bench_serve

        bench_serve = argparse.ArgumentParser(prog="specdec bench serve", description="load-test an "
                                              "OpenAI-compatible server with concurrent streaming clients")
        args = add_bench_serve_arguments(bench_serve).parse_args(argv[2:])
        args.func = run_bench_serve
    elif argv[:2] == ["bench", "agent"]:  # likewise
        from specdec.bench.cli import add_bench_agent_arguments, run_bench_agent

        bench_agent = argparse.ArgumentParser(prog="specdec bench agent", description="replay a coding agent's "
                                              "edit session against OpenAI-compatible servers, side by side")
        args = add_bench_agent_arguments(bench_agent).parse_args(argv[2:])
        args.func = run_bench_agent
    else:
        args = build_parser().parse_args(argv)
    from specdec.engine.memory import MemoryBudgetError

    try:
        return args.func(args)
    except (ValueError, LookupError, FileExistsError, FileNotFoundError, NotImplementedError,
            MemoryBudgetError) as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
