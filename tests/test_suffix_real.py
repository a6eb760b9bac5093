"""Suffix decoding on the default target: greedy output bit-identical to plain decoding, chains and trees, on
an edit request (whose answer repeats the function: drafts are accepted, and rejected where it changes)."""

from __future__ import annotations

import colorsys
import inspect

import pytest

from specdec.bench.compare import decode
from specdec.config import SamplingParams
from specdec.engine import Engine
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
    expected = decode(Engine(llm.target, tok, None, 0, max_model_len=1024), edit, PARAMS).token_ids
    for tree in (False, True):
        proposer = SuffixProposer(SuffixCache(24, 0), tree=tree)
        out = decode(Engine(llm.target, tok, proposer, 16, max_model_len=1024), edit, PARAMS)
        assert out.token_ids == expected, f"tree={tree}"
        m = out.metrics
        assert m.num_accepted_tokens >= 16 and m.target_passes < 30 and m.num_accepted_tokens < m.num_draft_tokens
