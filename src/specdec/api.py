"""The Python entry point, shaped like vLLM's offline API.

    llm = specdec.LLM(model="qwen2.5-coder-1.5b-instruct",
                      speculative_model="qwen2.5-coder-0.5b-instruct", num_speculative_tokens=5)
    out = llm.generate(["def quicksort(arr):"], specdec.SamplingParams(temperature=0, max_tokens=64))
    print(out[0].text, out[0].metrics.mean_acceptance_length)

Prefixes are cached across calls (`enable_prefix_caching`, on by default): a conversation sent again with
one more turn prefills only what is new (`out[0].metrics.cached_tokens` tells how much was not). With
`prefix_cache_disk=True` (on by default in `specdec serve`) the target's cached blocks are also kept on disk
(`prefix_cache_dir`, default $SPECDEC_HOME/kv), so that another process, or this one after a restart, reads
them back instead of computing them (`metrics.disk_cached_tokens`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from specdec.config import (KV_FORMATS, CacheConfig, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig,
                            specdec_home)
from specdec.engine import Engine
from specdec.engine.disk_cache import NUMERICS_VERSION, DiskTier, drafter_name, file_digest, namespace
from specdec.engine.memory import default_budget, device_memory, plan_memory
from specdec.engine.outputs import RequestOutput
from specdec.fan_out import pick_best, sub_requests
from specdec.methods import METHODS, Suffix
from specdec.models.kv_cache import KVCache
from specdec.models.llama import Transformer
from specdec.models.loading import load_checkpoint, load_quantized, resolve_dtype
from specdec.models.quant import BLOCK_FORMATS, quantize_linears, resolve_quantization
from specdec.models.store import resolve_model
from specdec.models.tokenizer import Tokenizer
from specdec.speculative.build import build_proposer
from specdec.speculative.drafters import load_drafters, model_bytes

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_NUM_SPECULATIVE_TOKENS = 5
DEFAULT_PREFIX_CACHE_DISK_GB = 8.0  # the disk tier's budget (`specdec serve --prefix-cache-disk-gb`)
DEFAULT_ROW_LEN = 4096  # the memory plan's K/V: max_num_seqs sequences of this length (or fewer, longer ones)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    name_or_path: str, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> tuple[Transformer, Tokenizer, Path]:
    """Load a checkpoint (path or known name); quantized weights run with bf16 activations."""
    path = resolve_model(name_or_path)
    if quantization in BLOCK_FORMATS:
        _, model, tokenizer = load_quantized(path, quantization, torch.bfloat16)
        model.requires_grad_(False)
        return model, tokenizer, path
    if quantization != "none":
        dtype = torch.bfloat16
    config, state_dict, tokenizer = load_checkpoint(path, dtype, device)
    model = Transformer.from_state_dict(config, state_dict)
    quantize_linears(model, quantization)
    model.requires_grad_(False)  # inference only: no autograd bookkeeping
    return model, tokenizer, path


def parse_speculative_config(text: str | None) -> dict[str, Any] | None:
    """--speculative-config's JSON object (None stays None); anything else is a ValueError saying so."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return value


def build_speculative_config(
    speculative_model: str | None,
    num_speculative_tokens: int | None,
    speculative_config: dict[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """vLLM's flags -> one SpeculativeConfig (None: no speculation).

    No flags: auto speculation (`{"method": "auto"}`: suffix drafts, and the heads shipped for the target
    where there are some); `--num-speculative-tokens 0` alone: none. `--speculative-model D` alone drafts
    adaptively with up to 5 tokens, beside suffix drafts; adding `--num-speculative-tokens K` fixes its K (as in
    vLLM: each of its drafts holds K tokens; it drafts where that pays); `{"adaptive": true}` in the config
    makes K a maximum. `{"method": "suffix"}` drafts adaptively with up to `suffix_decoding_max_tree_depth`
    tokens (24).
    """
    if isinstance(speculative_config, str):
        speculative_config = parse_speculative_config(speculative_config)
    if speculative_config is None and speculative_model is None:
        if num_speculative_tokens == 0:
            return None
        if num_speculative_tokens:
            raise ValueError("--num-speculative-tokens needs --speculative-model or --speculative-config "
                             "(0 alone: no speculation)")
        speculative_config = {"method": "auto"}
    d = dict(speculative_config or {})
    if speculative_model is not None:
        d.setdefault("model", speculative_model)
    k_given = num_speculative_tokens is not None or "num_speculative_tokens" in d
    if num_speculative_tokens is not None:
        d["num_speculative_tokens"] = num_speculative_tokens
    record = METHODS.get(d["method"]) if isinstance(d.get("method"), str) else None
    if record is not None and record.suffix is Suffix.ALONE:  # as vLLM: K is the trie's depth, a maximum
        d.setdefault("num_speculative_tokens",
                     d.get("suffix_decoding_max_tree_depth", SpeculativeConfig.suffix_decoding_max_tree_depth))
    d.setdefault("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    d.setdefault("adaptive", not k_given)
    return SpeculativeConfig.from_dict(d)


def engine_config(spec: SpeculativeConfig | None, scheduler: SchedulerConfig, cache: CacheConfig) -> EngineConfig:
    """The engine's config for speculating as `spec` says (None: plain decoding): K is its longest draft
    (`SpeculativeConfig.max_tokens`); auto speculation and suffix drafts beside a drafter adapt by themselves."""
    return EngineConfig(scheduler, cache, num_speculative_tokens=spec.max_tokens if spec else 0,
                        adaptive=bool(spec and spec.adaptive and not spec.with_suffix),
                        disable_by_batch_size=spec.disable_by_batch_size if spec else None)


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_TARGET,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_config: dict[str, Any] | str | None = None,
        dtype: str = "auto",
        quantization: str = "auto",
        max_model_len: int | None = None,
        device: str | None = None,
        max_num_seqs: int = 1,
        memory_utilization: float | None = None,
        prefill_chunk: int = 512,
        prefill_itl_factor: float | None = 2.0,
        enable_prefix_caching: bool = True,
        prefix_caching_isolation: str = "shared",
        kv_cache_dtype: str = "auto",
        prefix_cache_disk: bool = False,
        prefix_cache_dir: str | None = None,
        prefix_cache_disk_gb: float = DEFAULT_PREFIX_CACHE_DISK_GB,
    ) -> None:
        if kv_cache_dtype not in KV_FORMATS:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_FORMATS)}")
        self.device = torch.device(device) if device else default_device()
        self.quantization = resolve_quantization(quantization, self.device)
        self.dtype = torch.bfloat16 if self.quantization != "none" else resolve_dtype(dtype, self.device)
        t0 = time.perf_counter()
        self.target, self.tokenizer, self.target_path = load_model(model, self.dtype, self.device, self.quantization)
        self.kv_cache_dtype = self.target.kv_format = kv_cache_dtype  # (a draft model's: `load_drafters`)
        self.load_time = time.perf_counter() - t0
        self.model_name = model
        # the model's own context unless asked for less (as vLLM), lowered by the plan if one sequence does not fit
        self.max_model_len = min(max_model_len or self.target.config.max_position_embeddings,
                                 self.target.config.max_position_embeddings)
        self.spec = build_speculative_config(speculative_model, num_speculative_tokens, speculative_config)
        self.drafters = load_drafters(self.spec, self.target, self.tokenizer, load_model, device=self.device,
                                      dtype=self.dtype, kv_format=kv_cache_dtype)
        self.heads, self.draft_model = self.drafters.heads, self.drafters.draft_model
        total = device_memory(self.device)  # None: 0.9 of a GPU; on CPU the weights + 4 GiB for caches (memory.py)
        budget, cache_space = default_budget(self.device, total) if memory_utilization is None else \
            (int(memory_utilization * total), None)
        self.memory_plan = plan_memory(
            budget=budget,
            cache_space=cache_space,
            target_weights=model_bytes(self.target),
            draft_weights=self.drafters.weights_bytes(),
            target_kv_per_token=KVCache.bytes_per_token(self.target.config, self.dtype, kv_cache_dtype),
            draft_kv_per_token=self.drafters.kv_bytes_per_token(self.dtype),
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            draft_label=self.drafters.memory_label,
            prefix_caching=enable_prefix_caching,
            row_len=DEFAULT_ROW_LEN,
            lower_to_fit=max_model_len is None,
        )
        self.max_model_len = self.memory_plan.max_model_len
        if self.spec is not None and self.spec.uses_suffix:
            self.memory_plan = dataclasses.replace(
                self.memory_plan, suffix_cached_requests=self.spec.suffix_decoding_max_cached_requests)
        # a draft's K/V cache (the engine gives it as many rows as the target's, paged from a pool as large)
        proposer = build_proposer(self.spec, vocab_size=self.target.config.vocab_size,
                                  max_num_seqs=self.memory_plan.max_num_seqs,
                                  max_model_len=self.memory_plan.row_len or self.max_model_len,
                                  draft_model=self.draft_model, heads=self.heads, special_ids=self.tokenizer.special_ids)
        self.prefix_disk = self._disk_tier(prefix_cache_dir, prefix_cache_disk_gb) \
            if prefix_cache_disk and self.memory_plan.prefix_cache_blocks > 0 else None
        memory = self.memory_plan
        self.engine_config = engine_config(self.spec, SchedulerConfig(
            self.max_model_len, memory.max_num_seqs, prefill_chunk, prefill_itl_factor, row_tokens=memory.kv_tokens),
            CacheConfig(memory.prefix_cache_blocks, memory.prefix_block_size, prefix_caching_isolation))
        self.engine = Engine(self.target, self.tokenizer, proposer, self.engine_config, prefix_disk=self.prefix_disk)
        self._ids = itertools.count()

    def engine_for(self, spec: SpeculativeConfig | None) -> Engine:
        """A new one-sequence engine on this LLM's target and tokenizer that speculates as `spec` says (None:
        plain decoding), with its own draft model or heads: how `specdec bench` compares methods on one
        loaded target (without a prefix cache: each method prefills its prompts). Its `proposer.memory_bytes` is
        the memory that drafting adds.

            llm = LLM("qwen2.5-coder-1.5b-instruct")
            ngram = llm.engine_for(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False))
        """
        drafters = load_drafters(spec, self.target, self.tokenizer, load_model, device=self.device, dtype=self.dtype,
                                 kv_format=self.kv_cache_dtype)
        proposer = build_proposer(spec, vocab_size=self.target.config.vocab_size, max_num_seqs=1,
                                  max_model_len=self.memory_plan.row_len or self.max_model_len,
                                  draft_model=drafters.draft_model, heads=drafters.heads,
                                  special_ids=self.tokenizer.special_ids)
        one = SchedulerConfig(self.max_model_len, max_batch_size=1, row_tokens=self.max_model_len)  # (one row)
        return Engine(self.target, self.tokenizer, proposer,
                      engine_config(spec, one, CacheConfig(prefix_block_size=self.memory_plan.prefix_block_size)))

    def _disk_tier(self, directory: str | None, gigabytes: float) -> DiskTier:
        """The prefix cache's disk tier: under `directory` (default $SPECDEC_PREFIX_CACHE_DIR, else
        $SPECDEC_HOME/kv), in a folder named by what
        decides the K/V's bits (the model file's digest, weights, dtypes, the K/V format, the kernels' numerics:
        the AMX build's attention tiles round otherwise), within `gigabytes` shared by the processes there. A
        draft model's or EAGLE's K/V are kept there too, in files named by their weights' digest and format."""
        if gigabytes <= 0:
            raise ValueError(f"prefix_cache_disk_gb must be positive, got {gigabytes}")
        numerics = self.device.type
        if numerics == "cpu" and self.quantization != "none":
            from specdec.kernels import qgemm

            numerics = "cpu-amx" if qgemm.best_isa() == "avx512amx" else "cpu"
            if self.target.residual_dtype is not None:  # (other arithmetic than SPECDEC_FP32_RESIDUAL=0's: other bits)
                numerics += "-fp32-residual"
        space = namespace(file_digest(self.target_path, specdec_home()), self.quantization, self.dtype,
                          self.kv_cache_dtype, numerics, NUMERICS_VERSION, self.memory_plan.prefix_block_size)
        root = directory or os.environ.get("SPECDEC_PREFIX_CACHE_DIR") or specdec_home() / "kv"
        names = {"target": "target"}
        parts = self.drafters.kv_name_parts()
        if parts is not None:  # the drafter's K/V beside the target's, named by what else decides their bits
            names["draft"] = drafter_name(*(file_digest(p, specdec_home()) if isinstance(p, Path) else p
                                            for p in parts))
        return DiskTier(Path(root), space, int(gigabytes * 2**30), names)

    # ----------------------------------------------------------------------------------- generation
    def generate(
        self, prompts: str | list[str] | list[list[int]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids). Returns one finished RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        return self._run(ids, sampling_params or SamplingParams())

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and complete it. `tools`, OpenAI function tools
        (`[{"type": "function", "function": {"name", "description", "parameters"}}]`), go to the template as in
        vLLM's `LLM.chat`; the answer is the raw text (`specdec.server.tool_calls.ToolCallParser` finds its
        calls). Messages go to the template as given: Qwen2.5's wants tool call `arguments` as dicts.
        Special-token text in the messages is plain text (see `Tokenizer.render_chat`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.tokenizer
        ids = [tok.encode_parts(tok.render_chat(c, tools=tools)) for c in conversations]  # type: ignore[arg-type]
        return self._run(ids, sampling_params or SamplingParams())

    def _run(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        """One finished output per prompt; with n > 1 (or best_of) its `outputs` holds the n completions
        (`pick_best`) and the output itself is the first of them."""
        plan = sub_requests(prompt_ids, params, lambda i, j: f"req-{next(self._ids)}")
        for sub in (sub for group in plan for sub in group):
            self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        results = []
        for group in plan:
            best = pick_best([finished[sub.request_id] for sub in group], params)
            if params.n > 1 or len(group) > 1:
                best[0].outputs = best
            results.append(best[0])
        return results

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (as vLLM's): the next requests prefill their whole prompts. With the disk
        tier, its blocks of this model and arithmetic go too (those of every process sharing its folder)."""
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.clear()
        if self.prefix_disk is not None:
            self.prefix_disk.clear()

    def describe(self) -> dict[str, Any]:
        """What was loaded, how it speculates, and the memory each part takes."""
        info: dict[str, Any] = {
            "model": self.model_name,
            "model_path": str(self.target_path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "max_model_len": self.max_model_len,
            "prefix_caching": self.engine.prefix_cache is not None,
            "prefix_caching_isolation": self.engine.prefix_isolation,
            "prefix_cache_disk": None if self.prefix_disk is None else {
                "dir": str(self.prefix_disk.dir), "budget_bytes": self.prefix_disk.budget,
                "used_bytes": self.prefix_disk.usage()},
            "load_time_s": round(self.load_time, 2),
            "memory_bytes": self.memory_plan.as_dict(),
            "speculative": None,
        }
        if self.spec is not None:
            suffix_bytes = self.engine.proposer.memory_bytes if self.spec.uses_suffix else None
            info["speculative"] = self.drafters.describe(self.spec, suffix_bytes)
        return info
