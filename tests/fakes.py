"""Test doubles for the engine: a one-character-per-token tokenizer and a scripted proposer.

`FakeTokenizer` gives every token id one letter (id i -> chr(ord('a') + i % 26)), so the text of a token
sequence is known exactly and a stop string can be placed at a chosen token. The EOS id (and the other
special ids) decode to "" when `skip_special_tokens` is set, as a real tokenizer's special tokens do. It
has what `Engine`, `IncrementalDetokenizer` and `check_draft_compatible` read: `encode`, `decode`,
`eos_token_ids`, `bos_token_id`, `pad_token_id`, `get_vocab`.

`ScriptedProposer` proposes whatever a function of the sequence says (truncated to the K the engine
asks for), with no probabilities (point masses), and records what it was asked. `varied_model`
and `noisy_copy` make targets and drafts of known quality from `conftest.tiny_model`.
"""

from __future__ import annotations

import copy
import itertools
from typing import Callable, Sequence as Seq

import torch

from conftest import tiny_model
from specdec.speculative.proposers import Draft, Proposer


def letter(token_id: int) -> str:
    return chr(ord("a") + token_id % 26)


class FakeTokenizer:
    def __init__(
        self,
        vocab_size: int = 97,
        eos_token_ids: tuple[int, ...] = (96,),
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        names: dict[int, str] | None = None,  # override the vocabulary name of some ids
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self._names = {i: f"<{i}:{letter(i)}>" for i in range(vocab_size)}
        self._names.update(names or {})

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i in (*self.eos_token_ids, self.bos_token_id, self.pad_token_id) if i is not None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) - ord("a") for c in text]
        if any(not 0 <= i < 26 for i in ids):
            raise ValueError(f"FakeTokenizer encodes only a-z, got {text!r}")
        return ids

    def decode(self, ids: Seq[int], skip_special_tokens: bool = False) -> str:
        special = self.special_ids if skip_special_tokens else frozenset()
        return "".join(letter(i) for i in ids if i not in special)

    def get_vocab(self) -> dict[str, int]:
        return {name: i for i, name in self._names.items()}


class ScriptedProposer(Proposer):
    """Proposes `script(seq)[:k]` for each sequence; `calls` records (request_id, k, draft) per proposal."""

    def __init__(self, script: Callable[[object], list[int]]) -> None:
        self.script = script
        self.calls: list[tuple[str, int, list[int]]] = []

    def draft(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens = list(self.script(seq))[:k] if k > 0 else []
            self.calls.append((seq.request_id, k, tokens))
            drafts.append(Draft(tokens))
        return drafts


# ------------------------------------------------------------------------------------------- models
def varied_model(seed: int = 0, dtype: torch.dtype = torch.float32, arch: str = "qwen2", scale: float = 3.0):
    """`conftest.tiny_model` with its weight matrices scaled up by `scale`.

    At the stock scale a tiny random model's greedy text is one token repeated (e.g. 3 3 3 ...), which
    would make "speculative output == plain output" nearly vacuous; scaled by 3 its greedy text varies
    (20-30 distinct ids in 48 tokens) while still repeating now and then, so n-gram drafts get hits.
    """
    model = tiny_model(arch, seed, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model.to(dtype).eval()


def noisy_copy(model, std: float, seed: int = 1234):
    """A copy of `model` with Gaussian noise (relative std `std`) on every weight matrix: a draft that
    agrees with the target often but not always."""
    g = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model).float()
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * std * p.std())
    return out.to(model.dtype).eval()


def step_clock() -> Callable[[], float]:
    """A clock for `Engine(clock=...)` that ticks once per reading, not in seconds: what the engine measures (the
    riding prompt chunks' budget, the controller's costs) and so its schedule do not follow the machine's load."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def one_intra_op_thread():
    """Run a block with one intra-op thread, restoring the setting after (a generator for a fixture).

    Tiny models gain nothing from intra-op threads, and on a shared, loaded machine each parallel region
    waits for a time slice: a 20x64 @ 64x128 matmul took ~20 ms with 2 threads under load and ~50 us with 1.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
