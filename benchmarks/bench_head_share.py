"""The heads' share of decode time, before and after, side by side in one run.

    .venv/bin/python benchmarks/bench_head_share.py [--humaneval 3] [--max-tokens 48] [--methods eagle:k=2]
        [--baseline 28814d9]

Each method runs twice on the one loaded target, the engines taking turns prompt by prompt (as
`specdec bench` does, so that the machine's drift hits both alike): with the head proposers and head
modules of this checkout, and with those of the git revision `--baseline` (its
`speculative/head_proposers.py` and `heads/modules.py`, loaded as modules of their own beside this checkout's
package; default 28814d9, the proposers before the head passes were batched: one head pass a sequence and
depth over every node so far, one output-layer call a sequence and depth). Plain decoding is the reference
for speed and for exactness. Per method: decode tokens/s, the share of decode time spent drafting (the head's
prompt feed included), the mean draft per step relative to a target pass, and whether the greedy outputs
equal plain decoding's. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.bench.compare import run_methods, summarize
from specdec.bench.methods import Method, parse_method
from specdec.bench.prompts import dataset_prompts
from specdec.engine import Engine
from specdec.speculative.build import tree_of
from specdec.speculative.head_proposers import EagleProposer, MedusaProposer

TARGET = "qwen2.5-coder-1.5b-instruct"
MAX_MODEL_LEN = 2048
ROOT = Path(__file__).resolve().parent.parent


def baseline_modules(rev: str):
    """This revision's heads/modules.py and speculative/head_proposers.py, imported as modules of their own
    (`specdec_baseline_modules`, `specdec_baseline_head_proposers`) resolving their imports in this checkout."""
    out = []
    folder = Path(tempfile.mkdtemp(prefix="specdec-baseline-"))
    for rel, name in (("heads/modules.py", "specdec_baseline_modules"),
                      ("speculative/head_proposers.py", "specdec_baseline_head_proposers")):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/specdec/{rel}"], check=True,
                              capture_output=True, text=True).stdout
        # (ModelConfig has refused architectures it does not know since the families' table: a head's layer is
        # a Llama decoder layer, as this checkout's heads name it; the only change made to the revision's code)
        text = text.replace('architecture="EagleHead"', 'architecture="LlamaForCausalLM"')
        path = folder / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        out.append(module)
    return out


def engine(llm: LLM, method: Method, modules, proposers) -> Engine:
    """An engine for a medusa/eagle `method` with the head module and proposer classes given."""
    spec = method.spec
    heads = modules.load_heads(modules.resolve_heads(spec.model), llm.target, spec.method)
    k, tree = spec.num_speculative_tokens, tree_of(spec)
    vocab = llm.target.config.vocab_size
    if spec.method == "medusa":
        proposer = proposers.MedusaProposer(heads, vocab, tree, max_depth=k)
    else:
        proposer = proposers.EagleProposer(heads, vocab, 1, MAX_MODEL_LEN, tree, max_depth=k)
    return Engine(llm.target, llm.tokenizer, proposer, num_speculative_tokens=k, max_model_len=MAX_MODEL_LEN,
                  adaptive=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--humaneval", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--methods", default="eagle:k=2", help="comma-separated medusa/eagle methods (specdec bench names)")
    ap.add_argument("--baseline", default="28814d9", help="the git revision whose head code runs beside this one")
    args = ap.parse_args()
    if args.humaneval > 100:
        raise SystemExit("--humaneval <= 100: the rest is the heads' training split")

    llm = LLM(TARGET, num_speculative_tokens=0, max_model_len=MAX_MODEL_LEN)
    prompts = dataset_prompts("humaneval")[:args.humaneval]
    prompt_ids = [p.token_ids(llm.tokenizer) for p in prompts]
    old_modules, old_proposers = baseline_modules(args.baseline)
    import specdec.heads.files as new_modules  # (load_heads, resolve_heads: in heads/modules.py before)
    import specdec.speculative.head_proposers as new_proposers

    methods, engines = [Method("plain", None)], [llm.engine_for(None)]
    for name in [n.strip() for n in args.methods.split(",") if n.strip()]:
        method = parse_method(name, TARGET)
        if method.spec.method not in ("medusa", "eagle"):
            raise SystemExit(f"{name}: only medusa and eagle heads have a baseline to compare with")
        for label, modules, proposers in ((args.baseline, old_modules, old_proposers),
                                          ("this checkout", new_modules, new_proposers)):
            methods.append(Method(f"{method.name} ({label})", method.spec))
            engines.append(engine(llm, method, modules, proposers))
    assert isinstance(engines[-1].proposer, (EagleProposer, MedusaProposer))

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, seed=0)
    runs = run_methods(methods, engines, prompt_ids, params)
    rows = []
    print(f"{len(prompts)} HumanEval prompts, {args.max_tokens} tokens each, greedy; target {TARGET}")
    print(f"{'method':44} {'tok/s':>7} {'speedup':>8} {'draft share':>12} {'draft/pass':>11} {'len':>6} exact")
    for s in summarize(runs, prompts, greedy=True):
        m = s.pooled
        draft_per_pass = m.draft_time / m.target_time  # a step's draft over its target pass, on average
        rows.append({"method": s.name, "tokens_per_s": round(s.tokens_per_s, 3), "speedup": round(s.speedup, 4),
                     "draft_share": round(s.time_split[0], 4), "draft_per_target_pass": round(draft_per_pass, 4),
                     "tokens_per_pass": round(s.tokens_per_pass, 3), "identical": s.identical,
                     "draft_time_s": round(m.draft_time, 4), "target_time_s": round(m.target_time, 4),
                     "target_passes": m.target_passes})
        print(f"{s.name:44} {s.tokens_per_s:7.2f} {s.speedup:8.3f} {100 * s.time_split[0]:11.1f}% "
              f"{draft_per_pass:11.3f} {s.tokens_per_pass:6.3f} {s.identical}/{len(prompts)}")
    print(json.dumps({"benchmark": "head_share", "baseline": args.baseline, "prompts": len(prompts),
                      "max_tokens": args.max_tokens, "results": rows}))


if __name__ == "__main__":
    main()
