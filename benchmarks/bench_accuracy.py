"""How close each arithmetic of specdec comes to the fp32 model, beside llama.cpp's (issue 59's accuracy goal).

The reference is Hugging Face transformers in fp32 on the GGUF's dequantized weights (the same values every
path below multiplies by). For each held-out HumanEval prompt it decodes `--tokens` greedy tokens, then every
path scores the same sequence (prompt + the reference's tokens, teacher-forced) and decodes its own greedy
tokens. Per path: the largest and the RMS logit error over the scored positions, the residual stream's
relative error after each layer (where the error enters), and on how many prompts its greedy tokens equal the
reference's.

Paths (the variables that can put error in, one at a time):
  float32         specdec's float layers, fp32 (quantization none): should match the reference to ~1e-4
  blocks-fp32     the block kernels with fp32 activations and an fp32 K/V cache: activations quantized to
                  8 bits per 32 at each matmul (as llama.cpp does), everything else fp32
  blocks-bf16     block kernels, bf16 activations between ops, bf16 K/V cache (SPECDEC_FP32_RESIDUAL=0)
  blocks-bf16-fp32res  the default: the same with the residual stream, norms and matrix outputs in fp32
  blocks-bf16-q8kv  the same with the 8-bit K/V cache (`--kv-cache-dtype q8_0`)
  blocks-fp32-kvbf16, blocks-fp32-kvf16  (diagnosis) blocks-fp32 op by op with K/V rounded to bf16 / f16
  llama.cpp       llama-server (../shared/tools), greedy, its 8-bit activations and f16 K/V: tokens only

    python benchmarks/bench_accuracy.py                      # the draft (0.5B), 3 prompts, 12 tokens
    python benchmarks/bench_accuracy.py --prompts 10 --tokens 32 --model qwen2.5-coder-1.5b-instruct

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.kernels import qgemm
from specdec.models.loading import load_checkpoint, load_quantized
from specdec.models.kv_cache import KVCache
from specdec.models.llama import Transformer
from specdec.models.store import resolve_model

ROOT = Path(__file__).resolve().parents[1]
HUMANEVAL = ROOT / "src" / "specdec" / "data" / "humaneval" / "HumanEval.jsonl.gz"
LLAMA = ROOT.parent / "shared" / "tools" / "llama.cpp-avx2"


def prompts(n: int) -> list[str]:
    """The last `n` HumanEval prompts (the heads' training never reads HumanEval)."""
    with gzip.open(HUMANEVAL, "rt") as f:
        rows = [json.loads(line)["prompt"] for line in f]
    return rows[-n:]


def reference(path: Path, ids: list[list[int]], tokens: int):
    """transformers fp32 on the GGUF: greedy tokens, the scored logits [tokens, V] and per-layer states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt in ids:
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)[0].tolist()
            full = model(torch.tensor([seq[:-1]]), output_hidden_states=True)
            logits = full.logits[0, len(prompt) - 1:].float()
            states = [h[0].float() for h in full.hidden_states[1:-1]]  # after each layer but the last (normed)
            out.append((seq[len(prompt):], logits, states))
    return out


def specdec_model(path: Path, kind: str) -> Transformer:
    if kind == "float32":
        config, state, _ = load_checkpoint(path, torch.float32, torch.device("cpu"))
        return Transformer.from_state_dict(config, state).requires_grad_(False)
    dtype = torch.float32 if kind.startswith("blocks-fp32") else torch.bfloat16
    residual = torch.float32 if "fp32res" in kind else dtype
    _, model, _ = load_quantized(path, "gguf", dtype, residual_dtype=residual)
    model.kv_format = "q8_0" if kind.endswith("q8kv") else "auto"
    if kind.startswith("blocks-fp32-kv"):  # a diagnosis: fp32 everywhere but the K/V, rounded as stored
        for layer in model.model.layers:
            layer.fused_args = None  # op by op, so that the cache's `store` writes the K/V
        model.kv_round = {"blocks-fp32-kvbf16": torch.bfloat16, "blocks-fp32-kvf16": torch.float16}[kind]
    return model.requires_grad_(False)


_store = KVCache.store


def _rounding_store(self, layer, page, offset, k, v):
    if self.kv_round is not None:
        k, v = k.to(self.kv_round).float(), v.to(self.kv_round).float()
    _store(self, layer, page, offset, k, v)


KVCache.store, KVCache.kv_round = _rounding_store, None


def new_cache(model: Transformer, capacity: int) -> KVCache:
    cache = model.new_cache(1, capacity)
    cache.kv_round = getattr(model, "kv_round", None)
    return cache


def score(model: Transformer, prompt: list[int], seq: list[int], tokens: int):
    """Teacher-forced logits at the scored positions, per-layer residual states, and the model's own greedy."""
    layers = tuple(range(model.config.num_hidden_layers - 1))
    with torch.inference_mode():
        cache = new_cache(model, len(seq) + 1)
        logits, hidden = model(torch.tensor([seq]), torch.arange(len(seq))[None], cache, return_hidden=True,
                               feature_layers=layers)
        H = model.config.hidden_size
        states = [hidden[0, :, i * H:(i + 1) * H].float() for i in range(len(layers))]
        scored = logits[0, len(prompt) - 1:len(seq)].float()
        cache = new_cache(model, len(prompt) + tokens + 1)
        last = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, num_logits=1)[0, -1]
        cache.advance(0, len(prompt))
        own = []
        for i in range(tokens):
            own.append(int(last.argmax()))
            if i + 1 == tokens:
                break
            pos = len(prompt) + i
            last = model(torch.tensor([[own[-1]]]), torch.tensor([[pos]]), cache)[0, -1]
            cache.advance(0, 1)
    return scored, states, own


def llama_greedy(path: Path, ids: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]] | None:
    """llama-server's greedy tokens for each prompt and its top-2 logit margin at each (from its logprobs)."""
    server = LLAMA / "llama-server"
    if not server.exists():
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA / "lib"))
    proc = subprocess.Popen([str(server), "-m", str(path), "--port", str(port), "-t", "2", "-c", "4096",
                             "--no-warmup"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        out = []
        for prompt in ids:
            body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0, "top_k": 1,
                               "cache_prompt": False, "return_tokens": True, "n_probs": 2}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=600).read())
            margins = []
            for step in answer["completion_probabilities"]:
                top = sorted((t["logprob"] for t in step["top_logprobs"]), reverse=True)
                margins.append(top[0] - top[1])
            out.append((answer["tokens"], margins))
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--paths", default="float32,blocks-fp32,blocks-bf16,blocks-bf16-fp32res,blocks-bf16-q8kv")
    p.add_argument("--no-llama", action="store_true", help="skip llama-server")
    args = p.parse_args()
    torch.manual_seed(0)
    path = Path(resolve_model(args.model))
    _, _, tokenizer = load_quantized(path, "gguf")
    ids = [tokenizer.encode(text) for text in prompts(args.prompts)]
    ref = reference(path, ids, args.tokens)
    ref_margins = [margins_of(logits) for _, logits, _ in ref]
    theirs = None if args.no_llama else llama_greedy(path, ids, args.tokens)
    # the positions every path is compared on: before llama.cpp's first departure from the reference (there
    # its sequence is the reference's, so its margins are teacher-forced ones), else all
    upto = [departure(t, g) or args.tokens for (t, _), (g, _, _) in zip(theirs, ref)] if theirs else \
        [args.tokens] * len(ids)
    rows, report = [], {}
    for kind in args.paths.split(","):
        model = specdec_model(path, kind)
        max_err, sq, n, equal, first, layer_err, margin_err = 0.0, 0.0, 0, 0, [], None, []
        for prompt, (gen, ref_logits, ref_states), ref_m, u in zip(ids, ref, ref_margins, upto):
            logits, states, own = score(model, prompt, prompt + gen[:-1], args.tokens)
            d = logits - ref_logits
            max_err = max(max_err, float(d.abs().max()))
            sq, n = sq + float(d.pow(2).sum()), n + d.numel()
            errs = [float((s - r).norm() / r.norm()) for s, r in zip(states, ref_states)]
            layer_err = errs if layer_err is None else [max(a, b) for a, b in zip(layer_err, errs)]
            equal += own == gen
            first.append(departure(own, gen))
            margin_err += [abs(a - b) for a, b in zip(margins_of(logits)[:u], ref_m[:u])]
        del model
        rows.append(Row(kind, max_err, (sq / n) ** 0.5, equal, first, margin_err, layer_err))
    if theirs:
        margin_err = [abs(a - b) for (_, m), ref_m, u in zip(theirs, ref_margins, upto) for a, b in zip(m[:u], ref_m[:u])]
        rows.append(Row("llama.cpp", None, None, sum(t == g for (t, _), (g, _, _) in zip(theirs, ref)),
                        [departure(t, g) for (t, _), (g, _, _) in zip(theirs, ref)], margin_err, None))
    print(f"{args.model}: {len(ids)} HumanEval prompts, {args.tokens} greedy tokens; reference: transformers fp32; "
          f"margin error on {len(rows[0].margin_err)} positions")
    print(f"{'path':17} {'max|dlogit|':>11} {'rms dlogit':>10} {'margin err mean/max':>20} {'greedy =':>9}  "
          f"first departures  layer rel. err (first, mid, last)")
    for r in rows:
        print(r.line(len(ids)))
    low = sorted(min(m) for m in ref_margins)[:3]
    print(f"smallest top-2 margins of the reference: {[round(m, 3) for m in low]}")
    print(json.dumps({"bench": "accuracy", "model": args.model, "prompts": len(ids), "tokens": args.tokens,
                      "cpu_isa": qgemm.best_isa(), "paths": {r.kind: r.json() for r in rows}}))


def margins_of(logits: torch.Tensor) -> list[float]:
    top = logits.topk(2, dim=-1).values  # [positions, 2]
    return (top[:, 0] - top[:, 1]).tolist()


def departure(own: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), None)


@dataclass
class Row:
    kind: str
    max_err: float | None
    rms_err: float | None
    equal: int
    first: list[int | None]
    margin_err: list[float]
    layer_err: list[float] | None

    def line(self, prompts: int) -> str:
        num = lambda v, w: f"{v:{w}.4f}" if v is not None else " " * w
        margins = f"{sum(self.margin_err) / len(self.margin_err):.4f} / {max(self.margin_err):.4f}"
        layers = "" if self.layer_err is None else \
            f"{self.layer_err[0]:.2e} {self.layer_err[len(self.layer_err) // 2]:.2e} {self.layer_err[-1]:.2e}"
        departed = [f for f in self.first if f is not None]
        return (f"{self.kind:17} {num(self.max_err, 11)} {num(self.rms_err, 10)} {margins:>20} "
                f"{self.equal:>5}/{prompts}  {str(departed):16}  {layers}")

    def json(self) -> dict:
        return {"max_logit_err": self.max_err, "rms_logit_err": self.rms_err, "greedy_equal": self.equal,
                "first_departure": self.first, "margin_err_mean": sum(self.margin_err) / len(self.margin_err),
                "margin_err_max": max(self.margin_err),
                "layer_rel_err": None if self.layer_err is None else [round(e, 6) for e in self.layer_err]}


if __name__ == "__main__":
    main()
