"""Speculative decoding vs plain decoding, side by side in one run, on real prompt sets.

    .venv/bin/python benchmarks/bench_speculative.py [--humaneval 4] [--spec-bench 1] [--max-tokens 64]

Configurations (all on the same loaded target, same prompts): plain decoding, first and last (the
baseline is their mean; their difference shows how much the machine drifted during the run); draft
model with fixed K = 1..8 and adaptive; prompt lookup (n-gram); a degraded draft (logits permuted)
fixed and adaptive; the shipped Medusa and EAGLE heads, chain and tree (static and EAGLE-2 dynamic);
and, with --transformers, Hugging Face transformers' plain and assisted generation with the same pair
(fp32, its best path on this CPU). Greedy and temperature 0.7. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.engine import Engine
from specdec.metrics import SpecMetrics
from specdec.speculative.degraded import PermutedLogitsModel
from specdec.heads.modules import load_heads, resolve_heads
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
from specdec.speculative.proposers import DraftModelProposer, NgramProposer
from specdec.speculative.tree import DynamicTree

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def load_prompts(tokenizer, n_humaneval: int, per_category: int) -> list[tuple[str, list[int]]]:
    """HumanEval completions (raw prompts) and Spec-Bench questions (chat template), by task."""
    out = []
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        for row in [json.loads(line) for line in f][:n_humaneval]:
            out.append(("humaneval", tokenizer.encode(row["prompt"])))
    with open(DATA / "spec_bench" / "question.jsonl") as f:
        rows = [json.loads(line) for line in f]
    seen: dict[str, int] = {}
    for row in rows:
        cat = row["category"]
        if seen.get(cat, 0) < per_category:
            seen[cat] = seen.get(cat, 0) + 1
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}])
            out.append((f"spec_bench/{cat}", tokenizer.encode(text)))
    return out


def run_engine(engine: Engine, prompts, params: SamplingParams) -> tuple[float, SpecMetrics, list[list[int]]]:
    # the heads never saw these prompts: they are trained on HumanEval 100+ and the second half of each
    # Spec-Bench category (specdec.heads.train.prompt_split)
    """Sequential requests; returns decode seconds (prefill excluded), metrics, outputs."""
    total = SpecMetrics()
    outputs = []
    for i, (_, ids) in enumerate(prompts):
        engine.add_request(str(i), ids, params)
        out = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                pass
        out.metrics.total_time = out.metrics.total_time or 0.0
        total.merge(out.metrics)
        outputs.append(out.token_ids)
    decode = total.draft_time + total.target_time
    return decode, total, outputs


def transformers_baseline(prompts, params: SamplingParams, assisted: bool) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from specdec.models.store import resolve_model

    target = AutoModelForCausalLM.from_pretrained(str(resolve_model(TARGET)), dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(str(resolve_model(DRAFT)), dtype=torch.float32) if assisted else None
    seconds, tokens = 0.0, 0
    for _, ids in prompts:
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
    ap.add_argument("--configs", default="", help="comma-separated config names to run (default: all)")
    args = ap.parse_args()

    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=5, quantization=args.quantization,
              max_model_len=2048)
    prompts = load_prompts(llm.tokenizer, args.humaneval, args.spec_bench)
    cats = set(args.categories.split(","))
    prompts = [p for p in prompts if p[0] == "humaneval" or p[0].split("/")[1] in cats]
    if args.humaneval > 100 or args.spec_bench > 5:
        raise SystemExit("--humaneval <= 100 and --spec-bench <= 5: the rest is the heads' training split")
    target, draft = llm.target, llm.draft_model
    bad_draft = PermutedLogitsModel(draft)
    vocab = target.config.vocab_size
    medusa = load_heads(resolve_heads(f"{TARGET}-medusa"), target, "medusa")
    eagle = load_heads(resolve_heads(f"{TARGET}-eagle"), target, "eagle")

    def heads_engine(method: str, k: int, tree=None):
        proposer = MedusaProposer(medusa, vocab, tree, max_depth=k) if method == "medusa" else \
            EagleProposer(eagle, vocab, 1, 2048, tree, max_depth=k)
        return Engine(target, llm.tokenizer, proposer, k, max_model_len=2048)

    def configs():
        yield "plain", lambda: Engine(target, llm.tokenizer, None, 0, max_model_len=2048)
        for k in [int(k) for k in args.ks.split(",")]:
            yield f"draft K={k}", lambda k=k: Engine(target, llm.tokenizer, DraftModelProposer(draft, 1, 2048), k,
                                                     max_model_len=2048)
        yield "draft adaptive<=5", lambda: Engine(target, llm.tokenizer, DraftModelProposer(draft, 1, 2048), 5,
                                                  adaptive=True, max_model_len=2048)
        yield "draft adaptive<=8", lambda: Engine(target, llm.tokenizer, DraftModelProposer(draft, 1, 2048), 8,
                                                  adaptive=True, max_model_len=2048)
        yield "ngram K=5", lambda: Engine(target, llm.tokenizer, NgramProposer(), 5, max_model_len=2048)
        yield "degraded K=5", lambda: Engine(target, llm.tokenizer, DraftModelProposer(bad_draft, 1, 2048), 5,
                                             max_model_len=2048)
        yield "degraded adaptive", lambda: Engine(target, llm.tokenizer, DraftModelProposer(bad_draft, 1, 2048), 5,
                                                  adaptive=True, max_model_len=2048)
        for k in (1, 2, 3):
            yield f"medusa K={k}", lambda k=k: heads_engine("medusa", k)
        yield "medusa tree", lambda: heads_engine("medusa", 3, default_tree(3))
        for k in (1, 2, 3, 4):
            yield f"eagle K={k}", lambda k=k: heads_engine("eagle", k)
        yield "eagle tree", lambda: heads_engine("eagle", 3, default_tree(3))
        yield "eagle dynamic", lambda: heads_engine("eagle", 4, DynamicTree(top_k=2, beam=1))
        yield "plain (again)", lambda: Engine(target, llm.tokenizer, None, 0, max_model_len=2048)

    results = []
    print(f"{len(prompts)} prompts ({', '.join(sorted({p[0] for p in prompts}))}), {args.max_tokens} tokens each; "
          f"target {TARGET} ({llm.quantization}, {llm.dtype}), draft {DRAFT} ({llm.draft_quantization})")
    for temp in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0)
        plain_out = None
        wanted = {c.strip() for c in args.configs.split(",") if c.strip()} | {"plain", "plain (again)"}
        rows = []
        for name, make in configs():
            if args.configs and name not in wanted:  # plain runs first and last: the baseline and its drift
                continue
            engine = make()
            seconds, m, outs = run_engine(engine, prompts, params)
            spec_memory = engine.proposer.memory_bytes if engine.proposer is not None else 0
            plain_out = plain_out or outs
            rows.append({
                "temperature": temp, "config": name, "tokens_per_s": round(m.emitted_tokens / seconds, 2),
                "acceptance_rate": round(m.acceptance_rate, 3),
                "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                "per_position": [round(x, 3) for x in m.per_position_acceptance_rate],
                "draft_share": round(m.draft_time / max(seconds, 1e-9), 3),
                "drafts_per_pass": round(m.num_drafts / max(m.target_passes, 1), 3),
                "exact": outs == plain_out if temp == 0 else None,
                "draft_memory_mb": round(spec_memory / 2**20, 1),
            })
            r = rows[-1]
            print(f"T={temp:<4} {name:20} {r['tokens_per_s']:7.2f} tok/s  accept {r['acceptance_rate']:<6} "
                  f"len {r['mean_acceptance_length']:<6} draft-time {r['draft_share']:<6} "
                  f"mem {r['draft_memory_mb']:>6} MB exact {r['exact']}  per-pos {r['per_position']}", flush=True)
        # the baseline: plain decoding's mean over the first and the last run (the machine drifts)
        plains = [r["tokens_per_s"] for r in rows if r["config"] in ("plain", "plain (again)")]
        base_tps = sum(plains) / len(plains)
        print(f"T={temp:<4} baseline {base_tps:.2f} tok/s (plain first/last {plains[0]:.2f}/{plains[-1]:.2f}: "
              f"drift {plains[-1] / plains[0] - 1:+.1%})")
        for r in rows:
            r["speedup"] = round(r["tokens_per_s"] / base_tps, 3)
            print(f"T={temp:<4} {r['config']:20} x{r['speedup']:<6}")
        results += rows
        if args.transformers:
            for assisted in (False, True):
                seconds, tokens = transformers_baseline(prompts, params, assisted)
                name = "transformers assisted" if assisted else "transformers plain"
                tps = tokens / seconds
                results.append({"temperature": temp, "config": name, "tokens_per_s": round(tps, 2),
                                "speedup": round(tps / base_tps, 3)})
                print(f"T={temp:<4} {name:20} {tps:7.2f} tok/s  x{tps / base_tps:.3f} (fp32, incl. prefill)", flush=True)
    print(json.dumps({"benchmark": "speculative", "prompts": len(prompts), "max_tokens": args.max_tokens,
                      "results": results}))


if __name__ == "__main__":
    main()
