"""`specdec train-heads`: train Medusa or EAGLE heads on the target's own features, offline.

Data (all available without a network):
- the Python standard library's sources, cut into windows of `seq_len` tokens (seeded order);
- self-distillation: the target's own greedy answers to the *training split* of specdec's prompt sets
  (`specdec/data`)
  (HumanEval tasks 100-163 and the second half of every Spec-Bench category). Benchmarks and tests draw
  only from the other split (HumanEval 0-99, the first half of each category): see `prompt_split`.

One target pass over each window gives the features (final hidden states) and the target's greedy next
token at every position; the heads learn to predict the target's greedy choices further ahead:
- Medusa head i at token t: the target's choice for token t + 2 + i (cross-entropy);
- EAGLE at token t, input (feature t, token t + 1): the feature of token t + 1 (smooth L1) and the
  target's choice for token t + 2 (cross-entropy), also one step on its own predicted features (depth 2),
  which is how it runs when it drafts.

Features are cached in shards (`features/`), training checkpoints every `checkpoint_every` steps
(`checkpoint.pt`): rerunning the same command resumes both.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec.config import SamplingParams
from specdec.data import DATA_DIR
from specdec.heads.modules import EagleHead, HeadsConfig, MedusaHeads, embedding_table, save_heads

DEFAULT_DATA = DATA_DIR  # the prompt sets shipped with specdec (package data)


@dataclass(frozen=True)
class TrainConfig:
    method: str
    out: Path
    features: Path | None = None  # feature shards (default: OUT/features); share them between methods
    corpus_tokens: int = 24_000  # standard-library tokens
    self_distill_prompts: int = 24
    self_distill_tokens: int = 128
    seq_len: int = 256
    vocab_size: int = 8192
    num_heads: int = 3  # medusa
    epochs: int = 4
    batch_size: int = 4
    lr: float = 1e-3
    held_out: float = 0.08  # fraction of windows kept for the accuracy report
    checkpoint_every: int = 100
    eagle_cls_weight: float = 0.1  # EAGLE: weight of the token loss beside the feature loss
    seed: int = 0
    data_dir: Path = DEFAULT_DATA
    prompts: tuple[tuple[int, ...], ...] | None = None  # self-distillation prompts instead of the data's train split

    @property
    def features_dir(self) -> Path:
        return self.features or self.out / "features"


def prompt_split(data_dir: Path, tokenizer, split: str) -> list[list[int]]:
    """Prompt token ids of one split: "train" (HumanEval 100-163, the second half of each Spec-Bench
    category) or "eval" (the rest: what benchmarks and tests use)."""
    with gzip.open(data_dir / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line) for line in f]
    with open(data_dir / "spec_bench" / "question.jsonl") as f:
        spec_bench = [json.loads(line) for line in f]
    train = split == "train"
    prompts = [tokenizer.encode(r["prompt"]) for r in (humaneval[100:] if train else humaneval[:100])]
    by_category: dict[str, list[dict]] = {}
    for row in spec_bench:
        by_category.setdefault(row["category"], []).append(row)
    chats = []
    for rows in by_category.values():
        half = len(rows) // 2
        chats.append(rows[half:] if train else rows[:half])
    for group in zip(*chats):  # interleave categories
        for row in group:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}])
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
    if train:  # alternate code completions and chats
        code, chat = prompts[: len(humaneval) - 100], prompts[len(humaneval) - 100:]
        prompts = [p for pair in zip(code, chat) for p in pair]
    return prompts


def stdlib_windows(tokenizer, total_tokens: int, seq_len: int, seed: int) -> list[list[int]]:
    """Windows of `seq_len` tokens from the standard library's .py files (tests excluded), seeded order,
    at most two windows a file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower()
                   and "site-packages" not in p.parts)
    random.Random(seed).shuffle(files)
    windows, n = [], 0
    for path in files:
        if n >= total_tokens:
            break
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        for start in range(0, min(len(ids), 2 * seq_len) - 32, seq_len):
            windows.append(ids[start:start + seq_len])
            n += len(windows[-1])
    return windows


def self_distilled(target, tokenizer, prompts: list[list[int]], max_tokens: int, seq_len: int) -> list[list[int]]:
    """The target's own greedy answers, appended to their prompts (cut to the last seq_len tokens)."""
    from specdec.engine import Engine

    engine = Engine(target, tokenizer, max_model_len=4096, max_batch_size=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids[-max(16, seq_len - max_tokens):], params)  # a prompt's tail
    done: dict[str, list[int]] = {}
    with tqdm(total=len(prompts) * max_tokens, desc="self-distill", unit="tok") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                bar.update(len(out.new_token_ids))
                if out.finished:
                    done[out.request_id] = out.prompt_token_ids + out.token_ids
    return [done[str(i)][-seq_len:] for i in range(len(prompts))]


@torch.inference_mode()
def extract_features(target, tokenizer, cfg: TrainConfig) -> list[Path]:
    """One target pass per window; shard i holds tokens [T], hidden [T, H], target_next [T]."""
    out = cfg.features_dir
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "windows.json"
    if manifest.exists():
        windows = json.loads(manifest.read_text())
    else:
        if cfg.prompts is not None:
            distill_prompts = [list(p) for p in cfg.prompts][: cfg.self_distill_prompts]
        elif cfg.self_distill_prompts:
            distill_prompts = prompt_split(cfg.data_dir, tokenizer, "train")[: cfg.self_distill_prompts]
        else:
            distill_prompts = []
        distilled = self_distilled(target, tokenizer, distill_prompts, cfg.self_distill_tokens, cfg.seq_len) \
            if distill_prompts else []
        corpus = stdlib_windows(tokenizer, cfg.corpus_tokens, cfg.seq_len, cfg.seed)
        windows = {"self_distill": distilled, "stdlib": corpus}
        manifest.write_text(json.dumps(windows))
    shards = []
    todo = [(source, w) for source in ("self_distill", "stdlib") for w in windows[source]]
    for i, (source, ids) in enumerate(tqdm(todo, desc="features", unit="window")):
        path = out / f"shard_{i:05d}.safetensors"
        shards.append(path)
        if path.exists():
            continue
        cache = target.new_cache(1, len(ids))
        logits, hidden = target(torch.tensor([ids], device=target.device), torch.arange(len(ids))[None].to(target.device),
                                cache, return_hidden=True)
        save_file({
            "tokens": torch.tensor(ids),
            "hidden": hidden[0].to(torch.bfloat16).cpu().contiguous(),
            "target_next": logits[0].argmax(-1).cpu(),
        }, str(path), metadata={"source": source})
    return shards


def choose_vocab(shards: list[Path], size: int, vocab: int) -> torch.Tensor:
    """The `size` tokens the target chose most often (ties: those frequent in the text), sorted ids."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for path in shards:
        t = load_file(str(path))
        counts += torch.bincount(t["target_next"], minlength=vocab) * 4 + torch.bincount(t["tokens"], minlength=vocab)
    size = min(size, int((counts > 0).sum()))
    return torch.topk(counts.float(), size).indices.sort().values


# ----------------------------------------------------------------------------------------- losses
def _reduced(labels: torch.Tensor, to_reduced: torch.Tensor) -> torch.Tensor:
    return to_reduced[labels]  # -100 outside the reduced vocabulary (ignored by cross_entropy)


def medusa_losses(head: MedusaHeads, batch: dict, to_reduced: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Mean cross-entropy over heads; per head (correct, counted) top-1 against the target's choice."""
    hidden, target_next = batch["hidden"], batch["target_next"]  # [B, T, H], [B, T]
    T = hidden.shape[1]
    logits = head(hidden)  # [B, T, heads, V_r]
    losses, hits = [], []
    for i in range(head.config.num_heads):
        n = T - 1 - i
        labels = _reduced(target_next[:, 1 + i:], to_reduced)  # the target's choice for token t + 2 + i
        lg = logits[:, :n, i]
        losses.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), ignore_index=-100))
        hits.append(_top1(lg, target_next[:, 1 + i:], head.vocab_ids))
    return torch.stack(losses).mean(), hits


def eagle_losses(head: EagleHead, batch: dict, to_reduced: torch.Tensor, depth: int = 2, cls_weight: float = 0.1):
    """Smooth-L1 on the next feature + cls_weight x cross-entropy on the token after, at depth 1 and on
    the head's own predicted features at depth 2; per depth (correct, counted) top-1."""
    hidden, tokens, target_next = batch["hidden"], batch["tokens"], batch["target_next"]
    B, T, H = hidden.shape
    features = hidden[:, :-1]  # feature of token t
    loss, hits = 0.0, []
    for d in range(depth):
        n = T - 1 - d
        next_tokens = tokens[:, 1 + d:]  # token t + 1 (+ d)
        cache = head.new_cache(B, n)
        pred = head(features[:, :n], next_tokens, torch.arange(n)[None].expand(B, n), cache)  # feature of t + 1 (+ d)
        logits = head.logits(pred)
        labels = target_next[:, 1 + d:]  # the target's choice for token t + 2 (+ d)
        reg = F.smooth_l1_loss(pred.float(), hidden[:, 1 + d:].float())
        cls = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _reduced(labels, to_reduced).reshape(-1),
                              ignore_index=-100)
        loss = loss + (reg + cls_weight * cls) / (d + 1)
        hits.append(_top1(logits, labels, head.vocab_ids))
        features = pred[:, :-1]  # the next depth runs on the head's own predictions
    return loss, hits


def _top1(logits: torch.Tensor, labels: torch.Tensor, vocab_ids: torch.Tensor) -> tuple[int, int]:
    guess = vocab_ids[logits.argmax(-1)]
    return int((guess == labels).sum()), labels.numel()


# ----------------------------------------------------------------------------------------- training
def _load_batches(shards: list[Path]) -> list[dict]:
    out = []
    for path in shards:
        t = load_file(str(path))
        out.append({"hidden": t["hidden"].float(), "tokens": t["tokens"], "target_next": t["target_next"]})
    return out


def _collate(windows: list[dict]) -> dict:
    T = min(w["tokens"].shape[0] for w in windows)
    return {k: torch.stack([w[k][:T] for w in windows]) for k in windows[0]}


def evaluate(head, windows: list[dict], to_reduced: torch.Tensor) -> list[float]:
    losses = medusa_losses if isinstance(head, MedusaHeads) else eagle_losses
    correct: list[int] = []
    counted: list[int] = []
    with torch.no_grad():
        for w in windows:
            _, hits = losses(head, _collate([w]), to_reduced)
            correct = [a + c for a, (c, _) in zip(correct or [0] * len(hits), hits)]
            counted = [a + n for a, (_, n) in zip(counted or [0] * len(hits), hits)]
    return [round(c / max(n, 1), 4) for c, n in zip(correct, counted)]


def train_heads(target, tokenizer, target_name: str, cfg: TrainConfig) -> dict:
    """Extract features (cached), train, save the heads to cfg.out, return the report."""
    t0 = time.perf_counter()
    shards = extract_features(target, tokenizer, cfg)
    extract_time = time.perf_counter() - t0
    with torch.inference_mode(False), torch.enable_grad():
        return _train(target, target_name, cfg, shards, extract_time)


def _train(target, target_name: str, cfg: TrainConfig, shards: list[Path], extract_time: float) -> dict:
    torch.manual_seed(cfg.seed)
    windows = _load_batches(shards)
    order = list(range(len(windows)))
    random.Random(cfg.seed).shuffle(order)
    n_eval = max(1, int(len(windows) * cfg.held_out))
    eval_windows = [windows[i] for i in order[:n_eval]]
    train_windows = [windows[i] for i in order[n_eval:]]
    vocab_ids = choose_vocab([shards[i] for i in order[n_eval:]], cfg.vocab_size, target.config.vocab_size)

    config = HeadsConfig.for_target(cfg.method, target, target_name, len(vocab_ids),
                                    **({"num_heads": cfg.num_heads} if cfg.method == "medusa" else {}))
    head = (MedusaHeads if cfg.method == "medusa" else EagleHead)(config)
    head.vocab_ids = vocab_ids.clone()
    head.float().attach(target)
    head.lm_rows = head.lm_rows.float().clone()  # a normal tensor (the target may run in inference mode)
    if isinstance(head, EagleHead):
        table = embedding_table(target)  # a normal float tensor (the target may run in inference mode)
        head.embed = lambda ids: F.embedding(ids, table)
    head.to("cpu")
    to_reduced = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    to_reduced[vocab_ids] = torch.arange(len(vocab_ids))

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = max(1, len(train_windows) // cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    warmup = min(20, total_steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    step, train_time = 0, 0.0
    ckpt = cfg.out / "checkpoint.pt"
    cfg.out.mkdir(parents=True, exist_ok=True)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, train_time = state["step"], state["train_time"]
        print(f"resuming from step {step} of {total_steps}")
    losses_fn = medusa_losses if cfg.method == "medusa" else \
        (lambda h, b, r: eagle_losses(h, b, r, cls_weight=cfg.eagle_cls_weight))
    initial = evaluate(head, eval_windows, to_reduced) if step == 0 else None
    bar = tqdm(total=total_steps, initial=step, desc=f"train {cfg.method}", unit="step")
    recent: list[float] = []
    first_loss = None
    while step < total_steps:
        epoch, i = divmod(step, steps_per_epoch)
        perm = list(range(len(train_windows)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(perm)
        batch = _collate([train_windows[j] for j in perm[i * cfg.batch_size:(i + 1) * cfg.batch_size]])
        t = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, _ = losses_fn(head, batch, to_reduced)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        train_time += time.perf_counter() - t
        step += 1
        value = loss.item()
        recent = (recent + [value])[-20:]
        first_loss = first_loss if first_loss is not None else value
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "train_time": train_time}, ckpt)
    bar.close()

    accuracy = evaluate(head, eval_windows, to_reduced)
    sources: dict[str, int] = {}
    for path in shards:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        source = header["__metadata__"]["source"]
        sources[source] = sources.get(source, 0) + header["tokens"]["shape"][0]
    eval_labels = torch.cat([w["target_next"] for w in eval_windows])
    report = {
        "method": cfg.method,
        "target": target_name,
        "data_tokens": sources,
        "windows": {"train": len(train_windows), "held_out": len(eval_windows), "seq_len": cfg.seq_len},
        "held_out_prompts": "HumanEval 0-99 and the first half of each Spec-Bench category are never trained on",
        "vocab_size": len(vocab_ids),
        "vocab_coverage_held_out": round(float((to_reduced[eval_labels] >= 0).float().mean()), 4),
        "steps": total_steps,
        "epochs": cfg.epochs,
        "lr": cfg.lr,
        **({"cls_weight": cfg.eagle_cls_weight} if cfg.method == "eagle" else {}),
        "batch_size": cfg.batch_size,
        "extract_time_s": round(extract_time, 1),
        "train_time_s": round(train_time, 1),
        "first_loss": first_loss,
        "final_loss": sum(recent) / max(1, len(recent)),
        "parameters": sum(p.numel() for p in params),
        "held_out_top1_before": initial,
        ("held_out_top1_per_head" if cfg.method == "medusa" else "held_out_top1_per_depth"): accuracy,
    }
    head.config = dataclasses.replace(config, training=report)
    save_heads(head, cfg.out)
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
