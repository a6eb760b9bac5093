"""A coding agent's edit session (`specdec bench agent`, `specdec.bench.agent`) through `specdec serve` with its
defaults, side by side with llama.cpp's server on the same GGUF and threads, and with specdec's other modes.

    .venv/bin/python benchmarks/bench_agent.py [--llama-server PATH] [--modes llama.cpp,auto,plain,seed,suffix,medusa]

Modes (each its own server, all started before the session and idle while another answers; the servers take
turns turn by turn):
    llama.cpp   llama-server -m TARGET.gguf -t 2 -c 8192 (plain decoding: the server a user would otherwise run)
    auto        specdec serve TARGET (no speculation flags: auto speculation)
    plain       specdec serve TARGET --num-speculative-tokens 0
    seed        specdec serve TARGET --speculative-model DRAFT --num-speculative-tokens 5 (the seed's command)
    suffix      specdec serve TARGET --speculative-config '{"method": "suffix"}'
    medusa      specdec serve TARGET --speculative-config '{"method": "medusa", ..., "num_speculative_tokens": 2}'
    auto-eagle3 auto speculation with the EAGLE-3 head in Q4_0 beside the tries instead of the Medusa heads
Every specdec server gets --max-model-len 8192 (a turn's prompt and answer exceed 4096). llama.cpp's binary:
by default a native build under ../llama-native (see benchmarks/bench_kernels.py for how to build one), else the
AVX2 copy under ../shared/tools; that mode is skipped if neither exists. Prints a table (the first mode is the
baseline), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from load_test import free_port, launch
from specdec.bench.agent import SESSION, run_session, session_table, stream_chat, summary

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVERS = [ROOT.parent / "llama-native" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" /
                 "llama-server", ROOT.parent / "shared" / "tools" / "llama.cpp-avx2" / "llama-server"]
SPECDEC_MODES = {
    "auto": [],
    "plain": ["--num-speculative-tokens", "0"],
    "seed": ["--speculative-model", DRAFT, "--num-speculative-tokens", "5"],
    "suffix": ["--speculative-config", '{"method": "suffix"}'],
    "medusa": ["--speculative-config", json.dumps({"method": "medusa", "model": f"{TARGET}-medusa",
                                                   "num_speculative_tokens": 2})],
    "auto-eagle3": ["--speculative-config", json.dumps({"method": "auto", "model": f"{TARGET}-eagle3",
                                                        "draft_quantization": "q4_0"})],
}


def command(mode: str, port: int, llama_server: Path) -> list[str]:
    if mode == "llama.cpp":
        from specdec.models.store import resolve_model

        return [str(llama_server), "-m", str(resolve_model(TARGET)), "-t", "2", "-c", "8192", "--host", "127.0.0.1",
                "--port", str(port)]
    return [sys.executable, "-m", "specdec", "serve", TARGET, *SPECDEC_MODES[mode], "--max-model-len", "8192",
            "--max-num-seqs", "1", "--port", str(port)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=next((p for p in LLAMA_SERVERS if p.is_file()), None))
    ap.add_argument("--modes", default="llama.cpp,auto,plain,seed,suffix,medusa")
    ap.add_argument("--turns", type=int, default=len(SESSION), choices=range(1, len(SESSION) + 1),
                    help="the session's first N turns")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m and (m != "llama.cpp" or args.llama_server is not None)]
    unknown = set(modes) - set(SPECDEC_MODES) - {"llama.cpp"}
    if unknown:
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    if "llama.cpp" in modes:
        print(f"llama.cpp's server: {args.llama_server}", file=sys.stderr)
    log_dir = tempfile.mkdtemp(prefix="bench-agent-")
    procs, servers = [], {}
    try:
        for mode in modes:
            port = free_port()
            procs.append(launch(command(mode, port, args.llama_server), port, log_dir))
            servers[mode] = f"http://127.0.0.1:{port}"
        for url in servers.values():  # one-time costs (pages of the weights, buffers): not measured
            stream_chat(url, TARGET, [{"role": "user", "content": "Write a Python function that adds two numbers."}], 32)
        results = run_session(servers, TARGET, SESSION[:args.turns], progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    print("\n".join(session_table(results)))
    with open(f"{log_dir}/answers.json", "w") as f:  # what each server answered, to look at
        json.dump({name: [r["text"] for r in rows] for name, rows in results.items()}, f)
    print(json.dumps({"benchmark": "agent", "target": TARGET, "logs": log_dir, "results": summary(results)}))


if __name__ == "__main__":
    main()
