"""specdec's block kernels against llama.cpp's `llama-bench`, side by side in one run, same GGUF, same threads.

    .venv/bin/python benchmarks/bench_kernels.py [--llama-bench PATH] [--threads 2] [--rounds 2]
        [--isa avx2 --isa avx512vnni] [--long 8192]

Measures, taking turns (llama.cpp, then specdec under each build, `--rounds` times; the best of each is reported):
- decode tokens/s of the target and of the draft (tg128: 128 tokens, one at a time, from an empty context)
  and prefill tokens/s of the target (pp512: one pass of 512 tokens; with `--long N` also ppN, a prompt of N
  tokens read in the engine's chunks of 512, the way `specdec serve` reads it);
- the cost of one target forward of M = 1, 2, 4, 8, 16 new tokens (after a 64-token context), relative
  to M = 1: what verifying a draft of M - 1 tokens costs;
- wall time from process start to the first token of `specdec generate` on the default target;
`--isa` (repeatable) names the kernel builds to measure side by side (`SPECDEC_QGEMM_ISA`: each loads its own
copy of the models, laid out for that build); by default the one this CPU picks. The report names the CPU.
- the size of $SPECDEC_HOME's pulled models and the resident memory of `specdec serve` after a request.

llama-bench: by default the copy under ../shared/tools/llama.cpp-avx2 (built from the llama.cpp that the
llama-cpp-python 0.3.36 source distribution vendors); to build one, `pip download --no-binary :all:
--no-deps llama-cpp-python==0.3.36`, unpack it, and in `vendor/llama.cpp` run `cmake -B build
-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-bench`.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from specdec.api import load_model
from specdec.kernels import native, qgemm
from specdec.models.qlinear import QuantLinear
from specdec.models.store import KNOWN_MODELS, gguf_path, specdec_home

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA_BENCH = ROOT.parent / "shared" / "tools" / "llama.cpp-avx2" / "llama-bench"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
ROWS = (1, 2, 4, 8, 16)


def llama_bench(binary: Path, model: Path, threads: int, prompt: int, gen: int, reps: int = 3) -> dict[str, float]:
    """{"pp": tokens/s, "tg": tokens/s} from llama-bench's JSON output (`reps` repetitions, its mean)."""
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    cmd = [str(binary), "-m", str(model), "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", str(reps),
           "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {done.stderr[-1000:]}")
    out = {}
    for row in json.loads(done.stdout):
        kind = "pp" if row["n_prompt"] > 0 else "tg"
        out[kind] = float(row["avg_ts"])
    return out


@torch.inference_mode()
def decode_rate(model, tokens: int) -> float:
    """Tokens/s of `tokens` greedy one-token forwards from an empty context (llama-bench's tg)."""
    cache = model.new_cache(1, tokens + 64)
    tok = torch.tensor([[0]])
    model(tok, torch.tensor([[0]]), cache)  # warm-up: nothing committed
    t0 = time.perf_counter()
    for i in range(tokens):
        logits = model(tok, torch.tensor([[i]]), cache)
        cache.advance(0, 1)
        tok = logits[:, -1].argmax(-1, keepdim=True)
    return tokens / (time.perf_counter() - t0)


@torch.inference_mode()
def prefill_rate(model, tokens: int, chunk: int | None = None) -> float:
    """Tokens/s of reading `tokens` prompt tokens (llama-bench's pp): one pass, or passes of `chunk` tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    cache = model.new_cache(1, tokens + 64)
    step = chunk or tokens
    t0 = time.perf_counter()
    for start in range(0, tokens, step):
        end = min(tokens, start + step)
        model(ids[:, start:end], torch.arange(start, end)[None], cache, num_logits=1)
        cache.advance(0, end - start)
    return tokens / (time.perf_counter() - t0)


@contextlib.contextmanager
def kernel_build(isa: str):
    """Run (and load models) on the block kernels' build `isa`, as SPECDEC_QGEMM_ISA does."""
    old = os.environ.get("SPECDEC_QGEMM_ISA")
    os.environ["SPECDEC_QGEMM_ISA"] = isa
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECDEC_QGEMM_ISA", None)
        else:
            os.environ["SPECDEC_QGEMM_ISA"] = old


def cpu_name() -> str:
    """The CPU's model name, family / model, and which vector extensions the kernels see."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = native.cpu_flags()
    ext = "AMX" if "amx_tile" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2" if "avx2" in flags else "-"
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), "
            f"{ext}, {os.cpu_count()} CPUs")


def with_context(model, tokens: int = 64):
    """A one-row cache holding `tokens` committed random tokens (room for 64 more)."""
    cache = model.new_cache(1, tokens + 64)
    model(torch.randint(0, model.config.vocab_size, (1, tokens)), torch.arange(tokens)[None], cache)
    cache.advance(0, tokens)
    return cache


@torch.inference_mode()
def row_costs(model, repeats: int = 5) -> dict[int, float]:
    """Seconds (median of `repeats`) of one forward of M new tokens after a 64-token context."""
    cache = with_context(model)
    out = {}
    for m in ROWS:
        ids = torch.randint(0, model.config.vocab_size, (1, m))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, torch.arange(64, 64 + m)[None], cache)
            times.append(time.perf_counter() - t0)
        out[m] = sorted(times)[len(times) // 2]
    return out


@torch.inference_mode()
def outside_matmuls(model, steps: int = 8) -> tuple[float, float]:
    """(ms per one-token step, of which ms outside the block matmuls): the step against the model's block
    matmuls called alone on one row each, in the step's order (each matrix read once from memory in both;
    the layers run as one C++ op each, so a profiler no longer sees their matmuls), taking turns."""
    cache = with_context(model)
    tok, pos = torch.tensor([[1]]), torch.tensor([[64]])
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    xs = [torch.randn(1, m.in_features, dtype=model.dtype) for m in linears]

    def matmuls():
        for m, x in zip(linears, xs):
            m(x)

    step_s, matmul_s = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        model(tok, pos, cache)
        t1 = time.perf_counter()
        matmuls()
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        matmul_s.append(t2 - t1)
    wall, matmul = sorted(step_s[1:])[steps // 2], sorted(matmul_s[1:])[steps // 2]  # medians, warm-up dropped
    return wall * 1e3, (wall - matmul) * 1e3


def start_to_first_token() -> float:
    """Wall seconds of `specdec generate TARGET --max-tokens 1` in a fresh process (best of 2)."""
    cmd = [sys.executable, "-m", "specdec", "generate", TARGET, "--prompt", "def add(a, b):", "--max-tokens", "1"]
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


def serve_rss_mib() -> float:
    """Resident memory (MiB) of `specdec serve` (default pair) after answering one request."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"model": TARGET, "prompt": "def add(a, b):", "max_tokens": 8}).encode()
        deadline = time.time() + 180
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=120).read()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("specdec serve did not answer") from None
                time.sleep(1)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_LLAMA_BENCH)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--isa", action="append", choices=list(native.ISA_FLAGS),
                    help="a build of the block kernels to measure (repeatable; default: the one this CPU picks)")
    ap.add_argument("--long", type=int, default=0, metavar="N",
                    help="also read an N-token prompt (ppN, e.g. 8192) in chunks of 512; llama-bench reads it in its "
                         "own batches of 2048")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isas = args.isa or [qgemm.best_isa()]
    for isa in isas:
        if not native.runs_isa(isa):
            ap.error(f"this CPU cannot run the {isa} build")
    have_llama = args.llama_bench.is_file()
    if not have_llama:
        print(f"no llama-bench at {args.llama_bench}: specdec's figures only", file=sys.stderr)

    files = {name: gguf_path(KNOWN_MODELS[name]) for name in (TARGET, DRAFT)}
    models = {}
    for isa in isas:
        with kernel_build(isa):
            models[isa] = {name: load_model(name, torch.bfloat16, torch.device("cpu"), "gguf")[0] for name in (TARGET, DRAFT)}
    best: dict[str, float] = {}

    def keep(key: str, value: float, higher_is_better: bool = True) -> None:
        old = best.get(key)
        best[key] = value if old is None else (max(old, value) if higher_is_better else min(old, value))

    costs: dict[str, dict[int, float]] = {isa: {} for isa in isas}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        if have_llama:
            lt = llama_bench(args.llama_bench, files[TARGET], args.threads, 512, 128)
            keep("llama_target_tg128", lt["tg"])
            keep("llama_target_pp512", lt["pp"])
            keep("llama_draft_tg128", llama_bench(args.llama_bench, files[DRAFT], args.threads, 0, 128)["tg"])
            if args.long:
                keep("llama_target_pp_long",  # (one repetition a round: pp8192 takes minutes)
                     llama_bench(args.llama_bench, files[TARGET], args.threads, args.long, 0, reps=1)["pp"])
        for isa in isas:
            with kernel_build(isa):
                target, draft = models[isa][TARGET], models[isa][DRAFT]
                keep(f"{isa}_target_tg128", decode_rate(target, 128))
                keep(f"{isa}_target_pp512", prefill_rate(target, 512))
                if args.long:
                    keep(f"{isa}_target_pp_long", prefill_rate(target, args.long, chunk=512))
                keep(f"{isa}_draft_tg128", decode_rate(draft, 128))
                for m, t in row_costs(target).items():
                    costs[isa][m] = min(costs[isa].get(m, t), t)
                step, outside = outside_matmuls(target)
                keep(f"{isa}_step_ms", step, higher_is_better=False)
                keep(f"{isa}_outside_matmuls_ms", outside, higher_is_better=False)
    del models
    first_token = start_to_first_token()
    home = specdec_home()
    pulled = sum(f.stat().st_size for f in files.values())
    store = sum(f.stat().st_size for f in (home / "gguf").glob("*") if f.is_file())
    rss = serve_rss_mib()

    rows = [
        ("target decode, tokens/s (tg128)", "target_tg128"),
        ("target prefill, tokens/s (pp512)", "target_pp512"),
        *([(f"target prefill, tokens/s (pp{args.long})", "target_pp_long")] if args.long else []),
        ("draft decode, tokens/s (tg128)", "draft_tg128"),
    ]
    print(f"\nCPU: {cpu_name()}; threads = {args.threads}; llama.cpp: {args.llama_bench if have_llama else '-'}")
    head = " | ".join(f"specdec ({isa}) | vs llama.cpp" for isa in isas)
    print(f"\n| what | {head} | llama.cpp |")
    print("|---|" + "---|---|" * len(isas) + "---|")
    for label, key in rows:
        ref = best.get(f"llama_{key}")
        cells = []
        for isa in isas:
            ours = best[f"{isa}_{key}"]
            cells += [f"{ours:.2f}", f"{ours / ref:.2f}x" if ref else "-"]
        print(f"| {label} | " + " | ".join(cells) + f" | {f'{ref:.2f}' if ref else '-'} |")
    for isa in isas:
        print(f"\n| rows in one target forward ({isa}) | " + " | ".join(str(m) for m in ROWS) + " |")
        print("|---|" + "---|" * len(ROWS))
        print("| ms | " + " | ".join(f"{costs[isa][m] * 1e3:.1f}" for m in ROWS) + " |")
        print("| relative to 1 row | " + " | ".join(f"{costs[isa][m] / costs[isa][1]:.2f}" for m in ROWS) + " |")
        print(f"one-token target step ({isa}): {best[f'{isa}_step_ms']:.1f} ms, of which "
              f"{best[f'{isa}_outside_matmuls_ms']:.1f} ms outside the block matmuls (attention, norms, rope, glue)")
    print(f"\nprocess start to first token (specdec generate, {qgemm.best_isa()}): {first_token:.2f} s")
    print(f"$SPECDEC_HOME gguf/: {store / 2**30:.2f} GiB ({store / pulled:.2f}x the two GGUF files)")
    print(f"specdec serve resident memory after one request: {rss:.0f} MiB")
    result = {
        "cpu": cpu_name(), "isas": isas, "long": args.long,
        **{k: round(v, 3) for k, v in best.items()},
        "row_cost_ms": {isa: {m: round(costs[isa][m] * 1e3, 2) for m in ROWS} for isa in isas},
        "row_cost_relative": {isa: {m: round(costs[isa][m] / costs[isa][1], 3) for m in ROWS} for isa in isas},
        "start_to_first_token_s": round(first_token, 2),
        "store_bytes": store, "store_vs_gguf": round(store / pulled, 3),
        "serve_rss_mib": round(rss), "threads": args.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
