"""A known model of any family (default Gemma 3 270M) on specdec's block kernels against llama.cpp's
`llama-bench`, side by side, same GGUF, same threads: decode (tg128: 128 greedy one-token forwards from an empty
context) and prefill (pp512), the two taking turns `--rounds` times; the best of each is reported.

    .venv/bin/python benchmarks/bench_family_decode.py [--model gemma-3-270m] [--rounds 2] [--threads 2]

llama-bench: the copy under ../shared/tools/llama.cpp-avx2 by default (see bench_kernels.py); without it, only
specdec's figures. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from bench_kernels import DEFAULT_LLAMA_BENCH, decode_rate, llama_bench
from specdec.models.loading import load_quantized
from specdec.models.store import gguf_path, known_model, pull


@torch.inference_mode()
def prefill_rate(model, tokens: int) -> float:
    cache = model.new_cache(1, tokens + 8)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    model(ids, torch.arange(tokens)[None], cache, num_logits=1)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bench", default=str(DEFAULT_LLAMA_BENCH))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pull(args.model)
    path = gguf_path(known_model(args.model))
    _, model, _ = load_quantized(path, "gguf", torch.bfloat16)
    have_llama = __import__("pathlib").Path(args.llama_bench).is_file()
    best = {"specdec": {"tg128": 0.0, "pp512": 0.0}, "llama.cpp": {"tg128": 0.0, "pp512": 0.0}}
    for _ in range(args.rounds):
        if have_llama:
            got = llama_bench(__import__("pathlib").Path(args.llama_bench), path, args.threads, 512, 128)
            best["llama.cpp"] = {"tg128": max(best["llama.cpp"]["tg128"], got["tg"]),
                                 "pp512": max(best["llama.cpp"]["pp512"], got["pp"])}
        decode_rate(model, 8)  # warm-up
        best["specdec"] = {"tg128": max(best["specdec"]["tg128"], decode_rate(model, 128)),
                           "pp512": max(best["specdec"]["pp512"], prefill_rate(model, 512))}
    print(f"\n{args.model} ({model.config.architecture}), {path.name}; CPU {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, best of {args.rounds}\n")
    print("| test | specdec, tokens/s | llama.cpp, tokens/s | specdec / llama.cpp |")
    print("|---|---|---|---|")
    for test in ("tg128", "pp512"):
        ours, theirs = best["specdec"][test], best["llama.cpp"][test]
        ratio = f"{ours / theirs:.2f}" if theirs else "-"
        print(f"| {test} | {ours:.1f} | {theirs:.1f} | {ratio} |" if theirs else f"| {test} | {ours:.1f} | - | - |")
    print(json.dumps({"benchmark": "family_decode", "model": args.model, "architecture": model.config.architecture,
                      "specdec": best["specdec"], "llama_cpp": best["llama.cpp"] if have_llama else None}))


if __name__ == "__main__":
    main()
