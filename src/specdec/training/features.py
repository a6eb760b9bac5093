"""The training data of draft heads and the target's features on it, cached in shards.

Windows of token ids come from these sources (all available without a network): the Python standard
library's sources (`stdlib_windows`), the target's own greedy answers to the *training split* of
specdec's prompt sets (`prompt_split`, `self_distilled`), and that split's HumanEval reference solutions
(`solution_windows`). One target pass over each window gives its
features (final hidden states) and the target's greedy next token at every position (`extract_features`).
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import sysconfig
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec.config import SamplingParams


def humaneval_tasks(data_dir: Path, split: str) -> list[dict]:
    """HumanEval's tasks of one split, as `prompt_split`: "train" is 100 on, "eval" 0-99."""
    with gzip.open(data_dir / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        tasks = [json.loads(line) for line in f]
    return tasks[100:] if split == "train" else tasks[:100]


def prompt_split(data_dir: Path, tokenizer, split: str) -> list[list[int]]:
    """Prompt token ids of one split: "train" (HumanEval 100-163, the second half of each Spec-Bench
    category) or "eval" (the rest: what benchmarks and tests use)."""
    with open(data_dir / "spec_bench" / "question.jsonl") as f:
        spec_bench = [json.loads(line) for line in f]
    train = split == "train"
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(data_dir, split)]
    n_code = len(prompts)
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
        code, chat = prompts[:n_code], prompts[n_code:]
        prompts = [p for pair in zip(code, chat) for p in pair]
    return prompts


def solution_windows(data_dir: Path, tokenizer, count: int, seq_len: int, split: str = "train") -> list[list[int]]:
    """HumanEval's tasks of one split (as `prompt_split`: "train" is 100 on, "eval" 0-99) as prompt + reference
    solution, the first `count`, each cut to its last seq_len tokens: code in the form the code prompts ask
    for, far cheaper than the target's own answers (teacher-forced: the labels are still the target's
    choices). The eval split's are held-out windows no training reads (`TrainConfig.held_out_tasks`)."""
    tasks = humaneval_tasks(data_dir, split)[:count]
    return [tokenizer.encode(t["prompt"] + t["canonical_solution"])[-seq_len:] for t in tasks]


def _stdlib_files() -> list[Path]:
    """The standard library's .py files, tests and site-packages excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower()
                  and "site-packages" not in p.parts)


def function_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Prompts in HumanEval's form from the standard library: a public function's (or a public class's public
    method's, dedented) `def` line through its docstring (80 characters at least, a body after it), for the
    target to complete (`self_distilled`); the first `count` in a seeded order."""
    prompts = []
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")):
            nodes += [n for n in cls.body if isinstance(n, ast.FunctionDef)]
        for node in nodes:
            doc = ast.get_docstring(node)
            if node.name.startswith("_") or not doc or len(doc) < 80 or len(node.body) < 2:
                continue
            prompts.append(textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].end_lineno])))
    random.Random(seed).shuffle(prompts)
    return [tokenizer.encode(text) for text in prompts[:count]]


def stdlib_windows(tokenizer, total_tokens: int, seq_len: int, seed: int) -> list[list[int]]:
    """Windows of `seq_len` tokens from the standard library's .py files (tests excluded), seeded order,
    at most two windows a file."""
    files = _stdlib_files()
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


def self_distilled(target, tokenizer, prompts: list[list[int]], max_tokens: int, seq_len: int,
                   batch_size: int = 4, done_path: Path | None = None) -> list[list[int]]:
    """The target's own greedy answers, appended to their prompts (cut to the last seq_len tokens): the windows
    of `greedy_answers`."""
    return [(tail + answer)[-seq_len:]
            for tail, answer in greedy_answers(target, tokenizer, prompts, max_tokens, seq_len, batch_size, done_path)]


def greedy_answers(target, tokenizer, prompts: list[list[int]], max_tokens: int, seq_len: int | None,
                   batch_size: int = 4, done_path: Path | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt tail, answer) per prompt: the target's greedy answer of at most `max_tokens` to the prompt's last
    seq_len - max_tokens tokens (16 at least; None: the whole prompt); `batch_size` requests at a time (a pass
    of a few rows costs about one row's on the block kernels). With `done_path`, each answer is appended there
    (a JSON line: its index, prompt and answer) as it finishes, and those found there for the same prompt and
    length are not asked again: an interrupted run resumes."""
    from specdec.engine import Engine

    tails = [ids[-max(16, seq_len - max_tokens):] if seq_len else list(ids) for ids in prompts]  # a prompt's tail
    done: dict[str, list[int]] = {}
    if done_path is not None and done_path.exists():
        for line in done_path.read_text().splitlines():
            try:
                row = json.loads(line)
                i = int(row["i"])
            except (ValueError, KeyError, TypeError):
                continue  # (a line cut short by the interruption)
            if 0 <= i < len(tails) and row.get("prompt") == tails[i] and row.get("max_tokens") == max_tokens:
                done[str(i)] = row["answer"]
    # prompts read in passes of their own (not a few tokens inside each decoding step, which keeps a chat's
    # latency and here left most rows waiting): every request is queued at once, so decoding steps run full
    engine = Engine(target, tokenizer, max_model_len=4096, max_batch_size=batch_size, prefill_itl_factor=None)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, ids in enumerate(tails):
        if str(i) not in done:
            engine.add_request(str(i), ids, params)
    log = open(done_path, "a") if done_path is not None else None
    try:
        with tqdm(total=(len(prompts) - len(done)) * max_tokens, desc="self-distill", unit="tok") as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    bar.update(len(out.new_token_ids))
                    if out.finished:
                        done[out.request_id] = out.token_ids
                        if log is not None:
                            log.write(json.dumps({"i": int(out.request_id), "prompt": out.prompt_token_ids,
                                                  "max_tokens": max_tokens, "answer": out.token_ids}) + "\n")
                            log.flush()
    finally:
        if log is not None:
            log.close()
    return [(tails[i], done[str(i)]) for i in range(len(prompts))]


@torch.inference_mode()
def extract_features(target, windows: dict[str, list[list[int]]], out: Path,
                     feature_layers: tuple[int, ...] = ()) -> list[Path]:
    """One target pass per window of each source, in order; shard i (`out/shard_0000i.safetensors`, kept
    if already there) holds tokens [T], hidden [T, F] (bf16: the outputs of `feature_layers`, then the final
    hidden state) and target_next [T], its source in the metadata."""
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    todo = [(source, w) for source in windows for w in windows[source]]
    for i, (source, ids) in enumerate(tqdm(todo, desc="features", unit="window")):
        path = out / f"shard_{i:05d}.safetensors"
        shards.append(path)
        if path.exists():
            continue
        cache = target.new_cache(1, len(ids))
        positions = torch.arange(len(ids))[None].to(target.device)
        logits, hidden = target(torch.tensor([ids], device=target.device), positions, cache, return_hidden=True,
                                feature_layers=feature_layers)
        save_file({
            "tokens": torch.tensor(ids),
            "hidden": hidden[0].to(torch.bfloat16).cpu().contiguous(),
            "target_next": logits[0].argmax(-1).cpu(),
        }, str(path), metadata={"source": source})
    return shards


def load_windows(shards: list[Path]) -> list[dict]:
    """Each shard as {"hidden": [T, F] bf16 (as stored), "tokens": [T], "target_next": [T]}."""
    out = []
    for path in shards:
        t = load_file(str(path))
        out.append({"hidden": t["hidden"], "tokens": t["tokens"], "target_next": t["target_next"]})
    return out


def collate(windows: list[dict]) -> dict:
    """Windows stacked into a batch ([B, T, ...]), cut to the shortest; hidden states in float32."""
    T = min(w["tokens"].shape[0] for w in windows)
    batch = {k: torch.stack([w[k][:T] for w in windows]) for k in windows[0]}
    return {**batch, "hidden": batch["hidden"].float()}


def choose_vocab(shards: list[Path], size: int, vocab: int) -> torch.Tensor:
    """The `size` tokens the target chose most often (ties: those frequent in the text), sorted ids."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for path in shards:
        t = load_file(str(path))
        counts += torch.bincount(t["target_next"], minlength=vocab) * 4 + torch.bincount(t["tokens"], minlength=vocab)
    size = min(size, int((counts > 0).sum()))
    return torch.topk(counts.float(), size).indices.sort().values


def tokens_by_source(shards: list[Path]) -> dict[str, int]:
    """Tokens per source, read from the shards' headers. Example: {"self_distill": 3072, "stdlib": 24064}."""
    sources: dict[str, int] = {}
    for path in shards:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        source = header["__metadata__"]["source"]
        sources[source] = sources.get(source, 0) + header["tokens"]["shape"][0]
    return sources
