"""The memory budget: weights of target and draft first, then the KV caches of both from what remains.

`--memory-utilization F` is the fraction of device memory (GPU) or of system memory (CPU) specdec may
use, as vLLM's `--gpu-memory-utilization`. Without it: 0.9 of a GPU; on CPU, the weights plus
`CPU_CACHE_SPACE` (4 GiB, as vLLM's CPU backend reserves by default, VLLM_CPU_KVCACHE_SPACE) for the K/V
of the running sequences and the prefix cache together, or the running sequences' K/V if more, at most 0.9
of RAM (`default_budget`): a machine others share is not filled by a cache that grows with every distinct
prompt. Every running sequence holds pages of the target's cache and of the draft's as it grows (paged K/V,
`KVCache`): the pool holds `max_num_seqs` sequences of `row_len` (4096 by default), or fewer, longer ones (up
to `max_model_len`, the model's own context by default) side by side with short ones, so the budget decides
how many sequences run at once. With prefix
caching, what the running sequences leave of the budget holds cached prefixes (blocks of the target's and
the draft's K/V, set aside as pages of their pools, or EAGLE's in a pool of their own; see
`specdec.engine.prefix_cache`).

Example: budget 10 GiB, weights 2.0 + 0.7 GiB, KV 28 KiB/token (target) + 12 KiB/token (draft),
max_model_len 4096 -> 160 MiB a sequence -> min(requested, 46) sequences. Requesting 8 leaves
7.3 - 1.25 = 6.05 GiB for the prefix cache: 9912 blocks of 16 tokens (640 KiB each).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specdec.engine.prefix_cache import BLOCK_SIZE
from specdec.models.kv_cache import PAGE

GiB = 1024 ** 3
DEFAULT_UTILIZATION = 0.9  # of the device's memory, when no fraction is given (of RAM at most, on CPU)
CPU_CACHE_SPACE = 4 * GiB  # K/V space on CPU by default: the running sequences' and the prefix cache's
SUFFIX_BYTES_PER_TOKEN = 800  # suffix decoding's tries, depth 24, on code (benchmarks/bench_suffix_trie.py)


class MemoryBudgetError(RuntimeError):
    pass


def device_memory(device: torch.device) -> int:
    """Total bytes of the device (GPU) or of the machine (CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    target_weights: int
    draft_weights: int
    target_kv_per_token: int
    draft_kv_per_token: int
    max_model_len: int
    max_num_seqs: int
    draft_label: str = "draft"  # what drafts: "draft" (a model) or "heads" (Medusa, EAGLE)
    prefix_cache_blocks: int = 0  # blocks of `prefix_block_size` tokens (0: no prefix caching)
    prefix_block_size: int = BLOCK_SIZE
    suffix_cached_requests: int | None = None  # suffix decoding: outputs its global tries keep (None: not used)
    budget_note: str = ""  # how the budget was chosen, for the report
    row_len: int = 0  # a row's length while short sequences run (0: max_model_len, every row that long)
    context_note: str = ""  # why max_model_len is below the model's own, for the report

    @property
    def kv_tokens(self) -> int:
        """Slots the running sequences share (in pages): `max_num_seqs` of `row_len`, or fewer, longer ones."""
        return max(self.max_num_seqs * (self.row_len or self.max_model_len), self.max_model_len)

    @property
    def target_kv(self) -> int:
        return self.kv_tokens * self.target_kv_per_token

    @property
    def draft_kv(self) -> int:
        return self.kv_tokens * self.draft_kv_per_token

    @property
    def prefix_cache(self) -> int:
        return self.prefix_cache_blocks * self.prefix_block_size * (self.target_kv_per_token + self.draft_kv_per_token)

    def as_dict(self) -> dict[str, int]:
        return {
            "budget": self.budget, "target_weights": self.target_weights, "draft_weights": self.draft_weights,
            "target_kv": self.target_kv, "draft_kv": self.draft_kv, "kv_tokens": self.kv_tokens,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "prefix_cache": self.prefix_cache, "prefix_cache_blocks": self.prefix_cache_blocks,
            "row_len": self.row_len or self.max_model_len,
        }

    def report(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GiB:7.3f} GiB"

        used = self.target_weights + self.draft_weights + self.target_kv + self.draft_kv + self.prefix_cache
        prefix = f"{self.prefix_cache_blocks} blocks of {self.prefix_block_size} tokens" if self.prefix_cache_blocks \
            else "off"
        return "\n".join([
            f"memory budget      {gib(self.budget)}" + (f"  ({self.budget_note})" if self.budget_note else ""),
            f"  target weights   {gib(self.target_weights)}",
            f"  {self.draft_label + ' weights':17}{gib(self.draft_weights)}",
            f"  target KV cache  {gib(self.target_kv)}  ({self.target_kv_per_token} B/token)",
            f"  {self.draft_label + ' KV cache':17}{gib(self.draft_kv)}  ({self.draft_kv_per_token} B/token)",
            f"  prefix cache     {gib(self.prefix_cache)}  ({prefix})",
            *([f"  suffix tries     not reserved: grow with the running requests' tokens and the last "
               f"{self.suffix_cached_requests} outputs, about {SUFFIX_BYTES_PER_TOKEN} B a token"]
              if self.suffix_cached_requests is not None else []),
            f"  total            {gib(used)}",
            *([f"max_model_len      {self.max_model_len} ({self.context_note})"] if self.context_note else []),
            f"fits {self.kv_tokens} tokens: {self.max_num_seqs} sequences of up to {self.max_model_len} tokens"
            if not self.row_len or self.row_len >= self.max_model_len else
            f"fits {self.kv_tokens} tokens: {self.max_num_seqs} sequences of up to {self.row_len} tokens, or fewer "
            f"longer ones ({self.kv_tokens // self.max_model_len} of up to {self.max_model_len}), in pages of "
            f"{PAGE} tokens: a long one runs beside short ones while their lengths fit",
            *([f"  and up to {self.kv_tokens + self.prefix_cache_blocks * self.prefix_block_size} tokens by taking "
               f"the prefix cache's pages (evicting cached prefixes that no running sequence reads)"]
              if self.prefix_cache_blocks and self.prefix_block_size == PAGE and self._draft_pages_mapped else []),
        ])

    @property
    def _draft_pages_mapped(self) -> bool:
        """Whether the draft's K/V, if any, keep prefix-cache blocks as their pages (a draft model's; EAGLE's
        pairs are copied, and its pool bounds the running sequences at `kv_tokens`)."""
        return self.draft_kv_per_token == 0 or self.draft_label == "draft"


def default_budget(device: torch.device, total: int) -> tuple[int, int | None]:
    """(budget, cache space) when no fraction is given: `DEFAULT_UTILIZATION` of `total` bytes, and on CPU
    `CPU_CACHE_SPACE` for the caches beyond the weights (`plan_memory(cache_space=...)` lowers the budget to
    it); None on a GPU, whose memory is the engine's alone."""
    return int(DEFAULT_UTILIZATION * total), (None if device.type == "cuda" else CPU_CACHE_SPACE)


def plan_memory(
    budget: int,
    target_weights: int,
    draft_weights: int,
    target_kv_per_token: int,
    draft_kv_per_token: int,
    max_model_len: int,
    max_num_seqs: int,
    draft_label: str = "draft",
    prefix_caching: bool = False,
    cache_space: int | None = None,
    row_len: int | None = None,
    lower_to_fit: bool = False,
) -> MemoryPlan:
    """Fit weights, then as many sequences (up to `max_num_seqs`) of `max_model_len` tokens as remain room, then
    (with `prefix_caching`) as many prefix-cache blocks as the rest holds. With `cache_space` (CPU's default)
    the budget is at most the weights plus that much for the caches, or plus the K/V of `max_num_seqs`
    sequences if that is more (the space goes to the prefix cache first shrunk, never to fewer sequences).
    Example: 23.5 GiB of RAM, weights 1.5 GiB, 8 sequences of 160 MiB: budget min(21.2, 1.5 + 4) = 5.5 GiB,
    prefix cache 2.75 GiB.

    With `row_len` the pool holds `max_num_seqs` sequences of that length, or fewer, longer ones up to
    `max_model_len` (at least one sequence of `max_model_len`), in the same pages: the model's 32768-token
    context costs short requests neither their batch nor the
    prefix cache. With `lower_to_fit` (max_model_len is the model's own, not asked for) a budget that cannot
    hold one sequence of `max_model_len` lowers it to what it holds, and the plan says so.
    Example: weights 1.5 GiB + 4 GiB, 28 KiB/token, max_model_len 32768, row_len 4096, 8 sequences: pages
    for 32768 slots (896 MiB: 8 sequences of 4096, or 1 of 32768, or 1 of 16384 and 4 of 4096), prefix cache
    3.1 GiB."""
    weights = target_weights + draft_weights
    per_token = target_kv_per_token + draft_kv_per_token
    row_len = min(row_len or max_model_len, max_model_len)
    per_seq = row_len * per_token
    note = context_note = ""
    if cache_space is not None:
        caches = max(cache_space, max_num_seqs * per_seq, max_model_len * per_token)
        if weights + caches < budget:
            budget = weights + caches
            note = (f"the weights + {caches / GiB:.2f} GiB for K/V caches, the CPU default; "
                    f"--gpu-memory-utilization F takes F of RAM")
    if weights > budget:
        raise MemoryBudgetError(
            f"the weights alone do not fit the memory budget: target {target_weights / GiB:.3f} GiB + {draft_label} "
            f"{draft_weights / GiB:.3f} GiB = {weights / GiB:.3f} GiB > budget {budget / GiB:.3f} GiB; raise "
            f"--memory-utilization or use a smaller model"
        )
    if lower_to_fit and weights <= budget and (budget - weights) < max_model_len * per_token:
        fitting = (budget - weights) // per_token // BLOCK_SIZE * BLOCK_SIZE
        if fitting >= BLOCK_SIZE:
            context_note = (f"lowered from the model's {max_model_len}: the memory budget holds one sequence of "
                            f"{fitting} tokens")
            max_model_len, row_len = fitting, min(row_len, fitting)
            per_seq = row_len * per_token
    fits = (budget - weights) // per_seq
    if fits < 1:
        raise MemoryBudgetError(
            f"after the weights ({weights / GiB:.3f} GiB) the budget of {budget / GiB:.3f} GiB leaves "
            f"{(budget - weights) / GiB:.3f} GiB, less than the KV cache of one sequence of {max_model_len} "
            f"tokens ({per_seq / GiB:.3f} GiB); lower --max-model-len or raise --memory-utilization"
        )
    num_seqs = int(min(max_num_seqs, fits))
    rows = max(num_seqs * row_len, max_model_len) * per_token
    if rows > budget - weights:
        raise MemoryBudgetError(
            f"after the weights ({weights / GiB:.3f} GiB) the budget of {budget / GiB:.3f} GiB leaves "
            f"{(budget - weights) / GiB:.3f} GiB, less than the KV cache of one sequence of {max_model_len} "
            f"tokens ({max_model_len * per_token / GiB:.3f} GiB); lower --max-model-len or raise --memory-utilization"
        )
    blocks = 0
    if prefix_caching:
        blocks = (budget - weights - rows) // (BLOCK_SIZE * per_token)
    return MemoryPlan(budget, target_weights, draft_weights, target_kv_per_token, draft_kv_per_token,
                      max_model_len, num_seqs, draft_label, int(blocks), budget_note=note,
                      row_len=row_len if row_len < max_model_len else 0, context_note=context_note)
