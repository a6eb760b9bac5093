"""What the fp32 residual stream costs on the block kernels: the same model with its residual stream, norms and
matrix outputs in fp32 (the default) and in bf16 (`SPECDEC_FP32_RESIDUAL=0`), side by side in one process,
rounds alternating: prefill of a prompt in 512-token chunks, and greedy decoding one token a pass. The K/V cache
is bf16 in both (the bf16 side widens the fp32 norms at each call). Accuracy: benchmarks/bench_accuracy.py.

    python benchmarks/bench_residual.py [--model qwen2.5-coder-1.5b-instruct] [--prompt 512] [--decode 64]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.kernels import qgemm
from specdec.models.loading import load_quantized
from specdec.models.store import resolve_model


def run(model, prompt: list[int], decode: int, chunk: int = 512) -> tuple[float, float]:
    """Seconds to prefill `prompt` and to decode `decode` greedy tokens after it."""
    with torch.inference_mode():
        cache = model.new_cache(1, len(prompt) + decode + 1)
        t0 = time.perf_counter()
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            logits = model(torch.tensor([part]), torch.arange(start, start + len(part))[None], cache, num_logits=1)
            cache.advance(0, len(part))
        t1 = time.perf_counter()
        token = int(logits[0, -1].argmax())
        for i in range(decode):
            pos = len(prompt) + i
            token = int(model(torch.tensor([[token]]), torch.tensor([[pos]]), cache)[0, -1].argmax())
            cache.advance(0, 1)
        return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    _, model, _ = load_quantized(resolve_model(args.model), "gguf", residual_dtype=torch.float32)
    prompt = torch.randint(100, 20000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    wide = model.residual_dtype
    times = {"fp32": [], "bf16": []}
    run(model, prompt[:64], 4)  # warm-up
    for _ in range(args.rounds):
        for name, dtype in (("fp32", wide), ("bf16", None)):
            model.residual_dtype = dtype
            times[name].append(run(model, prompt, args.decode))
    model.residual_dtype = wide
    print(f"{args.model}, build {qgemm.best_isa()}, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(f"{'residual':9} {'prefill tok/s':>14} {'decode tok/s':>13}")
    result = {}
    for name, rows in times.items():
        pre = args.prompt / statistics.median(r[0] for r in rows)
        dec = args.decode / statistics.median(r[1] for r in rows)
        result[name] = {"prefill_tps": round(pre, 2), "decode_tps": round(dec, 2)}
        print(f"{name:9} {pre:14.2f} {dec:13.2f}")
    ratio = {k: round(result["fp32"][k] / result["bf16"][k], 3) for k in ("prefill_tps", "decode_tps")}
    print(f"fp32 / bf16: prefill {ratio['prefill_tps']:.3f}x, decode {ratio['decode_tps']:.3f}x")
    print(json.dumps({"bench": "residual", "model": args.model, "isa": qgemm.best_isa(), **result,
                      "fp32_over_bf16": ratio}))


if __name__ == "__main__":
    main()
