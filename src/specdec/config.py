"""Frozen configuration dataclasses, built at the edge (CLI, server, Python API).

Components take only the fields they need; nothing here is mutated after construction.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.architectures import ARCHITECTURES, BY_MODEL_TYPE, Architecture, architecture
from specdec.methods import METHODS, Method, Suffix, either, method as method_record

# weight formats (see specdec.models.quant.resolve_quantization)


def specdec_home() -> Path:
    """Where specdec keeps what it fetches and measures: `$SPECDEC_HOME`, default ~/.cache/specdec (the pulled
    models, the kernels' tuning file)."""
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec")


QUANTIZATIONS = ("auto", "none", "gguf", "q8_0", "q4_0", "int8", "int4")
# activation dtypes by name: vLLM's (half = float16, float = float32) and the short ones
DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")
KV_FORMATS = ("auto", "q8_0")  # --kv-cache-dtype: the activations' dtype, or 8-bit rows (models/kv_cache.py)

@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder, read from `config.json` or GGUF metadata; `arch` says what its layers are made of
    (`specdec.architectures`), the fields here how big they are and how a given model sets them."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate: silu, or gelu_tanh (Gemma)
    # sliding-window attention: layer i sees the `sliding_window` latest keys, its own included, where
    # layer_types[i] == "sliding_attention" (transformers' rule, q - k < window); () = every layer sees all
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # the sliding layers' rope base (Gemma 3), else rope_theta's
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (Gemma), else by head_dim's
    # mixture of experts (`arch.moe`): a router picks num_experts_per_tok of num_experts MLPs per token
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum 1
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP in an MoE model (Qwen3-MoE's mlp_only_layers)

    def __post_init__(self) -> None:
        architecture(self.architecture)  # a clear error for a family specdec does not run
        _hidden_act(self.hidden_act)

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_moe(self, layer: int) -> bool:
        return self.arch.moe and self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dictionary (transformers 4 and 5 spellings alike)."""
        archs = cfg.get("architectures") or []
        family = BY_MODEL_TYPE.get(cfg.get("model_type", ""), ARCHITECTURES["LlamaForCausalLM"])
        arch = architecture(archs[0] if archs else family.hf_name)
        n_heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        params = cfg.get("rope_parameters") or {}
        local = params.get("sliding_attention", {})  # per layer type (transformers 5's Gemma 3)
        params = params.get("full_attention", params)
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        rope_theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
        if float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap) is not None:
                raise ValueError(f"{cap} is not supported (Gemma 2); Gemma 3 has none")
        window = cfg.get("sliding_window")
        types = tuple(cfg.get("layer_types") or ())
        if not types and window and cfg.get("use_sliding_window", True):  # Mistral, Phi-3: every layer
            types = ("sliding_attention",) * layers
        if not window or "sliding_attention" not in types:
            types, window = (), None
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        step, only = cfg.get("decoder_sparse_step") or 1, cfg.get("mlp_only_layers") or ()
        return cls(
            architecture=arch.hf_name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.embed_scale)),  # Gemma ties by default
            attention_bias=bool(cfg.get("attention_bias", arch.attention_bias)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=_hidden_act(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            layer_types=types,
            sliding_window=window,
            rope_local_theta=local.get("rope_theta") or cfg.get("rope_local_base_freq"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step) if experts else (),
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dictionary that `from_hf` (and transformers) reads back."""
        arch = self.arch
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": arch.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": _HF_ACTS[self.hidden_act],
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "attention_bias": self.attention_bias,
        }
        if arch.embed_scale:  # Gemma's spelling
            out["hidden_activation"] = out.pop("hidden_act")
        if self.layer_types:
            out.update(layer_types=list(self.layer_types), sliding_window=self.sliding_window, use_sliding_window=True)
        else:
            out.update(sliding_window=None, use_sliding_window=False)
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = self.rope_local_theta
        if self.query_pre_attn_scalar is not None:
            out["query_pre_attn_scalar"] = self.query_pre_attn_scalar
        if self.num_experts:
            out.update(num_local_experts=self.num_experts, num_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, mlp_only_layers=list(self.dense_layers), decoder_sparse_step=1)
        return out


# config.json's activation names -> specdec's
HIDDEN_ACTS = {"silu": "silu", "swish": "silu", "gelu_tanh": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def _hidden_act(name: str) -> str:
    if name not in HIDDEN_ACTS:
        raise ValueError(f"unsupported hidden_act {name!r}; specdec runs {', '.join(HIDDEN_ACTS)}")
    return HIDDEN_ACTS[name]


SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM): dividing by them overflows
# the largest temperature (OpenAI allows 2): generous, while logits divided by it stay numbers (a float32
# temperature of inf, from 1e39 on, turns masked logits into NaN)
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # the most alternatives a position reports (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token; named and applied as in vLLM. temperature < 1e-5 means greedy (exact argmax
    of the processed logits).

    Logits are processed in this order, at every position alike (drafted or not; see `specdec.sampling`):
    `logit_bias` (token id -> value added, clamped to [-100, 100]); `min_tokens` (EOS and `stop_token_ids`
    masked until that many tokens are out); penalties on what the sequence holds so far: `repetition_penalty`
    (prompt and output: positive logits divided by it, negative ones multiplied), `frequency_penalty`
    (output: minus it times the token's count) and `presence_penalty` (output: minus it once present); then
    greedy takes the argmax, sampling applies `temperature`, `min_p` (drops tokens under min_p times the
    most likely one's probability), `top_k`, `top_p`, and draws with `seed`.

    `logprobs`: report each emitted token's log-probability under that processed distribution and the
    `logprobs` most likely alternatives (0: the token's own only); `prompt_logprobs`: the same for the
    prompt's tokens, under the model's raw distribution. `response_format` constrains the output to JSON (a
    schema's), masking every position alike. `n` / `best_of` are for the callers that fan a
    request out into sequences (`LLM.generate`, the server); the engine runs one sequence per request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # given as a dict {token id: bias}
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    # structured output, OpenAI's shape: {"type": "json_object"} or {"type": "json_schema", "json_schema":
    # {"schema": {...}}}; every position (drafted or not) is masked by the grammar (see specdec.engine.structured)
    response_format: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        if any(math.isnan(b) for _, b in bias):
            raise ValueError("logit_bias values must be numbers, not NaN")
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((int(t), max(-100.0, min(100.0, float(b)))) for t, b in bias)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 to disable), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.01 <= self.repetition_penalty <= 2:  # dividing logits by less may overflow them
            raise ValueError(f"repetition_penalty must be in [0.01, 2], got {self.repetition_penalty}")
        if any(t < 0 for t in self.stop_token_ids) or any(t < 0 for t, _ in self.logit_bias):
            raise ValueError("token ids in stop_token_ids and logit_bias must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n={self.n}, got {self.best_of}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether logits need more than temperature/top-k/top-p/min-p (which act on one row alone)."""
        return bool(self.logit_bias or self.min_tokens or self.has_penalties)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What proposes drafts and how many tokens a step may draft.

    `num_speculative_tokens` is K, the most tokens one step drafts. `adaptive` lets the controller pick
    K in [0, K] each step from measured acceptance and cost; with `adaptive=False` K is fixed.

    `method="auto"` drafts, for each sequence and step, from the suffix tries or from a second drafter
    (`model`: heads or a draft model; None: the heads shipped for the target, if any), whichever is expected
    to give the most tokens per second, or not at all (`specdec.speculative.auto`). `suffix` adds the same
    suffix drafts to a draft model, Medusa or EAGLE chain (default: on for a draft model, the seed's command;
    off for heads, which are then the method alone); K is then the second drafter's, suffix drafts being as
    long as suffix decoding's (`suffix_decoding_max_tree_depth` at most).
    """

    method: str = "draft_model"
    model: str | None = None  # draft model (draft_model, auto) or head folder (medusa/eagle, auto)
    num_speculative_tokens: int = 5
    adaptive: bool = True
    suffix: bool | None = None  # suffix drafts beside the drafter (None: the method's default, see above)
    # prompt lookup (ngram)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft model numerics: weight-only quantization of the draft (never of the target)
    draft_quantization: str = "auto"  # one of QUANTIZATIONS
    draft_dtype: str | None = None
    # the draft proposes only the first draft_vocab_size token ids (its most frequent, in a BPE's merge order)
    # and the special tokens, and computes only their logits; None: every token
    draft_vocab_size: int | None = None
    disable_by_batch_size: int | None = None  # no speculation while more sequences than this run (vLLM)
    # medusa / eagle: a tree draft, as Medusa-style paths of child ranks ([[0], [1], [0, 0]]), "default"
    # (two guesses per depth) or "dynamic" (EAGLE-2: expand the tree_beam best nodes of each depth with
    # tree_top_k children); depth num_speculative_tokens. None: a chain of num_speculative_tokens
    tree: Any = None
    tree_top_k: int = 2
    tree_beam: int = 2
    # auto beside heads: where the trie and the heads disagree, both drafts as one tree's two branches when
    # that is expected to pay (one sequence running; `specdec.speculative.auto`)
    auto_tree: bool = False
    # suffix decoding (vLLM's keys and defaults): tries of depth max_tree_depth (match + draft lengths) over the
    # request and over the last max_cached_requests outputs (0: the request's own only); a draft of at most
    # max_spec_factor x the match length, of tokens whose empirical probability is >= min_token_prob.
    # tree "dynamic": the trie's own branches, best-first by probability (K tokens at most)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # requests without a cache_salt draft from each other's outputs (the global trie): for single-user servers.
    # Off by default: how fast drafts are accepted tells a client whether another's output held what it guessed
    suffix_decoding_share_unsalted: bool = False

    def __post_init__(self) -> None:
        record = method_record(self.method)  # (refuses a method specdec does not know)
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if record.needs_model and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a 'model'")
        if self.suffix is not None and not isinstance(self.suffix, bool):
            raise ValueError(f"suffix must be true or false, got {self.suffix!r}")
        if self.uses_suffix:
            self._check_suffix()
        if record.suffix is Suffix.ALWAYS and self.suffix is False:
            raise ValueError(f'method "{self.method}" drafts from the suffix tries: "suffix": false does not apply '
                             'to it')
        if self.with_suffix and self.tree is not None:
            raise ValueError(f'suffix drafts beside {self.method} need chains: drop "tree", or set "suffix": false')
        if record.suffix is Suffix.NEVER and self.suffix:
            tries = either([m.name for m in METHODS.values() if m.always_suffix], quote=True)
            raise ValueError(f'"suffix" does not apply to method "{self.method}" (use method {tries})')
        if self.tree is not None and not record.tree:
            trees = [m.name for m in METHODS.values() if m.tree]
            raise ValueError(f"tree drafts need method {either(trees)}, not {self.method!r}")
        if self.tree is not None and self.tree not in ("default", "dynamic") and not (
            isinstance(self.tree, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in self.tree)
        ):
            raise ValueError('tree must be "default", "dynamic" or a list of paths of child ranks, e.g. [[0], [1], [0, 0]]')
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 1):
            raise ValueError(f"draft_vocab_size must be a whole number >= 1, got {self.draft_vocab_size!r}")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.draft_quantization!r}")

    @property
    def record(self) -> Method:
        """What this config's method is (`specdec.methods`): what its model names, its trees, its builder."""
        return METHODS[self.method]

    @property
    def with_suffix(self) -> bool:
        """Whether suffix drafts run beside another drafter (`AutoProposer`): "auto", and a draft model or
        heads chain with `suffix` (by default a draft model: `Suffix.ON`)."""
        where = self.record.suffix
        if where in (Suffix.ON, Suffix.OFF):
            return self.suffix if self.suffix is not None else where is Suffix.ON
        return where is Suffix.ALWAYS

    @property
    def uses_suffix(self) -> bool:
        """Whether suffix drafts run at all: alone (method "suffix") or beside another drafter."""
        return self.record.suffix is Suffix.ALONE or self.with_suffix

    @property
    def max_tokens(self) -> int:
        """The most tokens one draft may hold: K, or with suffix drafts beside a drafter the larger of K and the
        trie's depth (a suffix draft is as long as suffix decoding's)."""
        if self.with_suffix and self.num_speculative_tokens > 0:
            return max(self.num_speculative_tokens, self.suffix_decoding_max_tree_depth)
        return self.num_speculative_tokens

    def _check_suffix(self) -> None:
        if self.with_suffix and self.tree is not None:
            return  # (refused in __post_init__)
        if self.tree not in (None, "dynamic"):
            raise ValueError('suffix decoding drafts chains, or trees with "tree": "dynamic" (the trie\'s own branches)')
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth={self.suffix_decoding_max_tree_depth} must be >= 1")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(f"suffix_decoding_max_cached_requests={self.suffix_decoding_max_cached_requests} "
                             "must be >= 0")
        if not self.suffix_decoding_max_spec_factor >= 0:
            raise ValueError(f"suffix_decoding_max_spec_factor={self.suffix_decoding_max_spec_factor} must be >= 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob={self.suffix_decoding_min_token_prob} must be in [0, 1]")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        d = dict(d)
        if "method" not in d:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)


@dataclass(frozen=True)
class SchedulerConfig:
    """Who runs and how their prompts are read (`specdec.engine.scheduler`, `specdec.engine.planner`).

    `row_tokens`: the K/V slots all running sequences share, in pages (None: `max_batch_size` sequences of
    `max_model_len`; fewer: sequences run while their lengths fit it). `prefill_chunk`: prompt tokens read per
    step, at most. `prefill_itl_factor`: while sequences decode, a joining prompt is read inside their steps,
    as many tokens a step as keep it within this factor of a decode step alone (`ChunkBudget`); None: in chunks
    of `prefill_chunk` of its own, each stalling them.
    """

    max_model_len: int = 4096
    max_batch_size: int = 1
    prefill_chunk: int = 512
    prefill_itl_factor: float | None = 2.0
    row_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


@dataclass(frozen=True)
class CacheConfig:
    """The prefix cache (`specdec.engine.prefix_cache`): `prefix_cache_blocks` blocks of `prefix_block_size`
    tokens (0: none); `prefix_isolation`: "shared" (vLLM's: requests without a `cache_salt` share cached
    prefixes with each other) or "salt" (only salted requests use it, each salt its own: how much of a prompt
    was cached tells nothing of another tenant's prompts)."""

    prefix_cache_blocks: int = 0
    prefix_block_size: int = 16  # tokens a block: vLLM's default (`prefix_cache.BLOCK_SIZE`)
    prefix_isolation: str = "shared"


@dataclass(frozen=True)
class EngineConfig:
    """What an `Engine` is built with: its scheduling, its prefix cache, and the bounds of its speculation
    (K, the most tokens a draft holds; `adaptive`: the controller picks K in [0, K] each step;
    `disable_by_batch_size`: no speculation while more sequences than this run). The caller resolves these
    from a `SpeculativeConfig` (`LLM`: its `max_tokens`, ...); a proposer that never drafts ignores them.

    `EngineConfig.of(max_model_len=256, prefix_cache_blocks=64)` names any field of the three."""

    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    num_speculative_tokens: int = 0
    adaptive: bool = False
    disable_by_batch_size: int | None = None

    @classmethod
    def of(cls, **settings: Any) -> "EngineConfig":
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> "EngineConfig":
        """A copy with the named fields of it, its `scheduler` or its `cache` set."""
        groups = {"scheduler": self.scheduler, "cache": self.cache}
        changes: dict[str, dict[str, Any]] = {"scheduler": {}, "cache": {}, "self": {}}
        for name, value in settings.items():
            group = next((g for g, c in groups.items() if name in {f.name for f in dataclasses.fields(c)}), "self")
            changes[group][name] = value
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, **changes["scheduler"]),
                                   cache=dataclasses.replace(self.cache, **changes["cache"]), **changes["self"])
