"""`specdec train-heads`: train Medusa or EAGLE heads on the target's own features, offline.

    shards = features of the training windows (cached in OUT/features)
    run = _setup(...)      held-out split, reduced vocabulary, heads on the target, optimizer
    _loop(run, cfg)        AdamW steps, checkpoint every `checkpoint_every` steps (OUT/checkpoint.pt)
    _report(run, ...)      held-out top-1 agreement, data, losses, times -> OUT/report.json and the heads' config

Rerunning the same command resumes both the features and the training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from specdec.data import DATA_DIR
from specdec.heads.files import read_heads_config, save_heads
from specdec.heads.modules import (
    EagleHead, HeadsConfig, HeadsMismatchError, MedusaHeads, head_class, target_fingerprint,
)
from specdec.methods import METHODS, Recipe, either, resolve
from specdec.training.features import (
    choose_vocab, collate, extract_features, greedy_answers, humaneval_tasks, load_windows, prompt_split,
    function_prompts, self_distilled, solution_windows, stdlib_windows, tokens_by_source,
)
from specdec.training.losses import evaluate_chains, ttt_losses

HELD_OUT_TEXTS = ("solutions", "answers")  # TrainConfig.held_out_text


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
    # eagle: the units of the head's MLP (0: those of --init-from's head, else `HeadsConfig.for_target`'s);
    # wider than --init-from's grows that head (`EagleHead.init_from_eagle`)
    intermediate_size: int = 0
    epochs: int = 4
    batch_size: int = 4
    lr: float = 1e-3
    held_out: float = 0.08  # fraction of windows kept for the accuracy report
    # > 0: the report's held-out windows are instead HumanEval's eval-split tasks 0..N-1 (prompt + reference
    # solution), which no training run reads, and every window trains (a random share of the windows may be
    # ones that the heads of --init-from were trained on)
    held_out_tasks: int = 0
    # what of those tasks is held out: "solutions" (prompt + reference solution, cut to seq_len) or "answers"
    # (the whole prompt + the target's own greedy answer of self_distill_tokens, scored from the answer's first
    # drafted position: the text greedy decoding drafts on, where the report's walk figure estimates the
    # engine's tokens per pass)
    held_out_text: str = "solutions"
    checkpoint_every: int = 100
    eagle_cls_weight: float = 0.1  # EAGLE: weight of the token loss beside the feature loss
    # EAGLE-3 style (eagle with feature layers): the target layers fused into the head's input, and the
    # steps of training-time test (`ttt_losses`); empty: EAGLE-1's losses
    feature_layers: tuple[int, ...] = ()
    ttt_steps: int = 3
    # EAGLE-3: the share of each step's loss taken against the target's distribution over the heads' vocabulary
    # instead of its greedy choice alone (`ttt_losses`' soft)
    soft_labels: float = 0.0
    curve_every: int = 0  # held-out top-1 every this many steps (the report's `curve`); 0: at the end only
    distill_batch_size: int = 4
    solutions: int = 0  # HumanEval training-split tasks whose prompt + reference solution are windows
    # the target's own answers (self_distill_tokens each) to this many standard-library functions' def line and
    # docstring (`function_prompts`); a later run asking more adds the rest after the windows it has
    distill_functions: int = 0
    # EAGLE-3: start from these trained heads, EAGLE-1 (grown, `EagleHead.init_from_eagle`) or EAGLE-3 over the
    # same feature layers (continued with a new optimizer and schedule)
    init_from: Path | None = None
    threads: int = 0  # torch's intra-op threads while training (0: leave torch's setting)
    seed: int = 0
    data_dir: Path = DATA_DIR  # the prompt sets shipped with specdec (package data)
    prompts: tuple[tuple[int, ...], ...] | None = None  # self-distillation prompts instead of the data's train split

    @property
    def features_dir(self) -> Path:
        return self.features or self.out / "features"

    @property
    def recipe(self) -> Recipe:
        """How the heads of `method` train (`specdec.methods`)."""
        recipe = METHODS[self.method].training if self.method in METHODS else None
        if recipe is None:
            trained = [m.name for m in METHODS.values() if m.training]
            raise ValueError(f"train-heads trains {', '.join(trained)} heads, not {self.method!r}")
        return recipe

    @property
    def eagle3(self) -> bool:
        """EAGLE-3 style: feature layers given to a method that fuses them (then training-time test)."""
        return bool(self.recipe.feature_layers and self.feature_layers)


def train_heads(target, tokenizer, target_name: str, cfg: TrainConfig) -> dict:
    """Extract features (cached), train (resuming from the checkpoint), save the heads and report.json to
    cfg.out; return the report."""
    recipe = cfg.recipe  # (refuses a method train-heads does not train)
    if not 0 <= cfg.soft_labels <= 1:
        raise ValueError(f"soft_labels is a share of the loss, 0-1, not {cfg.soft_labels}")
    if cfg.soft_labels and not cfg.eagle3:
        raise ValueError("soft_labels apply to EAGLE-3 heads (--method eagle with --feature-layers)")
    if cfg.intermediate_size and not recipe.mlp:
        raise ValueError("intermediate_size is the EAGLE head's MLP; Medusa heads have none")
    if cfg.init_from and not recipe.feature_layers:
        fusing = [m.name for m in METHODS.values() if m.training and m.training.feature_layers]
        raise ValueError(f"init_from starts heads that fuse feature layers (--method {either(fusing)})")
    if not 0 <= cfg.held_out_tasks <= 100:
        raise ValueError(f"held_out_tasks must be 0-100 (HumanEval's eval split), not {cfg.held_out_tasks}")
    if cfg.held_out_text not in HELD_OUT_TEXTS:
        raise ValueError(f"held_out_text must be one of {', '.join(HELD_OUT_TEXTS)}, not {cfg.held_out_text!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    shards = extract_features(target, training_windows(target, tokenizer, cfg), cfg.features_dir, cfg.feature_layers)
    extract_time = time.perf_counter() - t0
    cfg.out.mkdir(parents=True, exist_ok=True)
    held_out = held_out_windows(target, tokenizer, cfg) if cfg.held_out_tasks else None
    with torch.inference_mode(False), torch.enable_grad():
        run = _setup(target, target_name, cfg, shards, held_out)
        _resume(run, cfg.out / "checkpoint.pt")
        before = None
        if run.step == 0:  # (with a curve: its first point, the heads as they start)
            start = _held_out(run, cfg)
            before, run.curve = start["held_out_top1"], [start] if cfg.curve_every else []
        _loop(run, cfg)
        report = _report(run, cfg, target_name, shards, extract_time, before)
        run.head.config = dataclasses.replace(run.head.config, training=report)
        save_heads(run.head, cfg.out)
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@torch.inference_mode()
def training_windows(target, tokenizer, cfg: TrainConfig) -> dict[str, list[list[int]]]:
    """The windows to train on by source, {"self_distill": [...], "stdlib": [...]}: the target's answers to
    the data's training split (or to cfg.prompts), and standard-library sources. Kept in
    features/windows.json, so that a rerun reads the same ones (and the target's answers, as they finish, in
    features/self_distill.jsonl, so that an interrupted run does not ask them again). The target's answers
    to standard-library functions ("stdlib_functions", `cfg.distill_functions`) come last and grow in
    stages: a run asking more than the manifest holds adds the rest after them, so every shard keeps its
    window."""
    manifest = cfg.features_dir / "windows.json"
    if manifest.exists():
        return _more_functions(target, tokenizer, cfg, json.loads(manifest.read_text()))
    if cfg.prompts is not None:
        prompts = [list(p) for p in cfg.prompts][: cfg.self_distill_prompts]
    elif cfg.self_distill_prompts:
        prompts = prompt_split(cfg.data_dir, tokenizer, "train")[: cfg.self_distill_prompts]
    else:
        prompts = []
    manifest.parent.mkdir(parents=True, exist_ok=True)
    distilled = self_distilled(target, tokenizer, prompts, cfg.self_distill_tokens, cfg.seq_len,
                               cfg.distill_batch_size, cfg.features_dir / "self_distill.jsonl") if prompts else []
    windows = {"self_distill": distilled, "stdlib": stdlib_windows(tokenizer, cfg.corpus_tokens, cfg.seq_len, cfg.seed)}
    if cfg.solutions:
        windows["humaneval_solutions"] = solution_windows(cfg.data_dir, tokenizer, cfg.solutions, cfg.seq_len)
    manifest.write_text(json.dumps(windows))
    return _more_functions(target, tokenizer, cfg, windows)


def _more_functions(target, tokenizer, cfg: TrainConfig, windows: dict[str, list[list[int]]]) -> dict:
    """`windows` with its "stdlib_functions" grown to cfg.distill_functions (last among the sources; never
    shrunk: the manifest's windows stay), the manifest rewritten when it grew."""
    have = len(windows.get("stdlib_functions", []))
    if cfg.distill_functions <= have:
        return windows
    prompts = function_prompts(tokenizer, cfg.distill_functions, cfg.seed)
    answers = self_distilled(target, tokenizer, prompts, cfg.self_distill_tokens, cfg.seq_len,
                             cfg.distill_batch_size, cfg.features_dir / "distill_functions.jsonl")
    windows = {k: v for k, v in windows.items() if k != "stdlib_functions"}
    windows["stdlib_functions"] = answers
    (cfg.features_dir / "windows.json").write_text(json.dumps(windows))
    return windows


@dataclass
class _Run:
    """What `_setup` builds; `_loop` advances `step`, `train_time` and `losses`."""

    head: MedusaHeads | EagleHead
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    train_windows: list[dict]
    eval_windows: list[dict]
    to_reduced: torch.Tensor  # [target vocab]: a token's id in the heads' vocabulary, -100 outside it
    steps_per_epoch: int
    total_steps: int
    step: int = 0
    train_time: float = 0.0  # seconds in training steps, over every run of the command
    losses: list[float] = field(default_factory=list)  # each step's loss in this run
    ttt_steps: int = 0  # EAGLE-3 heads: the steps of training-time test (0: other heads)
    curve: list[dict] = field(default_factory=list)  # held-out figures as training goes (`curve_every`)


@torch.inference_mode()
def held_out_windows(target, tokenizer, cfg: TrainConfig) -> list[dict]:
    """The held-out windows of `cfg.held_out_tasks` with their features (`load_windows`), kept as the others:
    solutions in features/held_out; answers in features/held_out_answers (the answers as they finish in its
    answers.jsonl), each window with its "scored_from" (`evaluate_chains`)."""
    if cfg.held_out_text == "solutions":
        windows = {"humaneval_eval": solution_windows(cfg.data_dir, tokenizer, cfg.held_out_tasks, cfg.seq_len, "eval")}
        return load_windows(extract_features(target, windows, cfg.features_dir / "held_out", cfg.feature_layers))
    folder = cfg.features_dir / "held_out_answers"
    folder.mkdir(parents=True, exist_ok=True)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(cfg.data_dir, "eval")[: cfg.held_out_tasks]]
    # whole prompts (a held-out window is read alone: no batch to cut it for), as a benchmark sends them
    answers = greedy_answers(target, tokenizer, prompts, cfg.self_distill_tokens, None, cfg.distill_batch_size,
                             folder / "answers.jsonl")
    texts = [prompt + answer for prompt, answer in answers]
    # the first pass that drafts reads the feature of the prompt's last token (and the answer's first token)
    starts = [len(prompt) - 1 for prompt, _ in answers]
    windows = load_windows(extract_features(target, {"humaneval_eval_answers": texts}, folder, cfg.feature_layers))
    return [{**w, "scored_from": start} for w, start in zip(windows, starts)]


def _setup(target, target_name: str, cfg: TrainConfig, shards: list[Path], held_out: list[dict] | None) -> _Run:
    """Hold out cfg.held_out of the windows (seeded; or train on all and evaluate on `held_out`), choose the
    heads' vocabulary on the training windows, build the heads on the target and their optimizer."""
    torch.manual_seed(cfg.seed)
    windows = load_windows(shards)
    order = list(range(len(windows)))
    random.Random(cfg.seed).shuffle(order)
    n_eval = 0 if held_out else max(1, int(len(windows) * cfg.held_out))
    start = _eagle_start(cfg.init_from, target, cfg.feature_layers, cfg.method) if cfg.init_from else None
    vocab_ids = start.vocab_ids if start is not None else \
        choose_vocab([shards[i] for i in order[n_eval:]], cfg.vocab_size, target.config.vocab_size)
    width = cfg.intermediate_size or (start.config.intermediate_size if start is not None else 0)
    head = _trainable_heads(target, target_name, cfg, vocab_ids, width)
    if start is not None:
        head.init_from_eagle(start)
    to_reduced = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    to_reduced[vocab_ids] = torch.arange(len(vocab_ids))
    params = [p for p in head.parameters() if p.requires_grad]
    steps_per_epoch = max(1, (len(windows) - n_eval) // cfg.batch_size)
    eval_windows = held_out if held_out else [windows[i] for i in order[:n_eval]]
    return _Run(head=head, params=params, optimizer=torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0),
                train_windows=[windows[i] for i in order[n_eval:]], eval_windows=eval_windows,
                to_reduced=to_reduced, steps_per_epoch=steps_per_epoch, total_steps=steps_per_epoch * cfg.epochs,
                ttt_steps=cfg.ttt_steps if cfg.eagle3 else 0)


def _eagle_start(folder: Path, target, feature_layers: tuple[int, ...] = (), method: str | None = None) -> EagleHead:
    """The trained EAGLE head in `folder` as saved (float32, not attached), for `EagleHead.init_from_eagle`:
    an EAGLE-1 head, or an EAGLE-3 head over `feature_layers`: heads of a method that fuses feature layers
    (`Recipe.feature_layers`), `method` where given (the one trained)."""
    config = read_heads_config(folder)
    fuses = METHODS[config.method].training.feature_layers
    if not fuses or method not in (None, config.method) or config.feature_layers not in ((), tuple(feature_layers)):
        raise ValueError(f"{folder} holds no EAGLE-1 head, nor an EAGLE-3 head over layers "
                         f"{', '.join(map(str, feature_layers))}, to start from")
    if config.target_fingerprint != target_fingerprint(target):
        raise HeadsMismatchError(f"the heads in {folder} were trained for another target ({config.target!r})")
    head = head_class(config.method)(config)
    head.load_state_dict(load_file(str(Path(folder) / "model.safetensors")))
    return head.float()


def _trainable_heads(target, target_name: str, cfg: TrainConfig, vocab_ids: torch.Tensor,
                     intermediate_size: int = 0) -> MedusaHeads | EagleHead:
    """New heads for `target` over `vocab_ids`, in float32 on the CPU, reading the target's output rows and
    (EAGLE) embeddings as normal tensors (the target may run in inference mode). An EAGLE head's MLP has
    `intermediate_size` units (0: the default shape's)."""
    recipe = cfg.recipe
    extra = {"num_heads": cfg.num_heads} if recipe.num_heads else {}
    if recipe.feature_layers:
        extra["feature_layers"] = cfg.feature_layers
    if recipe.mlp and intermediate_size:
        extra["intermediate_size"] = intermediate_size
    config = HeadsConfig.for_target(cfg.method, target, target_name, len(vocab_ids), **extra)
    head = head_class(cfg.method)(config)
    head.vocab_ids = vocab_ids.clone()
    head.float().attach(target)
    head.lm_rows = head.lm_rows.float().clone()
    if isinstance(head, EagleHead):
        table = target.embedding_table()
        head.embed = lambda ids: F.embedding(ids, table)
    return head.to("cpu")


def _resume(run: _Run, checkpoint: Path) -> None:
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        run.head.load_state_dict(state["head"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.step, run.train_time = state["step"], state["train_time"]
        run.curve = state.get("curve", [])
        print(f"resuming from step {run.step} of {run.total_steps}")


def _loop(run: _Run, cfg: TrainConfig) -> None:
    """Train to run.total_steps: batches of each epoch in a seeded order, `cosine_lr`, gradients clipped to
    norm 1; a checkpoint every cfg.checkpoint_every steps and at the end."""
    if run.ttt_steps:  # (EAGLE-3 style)
        losses_fn = partial(ttt_losses, steps=run.ttt_steps, soft=cfg.soft_labels)
    elif cfg.recipe.cls_weight:
        losses_fn = partial(resolve(cfg.recipe.losses), cls_weight=cfg.eagle_cls_weight)
    else:
        losses_fn = resolve(cfg.recipe.losses)
    warmup = min(20, run.total_steps // 10)
    bar = tqdm(total=run.total_steps, initial=run.step, desc=f"train {cfg.method}", unit="step")
    while run.step < run.total_steps:
        epoch, i = divmod(run.step, run.steps_per_epoch)
        perm = list(range(len(run.train_windows)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(perm)
        batch = collate([run.train_windows[j] for j in perm[i * cfg.batch_size:(i + 1) * cfg.batch_size]])
        t = time.perf_counter()
        for group in run.optimizer.param_groups:
            group["lr"] = cosine_lr(run.step, run.total_steps, warmup, cfg.lr)
        loss = losses_fn(run.head, batch, run.to_reduced)[0]
        run.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.params, 1.0)
        run.optimizer.step()
        run.train_time += time.perf_counter() - t
        run.step += 1
        run.losses.append(loss.item())
        bar.set_postfix(loss=f"{_mean(run.losses[-20:]):.3f}")
        bar.update(1)
        if cfg.curve_every and run.step % cfg.curve_every == 0 and run.step < run.total_steps:
            run.curve.append(_held_out(run, cfg))
        if run.step % cfg.checkpoint_every == 0 or run.step == run.total_steps:
            torch.save({"head": run.head.state_dict(), "optimizer": run.optimizer.state_dict(), "step": run.step,
                        "train_time": run.train_time, "curve": run.curve}, cfg.out / "checkpoint.pt")
    bar.close()


def _held_out(run: _Run, cfg: TrainConfig) -> dict:
    """The held-out figures now: top-1 per head or step and (EAGLE-3) a chain's teacher-forced tokens per pass,
    after how many training tokens (windows seen x their length; the first epoch sees each once)."""
    per_step, chain, walked = evaluate_chains(run.head, run.eval_windows, run.to_reduced, run.ttt_steps)
    seen = min(run.step * cfg.batch_size, len(run.train_windows) * cfg.epochs)
    point = {"step": run.step, "epoch": round(run.step / run.steps_per_epoch, 3),
             "train_tokens_seen": seen * cfg.seq_len, "held_out_top1": per_step}
    if chain is None:
        return point
    return {**point, "chain_tokens_per_pass_estimate": chain, "chain_tokens_per_pass_walk": walked}


def cosine_lr(step: int, total_steps: int, warmup: int, peak: float) -> float:
    """A linear warm-up to `peak` over `warmup` steps, then a cosine decay to 0 at `total_steps`.
    Example: with total_steps 100, warmup 10, peak 1e-3: step 0 -> 1e-4, step 10 -> 1e-3, step 55 -> 5e-4."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def _report(run: _Run, cfg: TrainConfig, target_name: str, shards: list[Path], extract_time: float,
            before: list[float] | None) -> dict:
    """What was trained on and how well it went: held-out top-1 agreement before (None when resumed) and
    after, the data, the losses (first step of this run, mean of the last 20) and the times."""
    final = _held_out(run, cfg)
    accuracy = final["held_out_top1"]
    eval_labels = torch.cat([w["target_next"] for w in run.eval_windows])
    return {
        "method": cfg.method,
        "target": target_name,
        "data_tokens": tokens_by_source(shards),
        "windows": {"train": len(run.train_windows), "held_out": len(run.eval_windows), "seq_len": cfg.seq_len,
                    "held_out_from": _held_out_from(run, cfg)},
        "held_out_prompts": "HumanEval 0-99 and the first half of each Spec-Bench category are never trained on",
        "vocab_size": len(run.head.vocab_ids),
        "vocab_coverage_held_out": round(float((run.to_reduced[eval_labels] >= 0).float().mean()), 4),
        "init_from": str(cfg.init_from) if cfg.init_from else None,
        "steps": run.total_steps,
        "epochs": cfg.epochs,
        "lr": cfg.lr,
        **({"cls_weight": cfg.eagle_cls_weight} if cfg.recipe.cls_weight and not run.ttt_steps else {}),
        **({"feature_layers": list(cfg.feature_layers), "ttt_steps": run.ttt_steps, "soft_labels": cfg.soft_labels}
           if run.ttt_steps else {}),
        "batch_size": cfg.batch_size,
        "extract_time_s": round(extract_time, 1),
        "train_time_s": round(run.train_time, 1),
        "first_loss": run.losses[0] if run.losses else None,
        "final_loss": _mean(run.losses[-20:]),
        "parameters": sum(p.numel() for p in run.params),
        "held_out_top1_before": before,
        cfg.recipe.report_key: accuracy,
        **({"held_out_chain_tokens_per_pass_estimate": final["chain_tokens_per_pass_estimate"],
            "held_out_chain_tokens_per_pass_walk": final["chain_tokens_per_pass_walk"],
            "curve": [*run.curve, final]} if run.ttt_steps else {}),
    }


def _held_out_from(run: _Run, cfg: TrainConfig) -> str:
    if not cfg.held_out_tasks:
        return f"a random {cfg.held_out:.0%} of the windows"
    tasks = f"HumanEval tasks 0-{len(run.eval_windows) - 1}"
    if cfg.held_out_text == "solutions":
        return f"{tasks}, prompt + reference solution"
    return f"{tasks}, the target's greedy answers ({cfg.self_distill_tokens} tokens at most), scored on the answers"


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))
