"""What a speculative config drafts with, loaded: a draft model, the target's heads, or neither (n-grams and
suffix drafts need no weights). The one place that loads what a config's method's `model` names (its record in
`specdec.methods`), as `build.py` builds its proposer; `LLM` asks, and never reads the method itself.

    drafters = load_drafters(spec, target, tokenizer, load_model, device=device, dtype=dtype)
    proposer = build_proposer(spec, ..., draft_model=drafters.draft_model, heads=drafters.heads)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.config import SpeculativeConfig
from specdec.heads.files import is_heads_folder, load_heads, resolve_heads, shipped_heads
from specdec.heads.modules import head_bytes
from specdec.methods import Model
from specdec.models.kv_cache import KVCache
from specdec.models.loading import resolve_dtype
from specdec.models.quant import resolve_quantization
from specdec.speculative.compat import check_draft_compatible

# load_model(name_or_path, dtype, device, quantization) -> (model, tokenizer, path): `specdec.api.load_model`
ModelLoader = Callable[[str, torch.dtype, torch.device, str], tuple]


@dataclass
class Drafters:
    """The weights a config drafts with (both None: n-grams, suffix drafts alone, or no speculation)."""

    draft_model: torch.nn.Module | None = None
    draft_quantization: str | None = None  # the draft model's, resolved ("q4_0", "none", ...)
    heads: torch.nn.Module | None = None
    path: Path | None = None  # the draft model's file or the heads' folder (what decides the bits of their K/V)

    def kv_name_parts(self) -> tuple | None:
        """What decides the bits of the drafter's own K/V beside the target's arithmetic (its weights' file, their
        format and dtype, its K/V format, the method), for `disk_cache.drafter_name`; None where it keeps none."""
        if self.draft_model is not None:
            return ("draft_model", self.path, self.draft_quantization, self.draft_model.dtype,
                    self.draft_model.kv_format, getattr(self.draft_model, "residual_dtype", None))
        if self.heads is not None and self.heads.keeps_kv:
            return (self.heads.config.method, self.path, self.heads.weight_format)
        return None

    @property
    def memory_label(self) -> str:
        """What the memory plan calls the drafting weights."""
        return "heads" if self.heads is not None else "draft"

    def weights_bytes(self) -> int:
        if self.draft_model is not None:
            return model_bytes(self.draft_model)
        return head_bytes(self.heads) if self.heads is not None else 0

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """The K/V cache a drafted token adds: a draft model's layers, or an EAGLE head's one layer."""
        if self.draft_model is not None:
            return KVCache.bytes_per_token(self.draft_model.config, self.draft_model.dtype, self.draft_model.kv_format)
        if self.heads is not None and self.heads.keeps_kv:  # (Medusa heads keep no K/V)
            return KVCache.bytes_per_token(self.heads.config.layer_config(), dtype)
        return 0

    def second_drafter(self) -> str | None:
        """The drafter beside the suffix tries in auto speculation: the heads' method, "draft_model", or None."""
        if self.heads is not None:
            return self.heads.config.method
        return "draft_model" if self.draft_model is not None else None

    def describe(self, spec: SpeculativeConfig, suffix_cache_bytes: int | None) -> dict[str, Any]:
        """`LLM.describe()["speculative"]`: the config's method, K and what drafts, with the suffix tries' and
        the heads' settings where they run."""
        info: dict[str, Any] = {"method": spec.method, "model": spec.model,
                                "num_speculative_tokens": spec.num_speculative_tokens, "adaptive": spec.adaptive}
        if self.draft_model is not None:
            info["draft_quantization"] = self.draft_quantization
        if spec.with_suffix:
            second = self.second_drafter()
            info["drafters"] = ["suffix"] + ([second] if second else [])
        if spec.uses_suffix:
            info.update({k: getattr(spec, k) for k in (
                "tree", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
                "suffix_decoding_share_unsalted")})
            info["suffix_cache_bytes"] = suffix_cache_bytes
        if self.heads is not None:
            info.update(heads=self.heads.config.method, tree=spec.tree, heads_training=self.heads.config.training,
                        draft_quantization=self.heads.weight_format)
        return info


def model_bytes(model: torch.nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_drafters(spec: SpeculativeConfig | None, target, tokenizer, load_model: ModelLoader, *,
                  device: torch.device, dtype: torch.dtype, kv_format: str = "auto") -> Drafters:
    """Load what `spec` drafts with, for `target` (and its tokenizer, which a draft model's must match); a draft
    model's K/V caches in `kv_format` (`--kv-cache-dtype`, as the target's)."""
    if spec is None or spec.num_speculative_tokens == 0:
        return Drafters()
    name = _draft_model_name(spec)
    if name is not None:
        quantization = resolve_quantization(spec.draft_quantization, device)
        draft_dtype = resolve_dtype(spec.draft_dtype, device) if spec.draft_dtype else dtype
        draft, draft_tokenizer, path = load_model(name, draft_dtype, device, quantization)
        check_draft_compatible(tokenizer, draft_tokenizer, target.config, draft.config)
        draft.kv_format = kv_format
        return Drafters(draft_model=draft, draft_quantization=quantization, path=Path(path))
    folder = target_heads_folder(spec, target)
    return Drafters(heads=None if folder is None else load_heads(folder, target, *folder_method(spec),
                                                               quantization=spec.draft_quantization), path=folder)


def target_heads_folder(spec: SpeculativeConfig | None, target) -> Path | None:
    """The folder of the heads `spec` drafts with: its method's (`Model.HEADS`), or for one whose model may be
    either (`Model.ANY`: "auto") those it names, else those shipped for the target (None where there are none:
    auto speculation is then suffix drafts alone)."""
    if spec is None or spec.num_speculative_tokens == 0 or not spec.record.takes_heads:
        return None
    if spec.record.model is Model.ANY:
        if spec.model:
            return resolve_heads(spec.model) if is_heads_folder(spec.model) else None  # (else a draft model)
        return shipped_heads(target)
    return resolve_heads(spec.model)


def folder_method(spec: SpeculativeConfig) -> tuple:
    """`load_heads`' method argument: the config's method, or none for auto (the folder's own)."""
    return () if spec.record.model is Model.ANY else (spec.method,)


def _draft_model_name(spec: SpeculativeConfig) -> str | None:
    """The draft model `spec` names: its method's (`Model.DRAFT_MODEL`), or for one whose model may be either
    ("auto") a model that is not a heads folder."""
    record = spec.record
    if record.model is Model.DRAFT_MODEL or (record.model is Model.ANY and spec.model
                                             and not is_heads_folder(spec.model)):
        return spec.model
    return None

