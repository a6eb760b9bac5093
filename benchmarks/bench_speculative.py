"""Speculative decoding vs plain decoding, side by side in one run, on real prompt sets.

    .venv/bin/python benchmarks/bench_speculative.py [--humaneval 4] [--spec-bench 1] [--max-tokens 64]

Configurations (all on the same loaded target, same prompts, taking turns prompt by prompt so that the
machine's drift affects them alike): plain decoding (the baseline); draft model with fixed K = 1..8 and
adaptive; prompt lookup (n-gram); a degraded draft (logits permuted) fixed and adaptive; the shipped
Medusa and EAGLE heads, chain and tree (static and EAGLE-2 dynamic); and, with --transformers, Hugging
Face transformers' plain and assisted generation with the same pair
(fp32, its best path on this CPU). Greedy and temperature 0.7. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import torch

from specdec import LLM, SamplingParams
from specdec.data import DATA_DIR
from specdec.engine import Engine
from specdec.metrics import SpecMetrics
from specdec.speculative.degraded import PermutedLogitsModel
from specdec.heads.modules import load_heads, resolve_heads
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer, default_tree
from specdec.speculative.proposers import DraftModelProposer, NgramProposer
from specdec.speculative.tree import DynamicTree

DATA = DATA_DIR  # the prompt sets shipped with specdec
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


def run_one(engine: Engine, prompt_ids: list[int], params: SamplingParams, request_id: str):
    """One request to its end; returns its final output (metrics included)."""
    engine.add_request(request_id, prompt_ids, params)
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pass
    return out


def transformers_baseline(prompts, params: SamplingParams, assisted: bool) -> tuple[float, int]:
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

    results = []
    print(f"{len(prompts)} prompts ({', '.join(sorted({p[0] for p in prompts}))}), {args.max_tokens} tokens each; "
          f"target {TARGET} ({llm.quantization}, {llm.dtype}), draft {DRAFT} ({llm.draft_quantization})")
    wanted = {c.strip() for c in args.configs.split(",") if c.strip()} | {"plain"}  # plain: always, the baseline
    # the heads never saw these prompts: they are trained on HumanEval 100+ and the second half of each
    # Spec-Bench category (specdec.heads.train.prompt_split); the check above keeps it so
    for temp in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0)
        # every config keeps its own engine (its controller learns across requests, as a server's would);
        # the configs take turns prompt by prompt, so the machine's drift spreads over all of them alike
        engines = {name: make() for name, make in configs() if not args.configs or name in wanted}
        totals = {name: SpecMetrics() for name in engines}
        outputs: dict[str, list] = {name: [] for name in engines}
        for i, (_, ids) in enumerate(prompts):
            for name, engine in engines.items():
                out = run_one(engine, ids, params, str(i))
                totals[name].merge(out.metrics)
                outputs[name].append(out.token_ids)
        base_tps = None
        for name, engine in engines.items():
            m = totals[name]
            seconds = m.draft_time + m.target_time  # decode time: a draft model's prefill counts, the target's not
            tps = m.emitted_tokens / seconds
            base_tps = base_tps or tps
            spec_memory = engine.proposer.memory_bytes if engine.proposer is not None else 0
            row = {
                "temperature": temp, "config": name, "tokens_per_s": round(tps, 2),
                "speedup": round(tps / base_tps, 3), "acceptance_rate": round(m.acceptance_rate, 3),
                "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                "per_position": [round(x, 3) for x in m.per_position_acceptance_rate],
                "draft_share": round(m.draft_time / max(seconds, 1e-9), 3),
                "drafts_per_pass": round(m.num_drafts / max(m.target_passes, 1), 3),
                "exact": outputs[name] == outputs["plain"] if temp == 0 else None,
                "draft_memory_mb": round(spec_memory / 2**20, 1),
            }
            results.append(row)
            print(f"T={temp:<4} {name:20} {tps:7.2f} tok/s  x{row['speedup']:<6} accept {row['acceptance_rate']:<6} "
                  f"len {row['mean_acceptance_length']:<6} draft-time {row['draft_share']:<6} "
                  f"mem {row['draft_memory_mb']:>6} MB "
                  f"exact {row['exact']}  per-pos {row['per_position']}", flush=True)
        del engines
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
