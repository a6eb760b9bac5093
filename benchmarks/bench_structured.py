"""Benchmark structured output (specdec.engine.structured, llguidance) on a model's tokenizer: what a grammar
costs to compile and what a mask costs per decoded or verified position.

    python benchmarks/bench_structured.py [--model qwen2.5-coder-0.5b-instruct] [--k 4]

For each grammar: compile time (a schema not seen before), the median time of `allowed_mask()` along a
sample output, and of `masks_along(k drafted tokens)` at the same positions. Prints a table and one JSON
line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec.engine.structured import Grammar
from specdec.models.gguf_file import GGUFFile
from specdec.models.loading import load_config
from specdec.models.store import resolve_model
from specdec.models.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
CASES = {  # grammar -> (schema, a sample output it accepts)
    "json_schema": (SCHEMA, '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "analytical engine"]}'),
    "json_object": ({"type": "object"}, '{"id": 7, "items": [{"k": "alpha", "v": [1, 2.5, -3e2]}, {"k": "beta", "v": null}], '
                                        '"ok": true, "note": "line\\nbreak"}'),
}


def ms(f) -> float:
    start = time.perf_counter()
    f()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="a known name, .gguf file or model folder")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per masks_along call")
    p.add_argument("--repeats", type=int, default=5, help="compilations measured per grammar")
    args = p.parse_args()
    path = resolve_model(args.model)
    tokenizer = Tokenizer.from_gguf(GGUFFile(path)) if path.suffix == ".gguf" else Tokenizer.from_folder(path)
    vocab_size = load_config(path).vocab_size

    first_s = ms(lambda: Grammar.json_schema({"type": "null"}, tokenizer, vocab_size)) / 1e3  # builds llguidance's tokenizer
    print(f"model={args.model} vocab_size={vocab_size} first grammar (tokenizer set-up) {first_s:.2f} s")
    hdr = f"{'grammar':>12} {'tokens':>6} {'compile ms':>10} {'mask ms':>8} {f'masks_along k={args.k} ms':>20}"
    print(hdr)
    print("-" * len(hdr))
    results = []
    for name, (schema, sample) in CASES.items():
        # a new title each time: a schema the cache has not seen
        compile_ms = [ms(lambda: Grammar.json_schema({**schema, "title": f"t{i}"}, tokenizer, vocab_size))
                      for i in range(args.repeats)]
        matcher = Grammar.json_schema(schema, tokenizer, vocab_size).matcher()
        ids = tokenizer.encode(sample)
        mask_ms, along_ms = [], []
        for i, token in enumerate(ids):
            mask_ms.append(ms(matcher.allowed_mask))
            along_ms.append(ms(lambda: matcher.masks_along(ids[i : i + args.k])))
            matcher.advance([token])
        assert matcher.is_terminated(), f"the sample output of {name} is incomplete"
        row = {"grammar": name, "tokens": len(ids), "compile_ms": statistics.median(compile_ms),
               "mask_ms": statistics.median(mask_ms), "masks_along_ms": statistics.median(along_ms)}
        print(f"{name:>12} {len(ids):>6} {row['compile_ms']:10.2f} {row['mask_ms']:8.3f} {row['masks_along_ms']:20.3f}")
        results.append(row)
    print(json.dumps({"bench": "structured", "model": args.model, "vocab_size": vocab_size, "k": args.k,
                      "tokenizer_setup_s": round(first_s, 3),
                      "results": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in results]}))


if __name__ == "__main__":
    main()
