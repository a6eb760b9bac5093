"""Does training's held-out figure say what the engine does? Per EAGLE head, on the target's own greedy answers
to HumanEval's first N eval-split prompts: held-out top-1 per step, the mean over positions and the walk of
`evaluate_chains` (what `specdec train-heads --held-out-text answers` reports), and the engine's tokens per pass
with a fixed chain of the same length (no adaptive K) on the same prompts, side by side.

    .venv/bin/python benchmarks/bench_head_walk.py [--humaneval 12] [--max-tokens 128] [--k 3]
        [--heads qwen2.5-coder-1.5b-instruct-eagle3,PATH...] [--feature-layers 2 14] [--features DIR]

A head is a shipped name or a folder (`specdec train-heads --out`). An EAGLE-1 head is evaluated as the EAGLE-3
head that starts from it (`EagleHead.init_from_eagle`: the same drafts). The answers and their features are
kept in --features (default: a folder per N, length and layers under the system's temporary folder), so a
second run reads them. The engine's outputs are checked against the answers, which are plain greedy decoding's.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdec import LLM, SamplingParams
from specdec.bench.compare import decode
from specdec.config import SpeculativeConfig
from specdec.heads.files import read_heads_config, resolve_heads
from specdec.training.losses import evaluate_chains
from specdec.training.train import TrainConfig, _eagle_start, _trainable_heads, held_out_windows

TARGET = "qwen2.5-coder-1.5b-instruct"


def training_head(folder: Path, llm: LLM, cfg: TrainConfig):
    """The head in `folder` as training evaluates it (float, on the CPU), EAGLE-1 heads as their EAGLE-3 start."""
    config = read_heads_config(folder)
    if config.method != "eagle":
        raise ValueError(f"{folder} holds {config.method} heads: this bench walks EAGLE heads")
    if not config.feature_layers:
        start = _eagle_start(folder, llm.target)
        head = _trainable_heads(llm.target, TARGET, cfg, start.vocab_ids)
        head.init_from_eagle(start)
        return head
    if tuple(config.feature_layers) != cfg.feature_layers:
        raise ValueError(f"{folder} fuses layers {config.feature_layers}; run with --feature-layers to match")
    state = load_file(str(folder / "model.safetensors"))
    head = _trainable_heads(llm.target, TARGET, cfg, state["vocab_ids"], config.intermediate_size)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--humaneval", type=int, default=12, help="HumanEval eval-split prompts 0..N-1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="the chain's drafted tokens (training's steps)")
    ap.add_argument("--heads", default=f"{TARGET}-eagle3", help="comma-separated shipped names or folders")
    ap.add_argument("--feature-layers", type=int, nargs="*", default=[2, 14])
    ap.add_argument("--features", help="where the answers and their features are kept")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = tuple(args.feature_layers)
    features = Path(args.features) if args.features else Path(tempfile.gettempdir()) / "specdec-head-walk" / \
        f"humaneval{args.humaneval}-tokens{args.max_tokens}-layers{'_'.join(map(str, layers)) or 'none'}"
    llm = LLM(TARGET, num_speculative_tokens=0, max_model_len=2048)
    cfg = TrainConfig(method="eagle", out=features.parent, features=features, feature_layers=layers,
                      held_out_tasks=args.humaneval, held_out_text="answers", self_distill_tokens=args.max_tokens)
    windows = held_out_windows(llm.target, llm.tokenizer, cfg)
    answers = [w["tokens"][w["scored_from"] + 1:].tolist() for w in windows]
    prompts = [w["tokens"][: w["scored_from"] + 1].tolist() for w in windows]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for name in [h.strip() for h in args.heads.split(",") if h.strip()]:
        folder = Path(resolve_heads(name))
        with torch.inference_mode(False), torch.enable_grad():
            head = training_head(folder, llm, cfg)
            to_reduced = torch.full((llm.target.config.vocab_size,), -100, dtype=torch.long)
            to_reduced[head.vocab_ids] = torch.arange(len(head.vocab_ids))
            top1, mean, walk = evaluate_chains(head, windows, to_reduced, args.k)
        engine = llm.engine_for(SpeculativeConfig(method="eagle", model=str(folder), num_speculative_tokens=args.k,
                                                    adaptive=False))
        emitted = passes = 0
        equal = True
        for ids, answer in zip(prompts, answers):
            out = decode(engine, ids, params)
            emitted, passes = emitted + out.metrics.emitted_tokens, passes + out.metrics.target_passes
            equal &= out.token_ids == answer
        rows.append({"head": name, "top1_per_step": top1, "mean_over_positions": mean, "walk": walk,
                     "engine_tokens_per_pass": round(emitted / max(passes, 1), 4), "engine_passes": passes,
                     "outputs_equal_plain": equal})
    print(f"HumanEval 0-{args.humaneval - 1}, the target's greedy answers ({args.max_tokens} tokens at most), "
          f"a chain of {args.k}")
    print(f"{'head':48s} {'top-1 per step':24s} {'mean':>6s} {'walk':>6s} {'engine':>7s} {'= plain':>8s}")
    for r in rows:
        steps = " / ".join(f"{a:.3f}" for a in r["top1_per_step"])
        print(f"{r['head'][-48:]:48s} {steps:24s} {r['mean_over_positions']:6.3f} {r['walk']:6.3f} "
              f"{r['engine_tokens_per_pass']:7.3f} {str(r['outputs_equal_plain']):>8s}")
    print(json.dumps({"bench": "head_walk", "humaneval": args.humaneval, "max_tokens": args.max_tokens, "k": args.k,
                      "scored_positions": sum(len(w["tokens"]) - w["scored_from"] for w in windows), "heads": rows}))


if __name__ == "__main__":
    main()
