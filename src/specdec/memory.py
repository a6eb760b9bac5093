"""The memory budget: weights of target and draft first, then the KV caches of both from what remains.

`--memory-utilization F` is the fraction of device memory (GPU) or of system memory (CPU) specdec may
use, as vLLM's `--gpu-memory-utilization`. Every running sequence reserves `max_model_len` slots in the
target's cache and in the draft's, so the budget decides how many sequences run at once.

Example: budget 10 GiB, weights 2.0 + 0.7 GiB, KV 28 KiB/token (target) + 12 KiB/token (draft),
max_model_len 4096 -> 160 MiB a sequence -> min(requested, 46) sequences.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GiB = 1024 ** 3


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

    @property
    def kv_tokens(self) -> int:
        return self.max_num_seqs * self.max_model_len

    @property
    def target_kv(self) -> int:
        return self.kv_tokens * self.target_kv_per_token

    @property
    def draft_kv(self) -> int:
        return self.kv_tokens * self.draft_kv_per_token

    def as_dict(self) -> dict[str, int]:
        return {
            "budget": self.budget, "target_weights": self.target_weights, "draft_weights": self.draft_weights,
            "target_kv": self.target_kv, "draft_kv": self.draft_kv, "kv_tokens": self.kv_tokens,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
        }

    def report(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GiB:7.3f} GiB"

        used = self.target_weights + self.draft_weights + self.target_kv + self.draft_kv
        return "\n".join([
            f"memory budget      {gib(self.budget)}",
            f"  target weights   {gib(self.target_weights)}",
            f"  {self.draft_label + ' weights':17}{gib(self.draft_weights)}",
            f"  target KV cache  {gib(self.target_kv)}  ({self.target_kv_per_token} B/token)",
            f"  {self.draft_label + ' KV cache':17}{gib(self.draft_kv)}  ({self.draft_kv_per_token} B/token)",
            f"  total            {gib(used)}",
            f"fits {self.kv_tokens} tokens: {self.max_num_seqs} sequences of up to {self.max_model_len} tokens",
        ])


def plan_memory(
    budget: int,
    target_weights: int,
    draft_weights: int,
    target_kv_per_token: int,
    draft_kv_per_token: int,
    max_model_len: int,
    max_num_seqs: int,
    draft_label: str = "draft",
) -> MemoryPlan:
    """Fit weights, then as many sequences (up to `max_num_seqs`) of `max_model_len` tokens as remain room."""
    weights = target_weights + draft_weights
    if weights > budget:
        raise MemoryBudgetError(
            f"the weights alone do not fit the memory budget: target {target_weights / GiB:.3f} GiB + {draft_label} "
            f"{draft_weights / GiB:.3f} GiB = {weights / GiB:.3f} GiB > budget {budget / GiB:.3f} GiB; raise "
            f"--memory-utilization or use a smaller model"
        )
    per_seq = max_model_len * (target_kv_per_token + draft_kv_per_token)
    fits = (budget - weights) // per_seq
    if fits < 1:
        raise MemoryBudgetError(
            f"after the weights ({weights / GiB:.3f} GiB) the budget of {budget / GiB:.3f} GiB leaves "
            f"{(budget - weights) / GiB:.3f} GiB, less than the KV cache of one sequence of {max_model_len} "
            f"tokens ({per_seq / GiB:.3f} GiB); lower --max-model-len or raise --memory-utilization"
        )
    return MemoryPlan(budget, target_weights, draft_weights, target_kv_per_token, draft_kv_per_token,
                      max_model_len, int(min(max_num_seqs, fits)), draft_label)
