"""The shipped heads on the real target draft exactly what they drafted before their passes were batched.

`tests/data/head_drafts.json` holds every draft (tokens and tree parents) that the shipped EAGLE and Medusa
heads proposed, step by step, on two HumanEval prompts: chains and trees, greedy and sampled, one sequence
and two at once. It is recorded from the head proposers and modules of commit 28814d9 (one head pass a
sequence and depth, rerunning every node so far; one output-layer call a sequence and depth) drafting on this
checkout's target, whose arithmetic decides the hidden states the heads read:

    python tests/test_heads_real.py tests/data/head_drafts.json 28814d9

(loaded as bench_head_share.py loads them). With `SPECDEC_FP32_RESIDUAL=0` (the bf16 residual stream, the
target's arithmetic when the file was first recorded from 28814d9's whole tree) it writes that first file byte
for byte; the file now holds the drafts on the default fp32 residual stream.

The block kernels give a row the same bits whatever is computed beside it, so the batched passes must
reproduce those drafts token for token: a draft that differs means a pass that computes something else.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

TARGET = "qwen2.5-coder-1.5b-instruct"
MAX_LEN = 512
RECORDED = Path(__file__).parent / "data" / "head_drafts.json"
# name: (method, k, tree, temperature, batch)
CONFIGS = {
    "eagle chain k=2": ("eagle", 2, None, 0.0, 1),
    "eagle chain k=4": ("eagle", 4, None, 0.0, 1),
    "eagle default tree k=3": ("eagle", 3, "default", 0.0, 1),
    "eagle dynamic tree k=4": ("eagle", 4, "dynamic", 0.0, 1),
    "eagle chain k=3 sampled": ("eagle", 3, None, 0.8, 1),
    "eagle default tree k=3 sampled": ("eagle", 3, "default", 0.8, 1),
    "eagle chain k=3, 2 sequences": ("eagle", 3, None, 0.0, 2),
    "eagle default tree k=3, 2 sequences": ("eagle", 3, "default", 0.0, 2),
    "eagle dynamic tree k=3, 2 sequences sampled": ("eagle", 3, "dynamic", 0.8, 2),
    "medusa chain k=3": ("medusa", 3, None, 0.0, 1),
    "medusa default tree k=3, 2 sequences": ("medusa", 3, "default", 0.0, 2),
}


def prompts(tokenizer) -> list[list[int]]:
    from specdec.data import DATA_DIR

    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        tasks = [json.loads(line) for line in f]
    return [tokenizer.encode(tasks[i]["prompt"])[:48] for i in (2, 10)]


def record(llm, name: str, code=None) -> dict:
    """Run one configuration on both prompts: each step's drafts ([tokens, parents] per sequence) and outputs.
    `code`: (heads module, proposers module) to draft with (another revision's: `__main__`), else this checkout's."""
    from specdec.config import SamplingParams
    from specdec.engine import Engine
    from specdec.speculative.tree import DynamicTree

    if code is None:
        import specdec.heads.files as files
        import specdec.speculative.head_proposers as proposers
    else:
        files, proposers = code
    method, k, tree, temperature, batch = CONFIGS[name]
    heads = files.load_heads(files.resolve_heads(f"{TARGET}-{method}"), llm.target, method)
    shape = {None: None, "default": proposers.default_tree(k), "dynamic": DynamicTree(top_k=2, beam=2)}[tree]
    vocab = llm.target.config.vocab_size
    proposer = (proposers.MedusaProposer(heads, vocab, shape, max_depth=k) if method == "medusa"
                else proposers.EagleProposer(heads, vocab, batch, MAX_LEN, shape, max_depth=k))
    engine = Engine(llm.target, llm.tokenizer, proposer, num_speculative_tokens=k, max_model_len=MAX_LEN,
                    max_batch_size=batch, adaptive=False)
    steps = []
    propose = proposer.propose

    def spy(seqs, ks):
        proposal = propose(seqs, ks)
        steps.append([[d.tokens, d.parents] for d in proposal.drafts])
        return proposal

    proposer.propose = spy
    ids = prompts(llm.tokenizer)
    groups = [ids] if batch == 2 else [[p] for p in ids]
    outputs = []
    for group in groups:
        for i, p in enumerate(group):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=20, seed=1 + i,
                                                         ignore_eos=True))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
        outputs += [finals[f"r{i}"] for i in range(len(group))]
    return {"drafts": steps, "outputs": outputs}


@pytest.fixture(scope="module")
def llm():
    """The target. The drafts were recorded under the portable attention recipe: where this machine's default
    build computes bf16 attention on AMX tiles (bits of their own: kernels/csrc/amx/attention.h), the
    module runs on the AVX-512 VNNI build instead (the same matrix products' bits, the portable attention's)."""
    from specdec import LLM
    from specdec.kernels import qgemm

    with pytest.MonkeyPatch.context() as mp:
        if qgemm.ops().attention_tiles(128):
            mp.setenv("SPECDEC_QGEMM_ISA", "avx512vnni")
        yield LLM(TARGET, num_speculative_tokens=0, max_model_len=MAX_LEN)


@pytest.mark.real
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_head_passes_draft_what_one_pass_a_sequence_drafted(llm, name):
    expected = json.loads(RECORDED.read_text())[name]
    got = json.loads(json.dumps(record(llm, name)))  # (tuples as lists, as recorded)
    assert got["outputs"] == expected["outputs"]
    assert len(got["drafts"]) == len(expected["drafts"])
    for step, (ours, theirs) in enumerate(zip(got["drafts"], expected["drafts"])):
        assert ours == theirs, f"{name}: step {step} drafted {ours}, recorded {theirs}"
    assert any(tokens for step in got["drafts"] for tokens, _ in step)


if __name__ == "__main__":  # record: python tests/test_heads_real.py OUT.json [REV: its head code, this target]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_head_share import baseline_modules

    from specdec import LLM

    torch.set_num_threads(1)
    model = LLM(TARGET, num_speculative_tokens=0, max_model_len=MAX_LEN)
    code = baseline_modules(sys.argv[2]) if len(sys.argv) > 2 else None
    with torch.inference_mode():
        Path(sys.argv[1]).write_text(json.dumps({name: record(model, name, code) for name in CONFIGS}) + "\n")
