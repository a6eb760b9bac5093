"""The flags that describe an `LLM`, named and meaning as vLLM's, and the one function that builds the `LLM`
from them: shared by `specdec generate`, `specdec serve` and `specdec bench`, so that the three accept and
refuse the same things.

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_llm_arguments(parser)
    args = parser.parse_args(["tiny.gguf", "--speculative-model", "tiny.gguf", "--num-speculative-tokens", "3"])
    llm = build_llm(args, args.model, args.speculative_model)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from specdec.config import DTYPES, KV_FORMATS, QUANTIZATIONS

SPECULATION_DESTS = ("speculative_model", "num_speculative_tokens", "speculative_config",
                     "speculative_disable_by_batch_size", "shared_suffix_cache")


def add_weight_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """How a model's weights load: --dtype, --quantization, --device (also `train-heads`'s)."""
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="activations' dtype (auto: bfloat16 on CUDA and on CPUs with native bf16, else float32; "
                             "half = float16, float = float32, as in vLLM)")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="target weight format (auto: on CPU the GGUF's own blocks, Q8_0 for safetensors; "
                             "on CUDA none)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def add_llm_arguments(parser: argparse.ArgumentParser, speculation: bool = True) -> argparse.ArgumentParser:
    """The model and speculation flags. Without `speculation` (`bench`, which takes its methods from --methods)
    the speculation flags are absent and their values None, so that `build_llm` reads every namespace alike."""
    if speculation:
        spec = parser.add_argument_group("speculation (vLLM's flags)")
        spec.add_argument("--speculative-model", default=None, metavar="DRAFT", help="draft model (name or path)")
        spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                          help="draft K tokens per step (fixed K; without it K adapts up to 5)")
        spec.add_argument("--speculative-config", default=None, metavar="JSON",
                          help='speculation as JSON, as in vLLM: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        spec.add_argument("--shared-suffix-cache", action="store_true", default=None,
                          help="requests without a cache_salt draft from each other's outputs (suffix decoding's "
                               "global trie): for single-user servers. Off by default: how fast drafts are accepted "
                               "would tell one client what another's output held")
        spec.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                          help="stop speculating while more than N sequences run")
    else:
        parser.set_defaults(**dict.fromkeys(SPECULATION_DESTS))
    model = parser.add_argument_group("model (vLLM's flags)")
    add_weight_arguments(model)
    model.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                       help="context length in tokens (default: the model's own, lowered if one sequence of it "
                            "does not fit the memory budget)")
    model.add_argument("--kv-cache-dtype", default="auto", choices=KV_FORMATS,
                       help="K/V cache rows: auto (the activations' dtype) or q8_0 (8-bit with an fp16 scale per 32 "
                            "values, as llama.cpp's -ctk q8_0: about half the memory a token takes)")
    model.add_argument("--memory-utilization", "--gpu-memory-utilization", dest="memory_utilization",
                       type=fraction, default=None, metavar="F",
                       help="fraction of the device memory the engine may take, in (0, 1] (vLLM's "
                            "--gpu-memory-utilization: of the GPU's memory on CUDA, of RAM on CPU; default: 0.9 of a "
                            "GPU; on CPU the weights + 4 GiB for K/V caches, as vLLM's CPU backend, at most 0.9 of RAM)")
    model.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                       help="prompt tokens read per engine step at most (chunked prefill; default 512)")
    model.add_argument("--prefill-itl-factor", type=itl_factor, default=None, metavar="F",
                       help="while requests are decoding, a new prompt is read inside their steps, as many tokens "
                            "a step as keep each step within F times a decode step alone (measured), so that a long "
                            "prompt does not stall their streams (default 2; 0: read it in chunks of "
                            "--max-num-batched-tokens of its own, the running streams waiting for each)")
    model.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="keep the KV of finished requests' prefixes in what the memory budget leaves, so that a "
                            "request resending them (the next turn of a conversation) prefills only the rest "
                            "(default: on)")
    model.add_argument("--prefix-caching-isolation", choices=("shared", "salt"), default="shared",
                       help="shared (default, vLLM's): requests without a cache_salt share cached prefixes with each "
                            "other; salt: only requests with a cache_salt use the prefix cache, each salt its own "
                            "(for multi-tenant servers: cached_tokens and the time to first token then tell nothing "
                            "of another tenant's prompts)")
    model.add_argument("--prefix-cache-disk", action=argparse.BooleanOptionalAction, default=False,
                       help="also keep the prefix cache's blocks on disk, so that a restarted server, or another one "
                            "sharing the folder, reads a prompt it has seen instead of computing it (default: on for "
                            "`specdec serve`, off otherwise)")
    model.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="the disk tier's folder (default $SPECDEC_PREFIX_CACHE_DIR, else $SPECDEC_HOME/kv); "
                            "blocks go in a subfolder per model file and arithmetic")
    model.add_argument("--prefix-cache-disk-gb", type=float, default=None, metavar="GB",
                       help="the disk tier's size, shared by the processes using the folder (default 8)")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="devices per model: 1 (more are refused)")
    model.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                       help="pipeline stages: 1 (more are refused)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM's command lines; specdec never runs a model's code")
    model.add_argument("--enforce-eager", action="store_true",
                       help="accepted for vLLM's command lines; specdec always runs eagerly")
    return parser


def llm_kwargs(args: argparse.Namespace, model: str, draft: str | None) -> dict[str, Any]:
    """The `LLM`'s keyword arguments the flags give (what `build_llm` passes), after refusing, with a reason,
    values that cannot apply. Flags left out leave the `LLM`'s defaults.
    Example: `--num-speculative-tokens 3 --speculative-disable-by-batch-size 4` with draft "d" ->
    {"model": ..., "speculative_model": "d", "num_speculative_tokens": 3,
     "speculative_config": {"disable_by_batch_size": 4}, ...}."""
    check_vllm_flags(args)
    spec_config: dict[str, Any] | str | None = args.speculative_config
    extra = {}
    if args.speculative_disable_by_batch_size is not None:
        extra["disable_by_batch_size"] = args.speculative_disable_by_batch_size
    if args.shared_suffix_cache:
        extra["suffix_decoding_share_unsalted"] = True
    if extra:
        from specdec.api import parse_speculative_config

        spec_config = parse_speculative_config(spec_config) or {}
        if not spec_config and draft is None and not args.num_speculative_tokens:
            spec_config["method"] = "auto"  # (the default speculation, with these settings)
        spec_config.update(extra)
    kwargs: dict[str, Any] = dict(
        model=model, speculative_model=draft, num_speculative_tokens=args.num_speculative_tokens,
        speculative_config=spec_config, dtype=args.dtype, quantization=args.quantization,
        max_model_len=args.max_model_len, device=args.device, enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_isolation=args.prefix_caching_isolation, kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.prefix_cache_disk:
        kwargs["prefix_cache_disk"] = True
        kwargs["prefix_cache_dir"] = args.prefix_cache_dir
        if args.prefix_cache_disk_gb is not None:
            kwargs["prefix_cache_disk_gb"] = args.prefix_cache_disk_gb
    if args.memory_utilization is not None:
        kwargs["memory_utilization"] = args.memory_utilization
    if args.max_num_batched_tokens is not None:
        kwargs["prefill_chunk"] = args.max_num_batched_tokens
    if args.prefill_itl_factor is not None:
        kwargs["prefill_itl_factor"] = args.prefill_itl_factor or None
    return kwargs


def build_llm(args: argparse.Namespace, model: str, draft: str | None = None, max_num_seqs: int = 1):
    """The `LLM` the flags describe for target `model` drafted by `draft` (None: no draft model; the flags
    may still ask for n-gram or heads), known models pulled first (as vLLM downloads them)."""
    from specdec.api import LLM

    kwargs = llm_kwargs(args, model, draft)
    for name in (model, draft):
        if name is not None:
            pull_if_needed(name)
    return LLM(**kwargs, max_num_seqs=max_num_seqs)


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse, with a reason, vLLM flags whose values cannot apply here."""
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--pipeline-parallel-size", args.pipeline_parallel_size)):
        if value != 1:
            raise ValueError(f"{flag} {value}: specdec runs a model on one device; use {flag} 1")


def pull_if_needed(name_or_path: str) -> None:
    """A known model name not on this machine yet is pulled (verified) first, as vLLM downloads."""
    from specdec.models.store import ModelNotPulledError, pull, resolve_model

    try:
        resolve_model(name_or_path)
    except ModelNotPulledError:
        print(f"pulling {name_or_path} ...", file=sys.stderr)
        pull(name_or_path)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def itl_factor(text: str) -> float:
    value = float(text)
    if not (value == 0 or 1 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be above 1 (or 0: off), got {text}")
    return value
