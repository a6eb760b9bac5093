"""The step plan's pages (`StepPlan.pages`, `take_pages`): every row of a decoding pass takes its K/V pages from
the plan before the pass, never more than the plan gave it, and the pass itself takes none; a proposer drafting
wider than its K breaks the plan loudly (`PlanBroken`)."""

from __future__ import annotations

import pytest

import specdec.engine.engine as engine_module
from engine_fingerprint import dynamic_tree_engine
from fakes import FakeTokenizer, one_intra_op_thread
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.engine.plan import PlanBroken, StepPlan
from specdec.speculative.proposers import Draft, Proposer
from test_engine_tiny import MAX_LEN, run, target
from test_preemption import PROMPTS as POOL_PROMPTS, engine_for
from test_prefix_cache import make_engine

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [tuple((5 * i + 11 * j + 2) % 90 for i in range(10 + 7 * j)) for j in range(3)]


def engine_of(kind: str) -> Engine:
    if kind == "eagle dynamic tree":  # (no draft at K = 0, its last step's: max_width(0) is 0)
        return dynamic_tree_engine(batch=3)
    if kind.startswith("pool, "):  # rows that outgrow a small pool, prompts riding in the running rows' passes
        return engine_for(kind.removeprefix("pool, "))
    return make_engine(kind, chunk=8, batch=3)


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft model", "eagle tree", "eagle dynamic tree", "pool, ngram",
                                  "pool, suffix"])
def test_the_pass_takes_its_pages_from_the_plan(kind, monkeypatch):
    engine = engine_of(kind)
    cache = engine.cache
    taken, rows_seen = [], []
    take = StepPlan.take_pages

    def take_pages(plan, c, drafts):  # each row's pages taken against the plan's
        rows = [*plan.decoding, *([plan.riding.seq] if plan.riding else [])]
        most = [*plan.pages, *([plan.riding.pages] if plan.riding else [])]
        before = [len(c.pages[s.row]) for s in rows]
        take(plan, c, drafts)
        got = [len(c.pages[s.row]) - n for s, n in zip(rows, before)]
        assert all(g <= m for g, m in zip(got, most)), (got, most)
        taken.extend(got)

    real_verify = engine_module.verify

    def verify(target_model, c, seqs, drafts, *args):  # the pass finds every page it writes in place
        held, free = [list(p) for p in c.pages], len(c.free)
        out = real_verify(target_model, c, seqs, drafts, *args)
        assert [list(p) for p in c.pages] == held and len(c.free) == free
        rows_seen.append(len(seqs))
        return out

    monkeypatch.setattr(StepPlan, "take_pages", take_pages)
    monkeypatch.setattr(engine_module, "verify", verify)
    prompts = POOL_PROMPTS if kind.startswith("pool") else PROMPTS
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) if kind.startswith("pool") else GREEDY
    finals = run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)], join_at=[0, 1, 3, 5][:len(prompts)])
    assert all(out.error is None for out in finals.values())
    assert rows_seen and sum(taken) > 0 and cache is engine.cache


class TooWide(Proposer):
    """Drafts 6 tokens whatever K it is asked for."""

    def draft(self, seqs, ks):
        return [Draft([1, 2, 3, 4, 5, 6]) for _ in seqs]


def test_a_proposer_drafting_wider_than_its_k_breaks_the_plan():
    engine = Engine(target("fp32"), FakeTokenizer(), TooWide(), num_speculative_tokens=2, max_model_len=MAX_LEN)
    engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(PlanBroken, match="the plan allows 3"):
        for _ in range(3):
            engine.step()
