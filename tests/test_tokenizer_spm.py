"""SentencePiece tokenizers from GGUF (`tokenizer.ggml.model` "llama"): offline on tiny vocabularies written
here (Gemma's shape and Llama 2's), and (marked `real`) on Gemma 3 270M's GGUF against transformers' tokenizer
of the same file. The real tests skip unless `specdec models pull gemma-3-270m` has been run.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter

from specdec.config import SamplingParams
from specdec.data import DATA_DIR
from specdec.engine.output_text import OutputText
from specdec.models.tokenizer import IncrementalDetokenizer, Tokenizer

pytest.importorskip("transformers")  # builds SentencePiece vocabularies from GGUF metadata

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # llama.cpp token types
BYTES = [f"<0x{b:02X}>" for b in range(256)]
GEMMA_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "\u2581w", "\u2581wo", "ld",
          "rld", "\u2581world", "\u2581\u2581", "\u2581\u2581\u2581"]


def spm_vocabulary(arch: str) -> list[tuple[str, int]]:
    """(token, type) of a tiny SentencePiece BPE vocabulary: Gemma's specials, newline and space runs as
    USER_DEFINED pieces (Gemma's GGUF spells them with real spaces), the 256 byte-fallback tokens, pieces."""
    if arch == "gemma3":
        specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL),
                    ("<mask>", CONTROL), ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED),
                    ("  ", USER_DEFINED), ("   ", USER_DEFINED)]
        pieces = [p for p in PIECES if p not in ("\u2581\u2581", "\u2581\u2581\u2581")]
    else:  # Llama 2's: <unk> <s> </s>, a prefix space on the first word
        specials = [("<unk>", 2), ("<s>", CONTROL), ("</s>", CONTROL), ("<start_of_turn>", CONTROL)]
        pieces = PIECES
    return specials + [(b, BYTE) for b in BYTES] + [(p, NORMAL) for p in pieces]


def write_spm_gguf(path: Path, arch: str = "gemma3") -> list[str]:
    """A GGUF holding only a tokenizer's metadata; returns its tokens."""
    vocab = spm_vocabulary(arch)
    tokens = [t for t, _ in vocab]
    writer = GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    # sentencepiece scores: the pieces' merge order (Gemma's files order them by id instead; both agree here)
    writer.add_token_scores([-1000.0 if k != NORMAL else -float(i) for i, (_, k) in enumerate(vocab)])
    writer.add_token_types([k for _, k in vocab])
    writer.add_bos_token_id(tokens.index("<bos>" if arch == "gemma3" else "<s>"))
    writer.add_eos_token_id(tokens.index("<eos>" if arch == "gemma3" else "</s>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    if arch == "gemma3":
        writer.add_pad_token_id(tokens.index("<pad>"))
        writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


@pytest.fixture(scope="module")
def gemma_tiny(tmp_path_factory) -> tuple[Tokenizer, list[str]]:
    path = tmp_path_factory.mktemp("spm") / "gemma.gguf"
    tokens = write_spm_gguf(path)
    return Tokenizer.from_gguf(GGUFReader(path)), tokens


def pieces(tok: Tokenizer, tokens: list[str], text: str) -> list[str]:
    return [tokens[i] for i in tok.encode(text)]


def test_tiny_gemma_ids_specials_and_bos(gemma_tiny):
    tok, tokens = gemma_tiny
    assert tok.vocab_size == len(tokens)
    assert pieces(tok, tokens, "hello world") == ["hello", "\u2581world"]  # no prefix space: Gemma adds none
    assert pieces(tok, tokens, " world\n") == ["\u2581world", "\n"]  # "\n" is USER_DEFINED: whole
    assert pieces(tok, tokens, "<start_of_turn>hello<end_of_turn>") == ["<start_of_turn>", "hello", "<end_of_turn>"]
    assert tok.add_bos_token and tok.bos_token_id == tokens.index("<bos>")
    assert tok.encode("hello", add_special_tokens=True) == [tok.bos_token_id, tokens.index("hello")]
    # eos, then llama.cpp's end-of-generation texts marked CONTROL
    assert tok.eos_token_ids == (tokens.index("<eos>"), tokens.index("<end_of_turn>"))
    assert tok.special_tokens == GEMMA_SPECIAL_TOKENS
    assert tok.chat_template is None and tok.fewest_tokens("hello world") == 0  # 0: no bound (not byte-level)


def test_tiny_gemma_space_runs_are_matched_longest_first(gemma_tiny):
    """The USER_DEFINED runs "  " and "   " (stored with real spaces): 5 spaces -> 3 + 2, as SentencePiece
    and llama.cpp match them, wherever they stand."""
    tok, tokens = gemma_tiny
    assert pieces(tok, tokens, "hello     world") == ["hello", "   ", "  ", "w", "o", "rld"]
    assert pieces(tok, tokens, "  ") == ["  "] and pieces(tok, tokens, " ") == ["\u2581"]
    assert tok.decode(tok.encode("hello     world")) == "hello     world"


def test_tiny_gemma_byte_fallback_and_decode(gemma_tiny):
    tok, tokens = gemma_tiny
    assert pieces(tok, tokens, "hey\U0001F600") == ["he", "<0x79>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    for text in ("hey\U0001F600", "\tworld é\n\n", "hello  <end_of_turn>\n  world"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    ids = tok.encode("<start_of_turn>hello\n<end_of_turn>")
    assert tok.decode(ids, skip_special_tokens=True) == "hello\n"  # CONTROL skipped, USER_DEFINED kept


def test_tiny_gemma_save_and_reload(gemma_tiny, tmp_path):
    tok, _ = gemma_tiny
    tok.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tok.eos_token_ids)}))
    again = Tokenizer.from_folder(tmp_path)
    text = "<start_of_turn>hello     world\U0001F600\n"
    assert again.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
    assert again.eos_token_ids == tok.eos_token_ids and again.add_bos_token


def test_tiny_gemma_streamed_text_is_the_full_decode(gemma_tiny):
    tok, tokens = gemma_tiny
    ids = tok.encode("<start_of_turn>hello\U0001F600 world<end_of_turn>hey   \U0001F600\n")
    for skip in (False, True):
        for step in (1, 2, 3):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            chunks = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
            assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
            assert all("\ufffd" not in c for c in chunks)  # a character split in byte tokens waits for all of them


def test_tiny_llama_prefix_space_survives_skipped_special_tokens(tmp_path):
    """Llama 2's decoder strips the first token's space ("▁world" -> "world"): a skipped special token
    between two words must not make the second word the first of a window."""
    tokens = write_spm_gguf(tmp_path / "llama.gguf", arch="llama")
    tok = Tokenizer.from_gguf(GGUFReader(tmp_path / "llama.gguf"))
    assert tok.add_bos_token  # no flag in the file: llama.cpp's default for SentencePiece
    assert pieces(tok, tokens, "hello world") == ["\u2581", "hello", "\u2581world"]  # the prefix space
    ids = [tokens.index(t) for t in ("\u2581world", "<s>", "</s>", "\u2581world", "<start_of_turn>", "\u2581world")]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True) == "world world world"


def test_tiny_gemma_matches_transformers(gemma_tiny, tmp_path):
    from transformers import AutoTokenizer

    tok, _ = gemma_tiny
    write_spm_gguf(tmp_path / "gemma.gguf")
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma.gguf")
    for text in ("hello world", " hello\n\nworld", "hey\U0001F600 é", "<start_of_turn>hello<end_of_turn>"):
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text, add_special_tokens=False))


# ---- Gemma 3 270M ---------------------------------------------------------------------------------------------

GEMMA = "gemma-3-270m"
LONGEST_SPACE_RUN = 31  # Gemma's USER_DEFINED runs: 2..31 spaces (ids 138..167), 1..31 newlines and tabs
EDGE_CASES = [
    " leading space", "  two leading", "trailing  ", "a  b   c    d", "\ttab\t\tx\t", "\n\nnew\n\n\nlines\r\n",
    "\U0001F600\U0001F389 emoji, \U0001F468\u200d\U0001F469\u200d\U0001F467 family",
    "é à ü ñ 中文 日本語 한국어 ελληνικά", "\U0001D518\U0001D52B\U0001D526 byte fallback \x00\x01\x7f \u200b",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad>", "<table><tr><td>1</td></tr></table> <b>bold</b>", " ", "   ", "x" * 300, "a\u00a0b　c",
    "e\u0301 combining", "def f():\n" + " " * 40 + "return 1  # deep\n" + "\t" * 35 + "tabs\n" + "\n" * 40 + "end",
]


def gemma_prompts() -> list[str]:
    """Spec-Bench's first turn of 3 questions of each of its 13 categories, HumanEval's first 12 prompts with
    their solutions, and the edge cases."""
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench" / "question.jsonl").read_text().splitlines()]
    per_category: dict[str, list[str]] = {}
    for row in rows:
        per_category.setdefault(row["category"], []).append(row["turns"][0])
    texts = [t for turns in per_category.values() for t in turns[:3]]
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        problems = [json.loads(line) for line in f][:12]
    return texts + [p["prompt"] + p["canonical_solution"] for p in problems] + EDGE_CASES


@pytest.fixture(scope="module")
def gemma():
    """(our tokenizer, transformers' tokenizer) of the pulled Gemma 3 270M GGUF."""
    from specdec.models import store

    if not store.is_pulled(GEMMA):
        pytest.skip(f"{GEMMA} is not pulled (specdec models pull {GEMMA})")
    from transformers import AutoTokenizer

    from specdec.models.gguf_file import GGUFFile

    path = store.gguf_path(store.known_model(GEMMA))
    # our reader, as the loader uses (gguf's GGUFReader takes ~20 s over the 262,144 tokens' strings)
    return Tokenizer.from_gguf(GGUFFile(path)), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.real
def test_real_gemma_special_tokens(gemma):
    tok, _ = gemma
    assert tok.vocab_size == 262_144 and tok.add_bos_token and tok.bos_token_id == 2
    assert tok.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>; llama.cpp also stops on 212 `</s>` (an HTML tag)
    assert tok.special_tokens == GEMMA_SPECIAL_TOKENS
    assert tok.chat_template is None  # the base model's file has none
    assert tok.encode("<start_of_turn>user\n") == [105, 2364, 107]
    assert tok.fewest_tokens("hello " * 1000) == 0  # no bound: not byte-level


@pytest.mark.real
def test_real_gemma_ids_match_transformers(gemma):
    """On 69 texts, every id as transformers' tokenizer of the same file gives it, BOS included; texts with a
    run of more than 31 spaces differ by design (see `_sentencepiece_bpe`) and are checked below."""
    tok, hf = gemma
    texts = gemma_prompts()
    long_runs = [t for t in texts if " " * (LONGEST_SPACE_RUN + 1) in t]
    assert len(texts) == 39 + 12 + len(EDGE_CASES) and len(long_runs) == 1
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        if text not in long_runs:
            assert ids == hf.encode(text), text
        assert ids[0] == 2 and tok.decode(ids[1:]) == hf.decode(ids[1:]) == text  # no unknown character: byte fallback
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.real
def test_real_gemma_space_runs_as_llama_cpp_splits_them(gemma):
    """A run of 36 spaces: 31 + 5 (ids 167, 141), as llama.cpp's llama-server tokenizes it; transformers'
    tokenizer gives 16 + 20 (152, 156). (Checked by hand against llama-server on 1,015 texts: all of Spec-Bench
    and HumanEval, these edge cases, runs of 1-99 spaces: every id equal, BOS included.)"""
    tok, hf = gemma
    assert tok.encode(" " * 36) == [167, 141] and hf.encode(" " * 36, add_special_tokens=False) == [152, 156]
    assert tok.encode("x" + " " * 62 + "y") == [236781, 167, 167, 236762]
    assert tok.encode("\n" * 36) == hf.encode("\n" * 36, add_special_tokens=False) == [137, 111]  # 31 + 5, both


@pytest.mark.real
def test_real_gemma_streamed_text_is_the_full_decode(gemma):
    """Each text's ids, with turn markers between texts, streamed one id at a time and three at a time, and
    through `OutputText` (the engine's), give the full decode's text."""
    tok, _ = gemma
    ids = []
    for text in gemma_prompts():
        ids += [105, *tok.encode(text), 106]
    for skip in (False, True):
        for step in (1, 3):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            chunks = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
            assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
            assert all("\ufffd" not in c for c in chunks)
    output = OutputText(tok, SamplingParams(max_tokens=len(ids)), eos_ids=frozenset())
    for i in ids:
        output.append([i])
    assert output.text == tok.decode(ids, skip_special_tokens=True) and output.finish_reason == "length"
