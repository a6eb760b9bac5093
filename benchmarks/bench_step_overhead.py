"""The engine's own cost per step: wall time of `Engine.step` less the time in model forwards, on a tiny
random model (so that what is measured is the engine's Python: scheduling, proposing, judging, stop rules,
text, metrics, the controller), for plain decoding, n-gram and draft-model speculation, batches of 1 and 4.

    python benchmarks/bench_step_overhead.py [--rounds 5] [--compare-with OTHER_CHECKOUT]

With `--compare-with`, the same measurement runs alternately on this checkout's `src` and the other's
(each round one after the other, in fresh processes, the order swapped every round), so the two are
compared side by side on one machine at one time; the table gives each one's median over the rounds and
the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [("plain", 1), ("plain", 4), ("ngram", 1), ("ngram", 4), ("draft", 1), ("draft", 4)]
K = 5
MAX_TOKENS = 48
REQUESTS = 16  # measured per configuration


class _Tokenizer:
    eos_token_ids = (96,)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i in self.eos_token_ids))


def _model(seed: int):
    import torch

    from specdec.config import ModelConfig
    from specdec.models.llama import Transformer

    torch.manual_seed(seed)
    config = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         attention_bias=True, eos_token_ids=(96,))
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
    return model.eval()


def _timed(model, clock: list[float]):
    """Wrap `model.forward` to add the time of each call to clock[0]."""
    forward = model.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        clock[0] += time.perf_counter() - t0
        return out

    model.forward = timed
    return model


def measure() -> dict[str, float]:
    """Microseconds of engine overhead per step, per configuration (this process's `specdec`)."""
    import torch

    from specdec.config import SamplingParams
    from specdec.engine import Engine
    from specdec.speculative.draft_model import DraftModelProposer
    from specdec.speculative.proposers import NgramProposer

    torch.set_num_threads(1)
    results = {}
    for kind, batch in CONFIGS:
        clock = [0.0]
        target = _timed(_model(0), clock)
        proposer = None
        if kind == "ngram":
            proposer = NgramProposer()
        elif kind == "draft":
            proposer = DraftModelProposer(_timed(_model(1), clock), batch, 512)
        engine = Engine(target, _Tokenizer(), proposer, num_speculative_tokens=K if proposer is not None else 0,
                        max_model_len=512, max_batch_size=batch)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        with torch.inference_mode():
            for i in range(batch):  # warm-up
                engine.add_request(f"w{i}", [(7 * i + j) % 90 for j in range(24)], params)
            while engine.has_unfinished_requests():
                engine.step()
            clock[0], steps, t0 = 0.0, 0, time.perf_counter()
            for i in range(REQUESTS):  # measured: REQUESTS requests, `batch` at a time
                engine.add_request(str(i), [(7 * i + j) % 90 for j in range(24)], params)
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        results[f"{kind} B={batch}"] = (time.perf_counter() - t0 - clock[0]) / steps * 1e6
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare-with", type=Path, help="another checkout, measured alternately with this one")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one round, JSON out
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return 0
    trees = {"this": Path(__file__).resolve().parents[1]}
    if args.compare_with:
        trees["other"] = args.compare_with.resolve()
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees.items())
        for name, tree in order if r % 2 == 0 else order[::-1]:  # ABBA: whoever runs first has no edge
            env = {**os.environ, "PYTHONPATH": str(tree / "src")}
            out = subprocess.run([sys.executable, __file__, "--measure"], env=env, check=True, capture_output=True,
                                 text=True).stdout
            rounds[name].append(json.loads(out.strip().splitlines()[-1]))
    medians = {name: {c: statistics.median(r[c] for r in rs) for c in rs[0]} for name, rs in rounds.items()}
    configs = list(medians["this"])
    header = f"{'config':<10}" + "".join(f"{name + ' us/step':>18}" for name in trees)
    print(header + (f"{'this / other':>14}" if "other" in trees else ""))
    for c in configs:
        line = f"{c:<10}" + "".join(f"{medians[name][c]:>18.0f}" for name in trees)
        if "other" in trees:
            line += f"{medians['this'][c] / medians['other'][c]:>14.2f}"
        print(line)
    summary = {"rounds": args.rounds, "us_per_step": medians}
    if "other" in trees:
        summary["ratio_this_over_other"] = {c: round(medians["this"][c] / medians["other"][c], 3) for c in configs}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
