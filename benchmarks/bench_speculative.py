"""Speculative decoding vs plain decoding, side by side in one run, on real prompt sets: `specdec bench`'s
measurement (`specdec.bench.compare`) over a sweep of configurations of the default pair.

    .venv/bin/python benchmarks/bench_speculative.py [--humaneval 4] [--spec-bench 1] [--max-tokens 64]

Configurations (all on the same loaded target, same prompts, taking turns prompt by prompt so that the
machine's drift affects them alike), named as `specdec bench --methods` names them: plain decoding (the
baseline); draft model with fixed K = 1..8 and adaptive; prompt lookup (n-gram); a degraded draft (logits
permuted) fixed and adaptive; the shipped Medusa and EAGLE heads, chain and tree (static and EAGLE-2
dynamic); and, with --transformers, Hugging Face transformers' plain and assisted generation with the
same pair (fp32, its best path on this CPU). Greedy and temperature 0.7. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import LLM, SamplingParams
from specdec.api import load_model
from specdec.bench.compare import run_methods, summarize
from specdec.bench.methods import Method, parse_method
from specdec.bench.prompts import dataset_prompts
from specdec.engine import Engine
from specdec.models.quant import resolve_quantization
from specdec.speculative.draft_model import DraftModelProposer
from specdec.testing.degraded import PermutedLogitsModel

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MAX_MODEL_LEN = 2048


def method_names(ks: list[int]) -> list[str]:
    return ["plain", *(f"draft:{DRAFT}:k={k}" for k in ks), f"draft:{DRAFT}:k=5:adaptive",
            f"draft:{DRAFT}:k=8:adaptive", "ngram:k=5", "degraded:k=5", "degraded:k=5:adaptive",
            *(f"medusa:k={k}" for k in (1, 2, 3)), "medusa:k=3:tree",
            *(f"eagle:k={k}" for k in (1, 2, 3, 4)), "eagle:k=3:tree", "eagle:k=4:dynamic"]


def build(llm: LLM, name: str, bad_draft) -> tuple[Method, Engine]:
    """The method and a fresh engine for it; `degraded:...` is the draft model with its logits permuted."""
    if not name.startswith("degraded:"):
        method = parse_method(name, TARGET)
        return method, llm.engine_for(method.spec)
    spec = parse_method(name.replace("degraded:", f"draft:{DRAFT}:"), TARGET).spec
    proposer = DraftModelProposer(bad_draft, 1, MAX_MODEL_LEN)
    engine = Engine(llm.target, llm.tokenizer, proposer, num_speculative_tokens=spec.num_speculative_tokens,
                    adaptive=spec.adaptive, max_model_len=MAX_MODEL_LEN)
    return Method(name, spec), engine


def transformers_baseline(prompt_ids, params: SamplingParams, assisted: bool) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from specdec.models.store import resolve_model

    def load(name: str):
        p = resolve_model(name)  # a pulled known name -> its .gguf file; transformers dequantizes it (needs `gguf`)
        if p.is_dir():
            return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)

    target = load(TARGET)
    draft = load(DRAFT) if assisted else None
    seconds, tokens = 0.0, 0
    for ids in prompt_ids:
        kw = dict(max_new_tokens=params.max_tokens, do_sample=not params.greedy)
        if not params.greedy:
            kw.update(temperature=params.temperature)
        if draft is not None:
            kw["assistant_model"] = draft
        t0 = time.perf_counter()
        out = target.generate(torch.tensor([ids]), **kw)
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - len(ids)
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--spec-bench", type=int, default=0, help="prompts per Spec-Bench category")
    ap.add_argument("--categories", default="coding,writing,math_reasoning,translation,summarization,qa,rag")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3,4,5,6,8")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--transformers", action="store_true", help="add transformers' plain and assisted generation")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--configs", default="", help="comma-separated names to run, e.g. draft:"
                                                  f"{DRAFT}:k=4,medusa:k=1 (default: all; plain always runs)")
    args = ap.parse_args()
    if args.humaneval > 100 or args.spec_bench > 5:
        raise SystemExit("--humaneval <= 100 and --spec-bench <= 5: the rest is the heads' training split")

    llm = LLM(TARGET, quantization=args.quantization, max_model_len=MAX_MODEL_LEN)
    prompts = dataset_prompts("humaneval")[:args.humaneval]
    for category in (args.categories.split(",") if args.spec_bench else []):
        prompts += dataset_prompts(f"spec-bench:{category}")[:args.spec_bench]
    prompt_ids = [p.token_ids(llm.tokenizer) for p in prompts]
    draft_quantization = resolve_quantization("auto", llm.device)
    bad_draft = PermutedLogitsModel(load_model(DRAFT, llm.dtype, llm.device, draft_quantization)[0])
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    names = [n for n in method_names([int(k) for k in args.ks.split(",")]) if not wanted or n in {*wanted, "plain"}]
    names += [n for n in wanted if n not in names]  # any other `specdec bench --methods` name
    print(f"{len(prompts)} prompts ({', '.join(sorted({p.category for p in prompts}))}), {args.max_tokens} tokens "
          f"each; target {TARGET} ({llm.quantization}, {llm.dtype}), draft {DRAFT} ({draft_quantization})")
    results = []
    # the heads never saw these prompts: they are trained on HumanEval 100+ and the second half of each
    # Spec-Bench category (specdec.training.prompt_split); the check above keeps it so
    for temp in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0)
        methods, engines = zip(*(build(llm, name, bad_draft) for name in names))
        runs = run_methods(list(methods), list(engines), prompt_ids, params)
        del engines  # and their drafts' caches, before transformers loads its models
        for s in summarize(runs, prompts, params.greedy):
            row = {"temperature": temp, **s.to_dict()}
            results.append(row)
            print(f"T={temp:<4} {s.name:45} {s.tokens_per_s:7.2f} tok/s  x{s.speedup:<6.3f} accept "
                  f"{s.pooled.acceptance_rate:<6.3f} len {s.tokens_per_pass:<6.3f} draft-time {s.time_split[0]:<6.3f} "
                  f"mem {s.memory_bytes / 2**20:>6.1f} MB  exact {s.identical}  "
                  f"per-pos {[round(x, 3) for x in s.per_position]}", flush=True)
        if args.transformers:
            base_tps = results[-len(runs)]["tokens_per_s"]
            for assisted in (False, True):
                seconds, tokens = transformers_baseline(prompt_ids, params, assisted)
                name = "transformers assisted" if assisted else "transformers plain"
                tps = tokens / seconds
                results.append({"temperature": temp, "method": name, "tokens_per_s": round(tps, 2),
                                "speedup": round(tps / base_tps, 3)})
                print(f"T={temp:<4} {name:45} {tps:7.2f} tok/s  x{tps / base_tps:.3f} (fp32, incl. prefill)",
                      flush=True)
    print(json.dumps({"benchmark": "speculative", "prompts": len(prompts), "max_tokens": args.max_tokens,
                      "results": results}))


if __name__ == "__main__":
    main()
