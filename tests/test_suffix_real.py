"""Suffix decoding on the default target: greedy output bit-identical to plain decoding, chains and trees, on
an edit request (whose answer repeats the function: drafts are accepted, and rejected where it changes)."""

from __future__ import annotations

import colorsys
import inspect

import pytest

from specdec.bench.compare import decode
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.speculative.costs import CostModel
from specdec.speculative.proposers import SuffixProposer
from specdec.speculative.suffix import SuffixCache

pytestmark = pytest.mark.real
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    from specdec import LLM

    return LLM("qwen2.5-coder-1.5b-instruct", max_model_len=1024)


def test_suffix_greedy_is_bit_exact(llm):
    tok = llm.tokenizer
    code = inspect.getsource(colorsys.hls_to_rgb)
    edit = tok.encode_parts(tok.render_chat([{"role": "user", "content": f"```python\n{code}```\nRename the "
                                              "parameter `l` to `lightness`. Reply with the whole function."}]))
    expected = decode(Engine(llm.target, tok, None, num_speculative_tokens=0,
                             max_model_len=1024), edit, PARAMS).token_ids
    for tree in (False, True):
        proposer = SuffixProposer(SuffixCache(24, 0), tree=tree)
        out = decode(Engine(llm.target, tok, proposer, num_speculative_tokens=16, max_model_len=1024), edit, PARAMS)
        assert out.token_ids == expected, f"tree={tree}"
        m = out.metrics
        assert m.num_accepted_tokens >= 16 and m.target_passes < 30 and m.num_accepted_tokens < m.num_draft_tokens


class RowCosts(CostModel):
    """A target pass of w rows costs 1 + 0.1 (w - 1), as measured on this project's CPUs; nothing is measured."""

    def __init__(self) -> None:
        super().__init__()
        self.verify = {1: 1.0, 64: 7.3}

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        pass

    def record_verify(self, rows: int, seconds: float) -> None:
        pass


def test_the_default_auto_speculation_is_bit_exact_and_uses_both_drafters(llm):
    """`LLM(target)` with no speculation arguments: auto speculation, the trie beside the Medusa heads shipped
    for the default target. An edit (the answer repeats the function: the trie's ground) and new code (the
    heads' ground): both bit-identical to plain decoding, and each drafter's drafts accepted somewhere."""
    tok = llm.tokenizer
    info = llm.describe()["speculative"]
    assert (info["method"], info["drafters"]) == ("auto", ["suffix", "medusa"])
    code = inspect.getsource(colorsys.hls_to_rgb)
    prompts = [
        [{"role": "user", "content": f"```python\n{code}```\nRename the parameter `l` to `lightness`. "
                                     "Reply with the whole function."}],
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    ]
    accepted: dict[str, int] = {}
    plain = Engine(llm.target, tok, None, num_speculative_tokens=0, max_model_len=1024)
    llm.engine.controller.costs = RowCosts()  # which drafter wins must not depend on this machine's load
    for messages in prompts:
        ids = tok.encode_parts(tok.render_chat(messages))
        out = llm.generate([ids], PARAMS)[0]
        assert out.token_ids == decode(plain, ids, PARAMS).token_ids
        for name, (_, _, n) in out.metrics.drafters.items():
            accepted[name] = accepted.get(name, 0) + n
    assert accepted.get("suffix", 0) >= 16 and accepted.get("medusa", 0) >= 4, accepted
