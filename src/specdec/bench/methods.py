"""`--methods`: the ways of decoding a bench compares, each a name that maps to one SpeculativeConfig.

    plain                          no speculation (always run: the baseline)
    ngram[:k=K]                    prompt lookup
    suffix[:k=K][:adaptive][:tree][:local][:shared]
                                   suffix decoding (K: 24 unless given, a maximum); `tree`: the trie's branches;
                                   `local`: the request's own trie only (no global trie of past outputs);
                                   `shared`: the bench's requests (unsalted) share the global trie, as on a
                                   server with --shared-suffix-cache (without it: a server's default)
    draft:MODEL[:k=K][:adaptive][:vocab=N][:quant=Q][:suffix]
                                   a draft model (path or known name); `vocab=N`: it proposes only the
                                   first N token ids and the special tokens (`draft_vocab_size`);
                                   `quant=Q`: its weight format (`draft_quantization`, e.g. q4_0);
                                   `suffix`: suffix drafts beside it (what `--speculative-model` runs;
                                   without it, the draft model alone)
    medusa[:HEADS][:k=K][:tree][:quant=Q]
                                   Medusa heads (default: those shipped for the target, TARGET-medusa);
                                   `quant=Q`: their matrices' format (q8_0, the default, or q4_0)
    eagle[:HEADS][:k=K][:tree|:dynamic][:quant=Q]
                                   an EAGLE head (default: the shipped EAGLE-3 head, TARGET-eagle3, else
                                   TARGET-eagle)
    auto[:DRAFTER][:k=K][:adaptive][:local][:shared][:tree][:quant=Q]
                                   auto speculation: per sequence and step, suffix drafts or the second
                                   drafter's (heads or a draft model; default: the heads shipped for the
                                   target, none if there are none), whichever pays (what `serve` runs by default);
                                   `tree`: both drafts as one tree where they disagree and it pays (`auto_tree`)

K is the draft length (3 unless given), fixed unless `adaptive` (then K is the most the controller may
draft); `tree` drafts the default tree of depth K, `dynamic` EAGLE-2's. Example:

    >>> parse_method("draft:qwen2.5-coder-0.5b-instruct:k=4", "qwen2.5-coder-1.5b-instruct").spec.num_speculative_tokens
    4
    >>> parse_method("eagle:tree", "qwen2.5-coder-1.5b-instruct").spec.model
    'qwen2.5-coder-1.5b-instruct-eagle3'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.config import SpeculativeConfig
from specdec.methods import METHODS, Model, Suffix

DEFAULT_K = 3
KINDS = ("plain", "ngram", "suffix", "draft", "medusa", "eagle", "auto")
SPELLINGS = {"draft": "draft_model"}  # the bench's short names of speculative methods (the rest: the method's)
SUFFIX_K = 24  # suffix decoding: vLLM's default K, the depth of its tries


@dataclass(frozen=True)
class Method:
    name: str  # canonical: every option spelled out, e.g. "draft:qwen2.5-coder-0.5b-instruct:k=3"
    spec: SpeculativeConfig | None  # None: plain decoding

    @property
    def config_json(self) -> str | None:
        """The `--speculative-config` value that runs this method (None: plain decoding, no flag)."""
        if self.spec is None:
            return None
        s = self.spec
        d: dict = {"method": s.method}
        if s.model is not None:
            d["model"] = s.model
        d["num_speculative_tokens"] = s.num_speculative_tokens
        if s.adaptive:
            d["adaptive"] = True
        if s.tree is not None:
            d["tree"] = s.tree
        if s.suffix is not None:
            d["suffix"] = s.suffix
        if s.uses_suffix and s.suffix_decoding_max_cached_requests == 0:
            d["suffix_decoding_max_cached_requests"] = 0
        if s.suffix_decoding_share_unsalted:
            d["suffix_decoding_share_unsalted"] = True
        if s.draft_vocab_size is not None:
            d["draft_vocab_size"] = s.draft_vocab_size
        if s.draft_quantization != "auto":
            d["draft_quantization"] = s.draft_quantization
        return json.dumps(d)


def parse_method(text: str, target: str) -> Method:
    """One `--methods` entry; `target` names the shipped heads that medusa and eagle default to."""
    kind, *parts = text.strip().split(":")
    if kind not in KINDS:
        raise ValueError(f"unknown method {text!r}; methods: " + ", ".join(KINDS))
    if kind == "plain":
        if parts:
            raise ValueError(f"{text!r}: plain takes no options")
        return Method("plain", None)
    record = METHODS[SPELLINGS.get(kind, kind)]
    alone = record.suffix is Suffix.ALONE  # (suffix decoding: its trees are the trie's own, "dynamic")
    k, adaptive, tree, model, local = SUFFIX_K if alone else DEFAULT_K, False, None, None, False
    vocab = quant = None
    with_suffix, shared, extra_tree = record.suffix is Suffix.ALWAYS, False, False
    for part in parts:
        if part.startswith("k="):
            if not part[2:].isdigit() or int(part[2:]) < 1:
                raise ValueError(f"{text!r}: k must be a whole number >= 1")
            k = int(part[2:])
        elif part == "adaptive":
            adaptive = True
        elif part == "tree" and record.suffix is Suffix.ALWAYS:  # both drafters' drafts as one tree (`auto_tree`)
            extra_tree = True
        elif part in ("tree", "dynamic"):
            tree = "default" if part == "tree" and not alone else "dynamic"
        elif part == "local" and record.always_suffix:
            local = True
        elif part == "suffix" and record.suffix is Suffix.ON:
            with_suffix = True
        elif part == "shared" and (record.always_suffix or with_suffix):
            shared = True
        elif part.startswith("vocab=") and record.model is Model.DRAFT_MODEL:
            if not part[6:].isdigit() or int(part[6:]) < 1:
                raise ValueError(f"{text!r}: vocab must be a whole number >= 1")
            vocab = int(part[6:])
        elif part.startswith("quant=") and record.model is not Model.NONE:
            quant = part[6:]
        elif model is None and part:
            model = part
        else:
            raise ValueError(f"{text!r}: unknown option {part!r} (k=K, adaptive, tree, dynamic, local, shared, "
                             "vocab=N, quant=Q, suffix)")
    if record.model is Model.DRAFT_MODEL and model is None:
        raise ValueError(f"{text!r}: name the draft model, e.g. draft:qwen2.5-coder-0.5b-instruct")
    if record.model is Model.NONE and model is not None:
        raise ValueError(f"{text!r}: {kind} takes no model")
    named = [model] if model is not None else []  # medusa, eagle, auto: shown only when not the default drafter
    if record.model is Model.HEADS and model is None:
        model = shipped_heads_name(target, kind)
    extra = {"suffix_decoding_max_cached_requests": 0} if local else {}
    if vocab is not None:
        extra["draft_vocab_size"] = vocab
    if quant is not None:
        extra["draft_quantization"] = quant
    if shared:
        extra["suffix_decoding_share_unsalted"] = True
    if extra_tree:
        extra["auto_tree"] = True
    if record.suffix is Suffix.ON:  # (a draft model: alone unless `suffix`, the bench compares drafters one by one)
        extra["suffix"] = with_suffix
    spec = SpeculativeConfig(method=record.name, model=model,
                             num_speculative_tokens=k, adaptive=adaptive, tree=tree, **extra)
    options = [f"k={k}"] + (["adaptive"] if adaptive else []) + \
        {None: [], "default": ["tree"], "dynamic": ["tree" if alone else "dynamic"]}[tree] + \
        (["local"] if local else []) + ([f"vocab={vocab}"] if vocab is not None else []) + \
        ([f"quant={quant}"] if quant is not None else []) + \
        (["suffix"] if with_suffix and record.suffix is Suffix.ON else []) + \
        (["shared"] if shared else []) + (["tree"] if extra_tree else [])
    return Method(":".join([kind, *named, *options]), spec)


def parse_methods(text: str, target: str) -> list[Method]:
    """Comma-separated entries, plain first (added if missing), duplicates refused."""
    methods = [parse_method(t, target) for t in text.split(",") if t.strip()]
    if not any(m.spec is None for m in methods):
        methods.insert(0, Method("plain", None))
    methods.sort(key=lambda m: m.spec is not None)
    names = [m.name for m in methods]
    if len(set(names)) < len(names):
        raise ValueError(f"a method is listed twice: {', '.join(names)}")
    return methods


def default_methods(target: str) -> str:
    """plain and ngram; the default draft when the target is the default one; the shipped heads for it."""
    from specdec.api import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.heads.files import PRETRAINED

    methods = ["plain", "ngram", "suffix", "auto"]
    if target == DEFAULT_TARGET:
        methods.append(f"draft:{DEFAULT_DRAFT}")
    heads = [m.name for m in METHODS.values() if m.model is Model.HEADS]
    methods += [kind for kind in heads if (PRETRAINED / shipped_heads_name(target, kind)).is_dir()]
    return ",".join(methods)


def shipped_heads_name(target: str, kind: str) -> str:
    """The shipped heads that `kind` (medusa, eagle) defaults to for `target`: the first of its record's
    `shipped_suffixes` shipped, else the name the first would have. Example: the default target's eagle ->
    qwen2.5-coder-1.5b-instruct-eagle3."""
    from specdec.heads.files import PRETRAINED

    names = [f"{Path(target).name.removesuffix('.gguf')}-{suffix}" for suffix in METHODS[kind].shipped_suffixes]
    return next((name for name in names if (PRETRAINED / name).is_dir()), names[0])
