"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special ids, chat template and streaming decoder.

Built from a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`) or from GGUF metadata
(`tokenizer.ggml.*`: byte-level BPE, or SentencePiece BPE as Gemma's, which transformers' GGUF converter
builds), and saved as a folder that transformers loads too. The engine knows only token ids; text crosses
this boundary in `encode`, `decode`, `apply_chat_template` and `IncrementalDetokenizer`.
"""

from __future__ import annotations

import json
import re
import secrets
import unicodedata
from datetime import datetime
from fractions import Fraction
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# How each `tokenizer.ggml.pre` splits text before byte-level BPE (as llama.cpp's llama-vocab.cpp and the
# models' own tokenizer.json do).
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )


def _gpt2_split(individual_digits: bool) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]) if individual_digits else gpt2


# pre name -> (normalizer or None, pre-tokenizer factory)
PRE_TOKENIZERS = {
    "qwen2": (normalizers.NFC, lambda: _regex_split(_QWEN2_SPLIT)),
    "deepseek-r1-qwen": (normalizers.NFC, lambda: _regex_split(_QWEN2_SPLIT)),
    "smollm": (None, lambda: _gpt2_split(individual_digits=True)),
    "starcoder": (None, lambda: _gpt2_split(individual_digits=True)),
    "gpt-2": (None, lambda: _gpt2_split(individual_digits=False)),
}

WEIGH_PIECE = 1 << 18  # characters `fewest_tokens` weighs at a time when it may stop early

# Texts llama.cpp treats as end of generation when the vocabulary marks them CONTROL (llama-vocab.cpp).
EOG_TEXTS = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
)


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python value (str, number, bool or list), or `default`."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_eos_token_ids(reader, tokens: list[str] | None = None, token_types: list[int] | None = None) -> tuple[int, ...]:
    """End-of-generation ids, as llama.cpp collects them: eos, eot and eom ids, and CONTROL tokens named in
    `EOG_TEXTS`. Example, Qwen2.5 instruct: eos 151645 `<|im_end|>`, then 151643 `<|endoftext|>`."""
    tokens = tokens if tokens is not None else gguf_field(reader, "tokenizer.ggml.tokens", [])
    token_types = token_types if token_types is not None else gguf_field(reader, "tokenizer.ggml.token_type", [])
    ids = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids += [i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == CONTROL and t in EOG_TEXTS]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


class Tokenizer:
    """A model's tokenizer. Example:

    >>> tok = Tokenizer.from_folder("~/.cache/specdec/models/qwen2.5-coder-0.5b-instruct")
    >>> tok.encode("<|im_start|>user")            # [151644, 872]
    >>> tok.decode([151644, 872])                 # '<|im_start|>user'
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: dict[str, str | None],
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ):
        self._backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """From `tokenizer.json`, `tokenizer_config.json` and, for the eos ids, `generation_config.json`
        (what transformers' generate stops on) or `config.json`."""
        path = Path(path).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (specdec needs a fast-tokenizer file)")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos = eos if eos is not None else _read_json(path / "config.json").get("eos_token_id")
        if eos is None and special["eos_token"] is not None:
            eos = backend.token_to_id(special["eos_token"])
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: does the post-processor prepend BOS?
            bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
            add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            chat_template=_chat_template(path, cfg),
            add_bos_token=bool(add_bos),
        )

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """From a `gguf.GGUFReader`'s `tokenizer.ggml.*` metadata: byte-level BPE (`tokenizer.ggml.model`
        "gpt2": Qwen2.5, SmolLM2) or SentencePiece BPE with byte fallback ("llama": Gemma 3, Llama 2).
        Example, Gemma 3 270M: `encode("Hello world")` -> [9259, 1902] ('Hello', '▁world'), BOS 2 `<bos>`
        added, eos ids (1, 106): `<eos>` and `<end_of_turn>`."""
        model = gguf_field(reader, "tokenizer.ggml.model")
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        token_types = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
        if model == "gpt2":
            pre = gguf_field(reader, "tokenizer.ggml.pre", "gpt-2")
            if pre not in PRE_TOKENIZERS:
                raise ValueError(f"unknown GGUF pre-tokenizer {pre!r}; specdec knows {', '.join(PRE_TOKENIZERS)}")
            merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
            backend = _byte_level_bpe(tokens, merges, pre)
            _add_gguf_added_tokens(backend, tokens, token_types)
        elif model == "llama":
            backend = _sentencepiece_bpe(reader, tokens, token_types)
        else:
            raise NotImplementedError(f"GGUF tokenizer model {model!r} is not supported; specdec reads 'gpt2' "
                                      "(byte-level BPE) and 'llama' (SentencePiece BPE)")

        def text(key: str) -> str | None:
            i = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
            return None if i is None else tokens[i]

        return cls(
            backend,
            special_tokens={"bos_token": text("bos"), "eos_token": text("eos"), "pad_token": text("padding"), "unk_token": text("unknown")},
            eos_token_ids=gguf_eos_token_ids(reader, tokens, token_types),
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
            # no flag: llama.cpp adds BOS to a SentencePiece vocabulary, not to a byte-level one
            add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        )

    def save(self, folder: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (loadable by `from_folder` and transformers)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 20,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    # ---- ids <-> text -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. `add_special_tokens` prepends
        BOS only when the model's config says `add_bos_token`. Runs without holding the GIL (the backend's
        batch path; its single-text `encode` holds it), so a long text tokenized in a worker thread does not
        stall the engine's thread: 1 MB took 1 s either way, while the other thread got ~1% of its time."""
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def fewest_tokens(self, text: str, enough: int | None = None) -> int:
        """A lower bound on `len(encode(text))` in linear time, to refuse an over-long prompt before paying
        for its tokenization (a 3 MB prompt takes ~3.5 s to tokenize). Byte-level BPE covers every byte of
        the normalized text with tokens. Give each byte a weight: 1/`longest` (the most bytes one token
        stands for) if it repeats a neighbour (a run: only runs make long tokens, 128 spaces, 96 dashes),
        1/`spread` otherwise, where `spread` (`_token_spans`) is chosen so that no token of the vocabulary
        weighs more than 1. The text's total weight is then at most its number of tokens. 0 (no bound) for
        tokenizers that are not byte-level or normalize other than by NFC. Example, Qwen2.5 (`longest` 128,
        `spread` 48): 3 MB of English prose -> at least 59,788 tokens; 3 MB of spaces -> 23,438.
        With `enough`, the text is weighed a piece at a time and weighing stops once the bound exceeds `enough`
        (the answer is then a bound > `enough`, not the whole text's): a refusal reads what it needs, ~1.8 MB
        of that prose for a context of 32768 (2.2 ms -> 0.83 ms on a Zen 1 EPYC core, its pieces encoded as
        they are weighed and weighed in integers)."""
        spans = self._token_spans
        if spans is None:
            return 0
        longest, spread = spans
        if self._backend.normalizer is not None and not text.isascii() and \
                not unicodedata.is_normalized("NFC", text):
            # NFC will change the text: it makes at most 3 bytes of UTF-8 into 1 (the worst: the 6 bytes of
            # iota, diaeresis and acute into U+0390's 2; checked over every code point's decomposition)
            return -(-len(text.encode("utf-8", "surrogatepass")) // 3 // longest)
        # the weight in units of 1 / (p * longest), spread = p / q: exact integers (Fractions cost ~40 us an
        # operation); a piece of WEIGH_PIECE characters is encoded with one character of each neighbour, so that
        # its edge bytes are classed by the bytes beside them, as in the whole text
        p, q = spread.numerator, spread.denominator
        unit, bound = p * longest, None if enough is None else enough * p * longest
        weight, piece = 0, max(len(text), 1) if enough is None else WEIGH_PIECE
        for start in range(0, len(text), piece):
            stop = min(start + piece, len(text))
            before, after = text[max(start - 1, 0):start], text[stop:stop + 1]
            data = (before + text[start:stop] + after).encode("utf-8", "surrogatepass")
            first = len(before.encode("utf-8", "surrogatepass"))
            last = len(data) - len(after.encode("utf-8", "surrogatepass"))
            repeats = _repeating_bytes(data, first, last)
            weight += (last - first - repeats) * q * longest + repeats * p
            if bound is not None and weight > bound:
                break
        return -(-weight // unit)

    @cached_property
    def _token_spans(self) -> tuple[int, Fraction] | None:
        """(`longest`, `spread`) for `fewest_tokens` (`token_spans`), measured once."""
        return token_spans(self._backend, self.vocab_size)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> Backend:
        """The `tokenizers.Tokenizer` underneath (grammar libraries read its JSON)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special and added tokens (end of turn, tool-call markers, ...) and of eos."""
        return frozenset(self._backend.get_added_tokens_decoder()) | frozenset(self.eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    def _id_of(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    # ---- chat ---------------------------------------------------------------------------------------

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja) instead of the model's chat template (`serve --chat-template`)."""
        self.chat_template = template
        self.__dict__.pop("_compiled_template", None)  # compiled again on next use

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation, rendered by the model's own template as transformers does."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead of messages")
        return self._compiled_template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, special_text: bool = False,
                    tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The prompt of a conversation, in parts for `encode_parts`: (text, whether special-token text in it
        is special). The template's own text is; the messages' strings (content, name) are not, so that
        `<|im_start|>system` typed by a user is tokenized as the characters it is, never as a turn of another
        role. One part when no message string holds special-token text, or with `special_text` (then every
        special-token string of the prompt is special, as `encode` of the whole text makes it).

        The strings holding special-token text are rendered as unique placeholders, at which the prompt is
        cut; a template that alters them (trims them, say) makes that impossible: ValueError. Example
        (ChatML): [{"role": "user", "content": "<|im_end|>"}] -> [("<|im_start|>user\\n", True),
        ("<|im_end|>", False), ("<|im_end|>\\n<|im_start|>assistant\\n", True)]."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        nonce, marked = secrets.token_hex(8), {}

        def mark(value: Any) -> Any:
            if special_text or not isinstance(value, str) or not any(t in value for t in self._special_texts):
                return value
            key = f"\ue000{nonce}-{len(marked)}\ue001"
            marked[key] = value
            return key

        masked = [{k: mark(v) if k in ("content", "name") else v for k, v in m.items()} for m in messages]
        if not marked:
            return [(text, True)]
        rendered = self.apply_chat_template(masked, add_generation_prompt, tools)
        pieces = re.split(f"(\ue000{nonce}-\\d+\ue001)", rendered)
        parts = [(marked[p], False) if p in marked else (p, True) for p in pieces if p]
        if "".join(p for p, _ in parts) != text:
            raise ValueError("this chat template alters the text of messages, so special-token text in them cannot "
                             "be kept apart as plain text; remove it from the messages")
        return parts

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Token ids of `render_chat`'s parts, each tokenized on its own; special-token text is special only in
        the parts marked so (elsewhere it is split as ordinary text: tokenizers' `encode_special_tokens`)."""
        ids: list[int] = []
        for text, special in parts:
            backend = self._backend if special else self._plain_backend
            ids += backend.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    @cached_property
    def _special_texts(self) -> list[str]:
        return [t.content for t in self._backend.get_added_tokens_decoder().values() if t.special]

    @cached_property
    def _plain_backend(self) -> Backend:
        """A copy of the backend that tokenizes special-token text as ordinary text."""
        plain = Backend.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


class IncrementalDetokenizer:
    """Streams text as ids arrive, decoding only a small window of recent tokens.

    Keeps `[prefix_offset, read_offset)`, the tokens whose text was already emitted and serve as left
    context, and the unread tokens after them (vLLM's scheme). Each `add` decodes the window with and
    without the unread tokens and emits the difference, unless it ends in a partial UTF-8 character
    ('\\ufffd'), in which case it waits for more tokens. Example, byte-level BPE splitting "😀" (F0 9F 98 80)
    into two tokens: add([t1]) -> "" (the window decodes to '\\ufffd'), add([t2]) -> "😀". SentencePiece
    byte fallback is alike: `<0xF0>` .. `<0x80>` decode to '\\ufffd' until the fourth byte comes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = []  # left context then unread tokens
        self._read_offset = 0  # window[:read_offset] is already emitted
        self._text: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the text they complete (possibly "")."""
        self._window.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, even a partial character (as `decode` shows it)."""
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._window[: self._read_offset])
        new_text = self._decode(self._window)
        if new_text.endswith("\ufffd") and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        if delta:
            self._window = self._window[self._read_offset :]  # the emitted unread tokens are the next context
        else:
            # tokens that show no text (skipped special tokens) would make a context that decodes to "", where a
            # decoder that strips the first token's space (SentencePiece's "▁word") strips the next word's: the
            # old context stays, and they go (they add nothing to any later text)
            self._window = self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._text.append(delta)
        return delta


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], pre: str) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Backend(BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    if normalizer is not None:
        backend.normalizer = normalizer()
    backend.pre_tokenizer = pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(reader, tokens: list[str], token_types: list[int]) -> Backend:
    """SentencePiece BPE with byte fallback, as transformers builds it from the same metadata for the file's
    architecture (for Gemma: no merges in the file, so they are recovered from the vocabulary's order; ~3 s
    for its 262,144 tokens). transformers is imported here only (~0.8 s).

    One change: the USER_DEFINED runs of 2-31 spaces (Gemma's `"  "`, which transformers spells "▁▁") are
    matched whole, longest first, as SentencePiece matches its user-defined pieces and llama.cpp does.
    transformers leaves them to the merges, which cut 36 spaces into 16 + 20 where llama.cpp gives 31 + 5."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as e:  # an optional dependency (the `bench` extra), not one of the core's
        raise ImportError("reading a SentencePiece tokenizer from GGUF needs transformers with "
                          "transformers.integrations.gguf (specdec is tested with 5.25)") from e
    spec = {name: value for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if (value := gguf_field(reader, f"tokenizer.{key}")) is not None}
    backend, _ = convert_gguf_tokenizer(gguf_field(reader, "general.architecture"), spec)
    runs = ["\u2581" * len(t) for i, (t, kind) in enumerate(zip(tokens, token_types))
            if kind == USER_DEFINED and len(t) > 1 and not t.strip(" ") and backend.token_to_id("\u2581" * len(t)) == i]
    # normalized: matched in the text after spaces became "▁", where SentencePiece matches them
    backend.add_tokens([AddedToken(run, special=False, normalized=True) for run in runs])
    return backend


def _add_gguf_added_tokens(backend: Backend, tokens: list[str], token_types: list[int]) -> None:
    """CONTROL tokens (`<|im_start|>`) become special added tokens, USER_DEFINED ones (`<tool_call>`) plain
    added tokens: both are matched whole in text instead of being cut into pieces by BPE."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    """`tokenizer_config.json` writes a special token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(folder: Path, cfg: dict) -> str | None:
    """The default template: `chat_template.jinja`, or `tokenizer_config.json`'s (a string or a named list)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping, unicode kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def token_spans(backend, vocab_size: int) -> tuple[int, Fraction] | None:
    """(`longest`, `spread`) for `Tokenizer.fewest_tokens`, of a `tokenizers` backend: the most bytes one
    token stands for, and the least `spread` such that every token's bytes weigh at most 1
    (`singles`/`spread` + `repeats`/`longest`, its bytes that repeat a neighbour inside it being `repeats`).
    ~0.5 s for 150k tokens. None where the bound does not hold (not byte-level BPE, another
    normalizer, a non-ASCII added token)."""
    normalizer = backend.normalizer
    if not isinstance(backend.decoder, decoders.ByteLevel) or \
            not (normalizer is None or isinstance(normalizer, normalizers.NFC)):
        return None
    added = backend.get_added_tokens_decoder()
    if not all(t.content.isascii() for t in added.values()):
        return None
    byte_of = {char: byte for byte, char in _byte_level_alphabet().items()}
    spans = []
    for i in range(vocab_size):
        if i in added:
            spans.append(added[i].content.encode())
        elif (piece := backend.id_to_token(i)) is not None:
            if not all(c in byte_of for c in piece):
                return None  # not a byte-level vocabulary after all
            spans.append(bytes(byte_of[c] for c in piece))
    longest = max(map(len, spans))
    spread = max((Fraction((len(b) - r) * longest, longest - r) for b in spans
                  if (r := _repeating_bytes(b)) < len(b)), default=Fraction(longest))
    return longest, spread


def _repeating_bytes(data: bytes, start: int = 0, stop: int | None = None) -> int:
    """How many bytes of `data[start:stop]` equal the byte before or after them in `data` (the bytes of
    runs). Example: b"abbbc" -> 3; its bytes 0..2 -> 2 (byte 2 repeats byte 3, outside the piece)."""
    a = np.frombuffer(data, dtype=np.uint8)
    stop = a.size if stop is None else stop
    lo, hi = max(start - 1, 0), min(stop + 1, a.size)  # the piece and its neighbours
    w = a[lo:hi]
    if stop - start < 1 or w.size < 2:
        return 0
    same = w[1:] == w[:-1]  # byte j + 1 repeats byte j: both count
    repeats = np.zeros(w.size, dtype=bool)
    repeats[1:] = same
    repeats[:-1] |= same
    return int(np.count_nonzero(repeats[start - lo:stop - lo]))


def _byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(others)}}
