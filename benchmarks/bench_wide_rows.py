"""What the wide kernels buy: Q6_K matrices laid out 16 channels side by side, each weight block unpacked once
for a whole block of rows (from `SPECDEC_QGEMM_WIDE_ROWS` rows, default 16) against once for every group of 4
rows (0: never). The same bits either way (tests/test_qgemm.py). Side by side in one process, rounds alternating,
on each vector build this CPU runs: one Q6_K matrix of the default target alone (one thread, CPU time, so other
work on the machine weighs less), then prefill of the target's 512-token chunks (2 threads, wall time).

    python benchmarks/bench_wide_rows.py [--isa avx2 --isa avx512vnni] [--rounds 3]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import TARGET, cpu_name, kernel_build, prefill_rate  # noqa: E402

from specdec.kernels import native, qgemm  # noqa: E402
from specdec.api import load_model  # noqa: E402
from specdec.models.qlinear import QuantLinear  # noqa: E402


def q6_k_matrix(model) -> QuantLinear:
    """The first matrix the kernels read as Q6_K 16 channels side by side."""
    return next(m for m in model.modules() if isinstance(m, QuantLinear) and m.kernel_types == [qgemm.Q6_K_X16])


@torch.inference_mode()
def matrix_gmacs(lin: QuantLinear, rows: int, seconds: float = 0.3) -> float:
    """Billions of multiply-adds a CPU second, one thread, 256 channels of `lin` times `rows` rows."""
    x = torch.randn(rows, lin.in_features)
    blocks = [lin.kernel_blocks[0][:16]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        qgemm.qmm(x, blocks, lin.kernel_types, None)
        n, t0 = 0, time.thread_time()
        while time.thread_time() - t0 < seconds:
            qgemm.qmm(x, blocks, lin.kernel_types, None)
            n += 1
        return rows * 256 * lin.in_features * n / (time.thread_time() - t0) / 1e9
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", action="append", choices=["avx2", "avx512vnni"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isas = [isa for isa in (args.isa or ["avx2", "avx512vnni"]) if native.runs_isa(isa)]
    results: dict[str, dict[str, float]] = {}
    for isa in isas:
        with kernel_build(isa):
            lib = qgemm.ops(isa)
            model = load_model(TARGET, torch.bfloat16, torch.device("cpu"), "gguf")[0]
            lin = q6_k_matrix(model)
            default = lib.wide_rows()
            best: dict[str, float] = {}
            try:
                for _ in range(args.rounds):
                    for label, rows in (("groups", 0), ("wide", default)):
                        lib.set_wide_rows(rows)
                        for key, value in ((f"{label}_q6k_16", matrix_gmacs(lin, 16)),
                                           (f"{label}_q6k_128", matrix_gmacs(lin, 128)),
                                           (f"{label}_pp512", prefill_rate(model, 512))):
                            best[key] = max(best.get(key, 0.0), value)
            finally:
                lib.set_wide_rows(default)
            results[isa] = best
            del model

    print(f"CPU: {cpu_name()}; best of {args.rounds} rounds; wide from {qgemm.ops(isas[0]).wide_rows()} rows\n")
    print("| build | what | groups of 4 | wide | wide / groups |")
    print("|---|---|---|---|---|")
    rows = (("Q6_K matrix, 16 rows, GMAC per CPU second", "q6k_16"), ("Q6_K matrix, 128 rows, GMAC per CPU second",
            "q6k_128"), ("target prefill pp512, tokens/s", "pp512"))
    for isa, best in results.items():
        for name, key in rows:
            g, w = best[f"groups_{key}"], best[f"wide_{key}"]
            print(f"| {isa} | {name} | {g:.1f} | {w:.1f} | {w / g:.2f}x |")
    print(json.dumps({"cpu": cpu_name(), "results": results}))


if __name__ == "__main__":
    main()
