"""The engine's parts through their public interfaces: the scheduler's row packing, `OutputText`'s stop rules
and held-back text, the speculation controller's one question and one report, and `build_proposer`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fakes import FakeTokenizer, letter, step_clock
from specdec.config import ModelConfig, SamplingParams, SpeculativeConfig
from specdec.engine.output_text import OutputText
from specdec.engine.scheduler import Scheduler
from specdec.models.kv_cache import KEY_BLOCK, KVCache
from specdec.speculative.auto_model import AutoModelProposer
from specdec.speculative.build import build_proposer, tree_of
from specdec.speculative.costs import AcceptanceEstimate
from specdec.speculative.controller import Outcome, SpeculationController, StepReport
from specdec.speculative.proposers import Draft, NgramProposer, NullProposer, Proposer, SuffixProposer
from specdec.speculative.tree import DynamicTree, TreeShape, ancestor_mask, depths


# ------------------------------------------------------------------------------------------- scheduler
@dataclass(eq=False)
class Seq:
    request_id: str
    row: int = -1


def cache(rows: int = 4) -> KVCache:
    config = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=8, hidden_size=4, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                         max_position_embeddings=64, rms_norm_eps=1e-6)
    return KVCache(config, rows, 8, torch.float32)


def fill(c: KVCache, row: int, value: float, n: int) -> None:
    c.clear(row)
    c.reserve(row, n)
    c.keys[0][c.pages[row]] = value  # (one page of 16 slots holds the row)
    c.advance(row, n)


def first_key(c: KVCache, row: int) -> float:
    return float(c.gather(c.keys[0], row + 1, 1)[row, 0, 0, 0])


def test_the_scheduler_keeps_rows_packed_in_every_cache():
    """The module docstring's example: a, b, c running in rows 0..2, d joining in row 3; b leaves -> c moves to
    row 1 and d to row 2, in both caches, contents and lengths; the rows they leave are freed."""
    target, draft = cache(), cache()
    scheduler = Scheduler(4, [target, draft])
    a, b, c, d = (Seq(r) for r in "abcd")
    for s in (a, b, c, d):
        scheduler.add(s)
    for i, s in enumerate((a, b, c)):
        assert scheduler.joining() is s and s.row == i
        for kv in (target, draft):
            fill(kv, i, float(i + 1), i + 1)
        scheduler.join(s)
    assert scheduler.joining() is d and d.row == 3 and scheduler.num_queued() == 0
    fill(target, 3, 9.0, 2)
    scheduler.remove(b)
    assert scheduler.running == [a, c] and (c.row, d.row) == (1, 2) and scheduler.prefilling is d
    assert target.lengths == [1, 3, 2, 0] and draft.lengths == [1, 3, 0, 0]
    assert first_key(target, 1) == 3.0 and first_key(target, 2) == 9.0
    assert sum(map(len, target.pages)) + len(target.free) == target.num_pages  # b's page back in the pool
    scheduler.remove(c)  # the last running one leaves: nothing moves but the joining one
    assert scheduler.running == [a] and d.row == 1 and target.lengths == [1, 2, 0, 0]
    scheduler.remove(d)
    assert scheduler.prefilling is None and target.lengths == [1, 0, 0, 0] and scheduler.has_unfinished()
    scheduler.remove(a)
    assert not scheduler.has_unfinished() and len(target.free) == target.num_pages


def test_the_scheduler_starts_one_joining_sequence_while_the_batch_has_room():
    scheduler = Scheduler(2, [cache(3)])
    seqs = [Seq(str(i)) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    assert scheduler.num_queued() == 2  # two rows free: two of the four can start
    first = scheduler.joining()
    assert scheduler.joining() is first  # the same one until it joins
    scheduler.join(first)
    second = scheduler.joining()
    scheduler.join(second)
    assert scheduler.joining() is None and scheduler.num_queued() == 2  # the batch is full
    scheduler.remove(seqs[3])  # a waiting one can be taken out (an abort)
    assert list(scheduler.waiting) == [seqs[2]]


# ------------------------------------------------------------------------------------------- output text
def output(**kw) -> OutputText:
    return OutputText(FakeTokenizer(), SamplingParams(temperature=0, **{"max_tokens": 50, **kw}), frozenset({96}))


def text_of(ids) -> str:
    return "".join(letter(i) for i in ids)


def test_output_text_stops_exactly_where_plain_decoding_would():
    out = output()
    assert out.append([0, 1, 96, 2]) == [0, 1, 96] and out.text == "ab" and (out.finish_reason, out.stop_reason) == \
        ("stop", 96)
    out = output(ignore_eos=True, max_tokens=3)
    assert out.append([0, 96, 1, 2]) == [0, 96, 1] and out.finish_reason == "length" and out.stop_reason is None
    out = output(stop_token_ids=(2,))
    assert out.append([0, 2, 3]) == [0, 2] and out.text == text_of([0, 2]) and out.stop_reason == 2  # kept
    out = output(stop=("cd",))
    assert out.append([0, 1, 2]) == [0, 1, 2] and not out.finished
    assert out.append([3, 4]) == [3] and out.text == "ab" and out.stop_reason == "cd"


def test_output_text_holds_back_a_tail_that_may_begin_a_stop_string():
    """The module docstring's example, on letters: stop "cc"; "abc" streams "ab"; the next "c" completes the
    stop string and nothing more is sent; the whole text is "ab"."""
    out = output(stop=("cc",))
    out.append([0, 1, 2])
    assert out.new_text() == "ab"
    out.append([2])
    assert out.finished and out.text == "ab" and out.new_text() == ""
    out = output(stop=("cc",))
    out.append([0, 2, 1])
    assert out.new_text() == "ac"  # "b" cannot begin "cc": only a one-character tail is held, and only "b"
    out.append([3, 96])
    assert out.new_text() == "bd"  # finished: everything left


def test_output_text_abort():
    out = output()
    out.append([0])
    out.abort()
    assert out.finished and out.finish_reason == "abort" and out.new_text() == "a"


# ------------------------------------------------------------------------------------------- controller
def test_the_controller_answers_one_question_per_step_within_each_sequences_limits():
    controller = SpeculationController(5)
    estimates = [controller.new_estimate() for _ in range(3)]
    assert controller.choose(estimates, remaining=[40, 3, 40], room=[100, 100, 2]) == [5, 2, 1]
    off = SpeculationController(5, disable_by_batch_size=2)
    assert off.choose(estimates, [40] * 3, [100] * 3) == [0, 0, 0]  # more than 2 running: off
    assert off.choose(estimates[:2], [40] * 2, [100] * 2) == [5, 5]
    assert not off.draft_reads_prompt([], 3, 100, 40) and off.draft_reads_prompt([], 2, 100, 40)


def test_the_controller_learns_costs_and_acceptance_from_step_reports():
    controller = SpeculationController(4, adaptive=True)
    estimate = controller.new_estimate()
    assert controller.choose([estimate], [100], [1000]) == [1]  # nothing measured: a probe
    controller.report(StepReport(batch_size=1, k=1, forward_seconds=0.5, rows=2, verify_seconds=1.05,
                                 outcomes=[Outcome(estimate, 1, 1)]))
    assert controller.costs.draft_time(1) is None  # the drafter's first forward at this size: a warm-up
    controller.report(StepReport(batch_size=1, k=1, forward_seconds=0.01, rows=2, verify_seconds=1.05,
                                 outcomes=[Outcome(estimate, 1, 1)]))
    controller.report(StepReport(batch_size=1, k=0, forward_seconds=None, rows=1, verify_seconds=1.0,
                                 outcomes=[Outcome(estimate, 0, 0)]))
    assert controller.costs.draft_time(1) == 0.01 and controller.costs.verify_time(2) == 1.05
    assert estimate.rate > AcceptanceEstimate().rate and controller.acceptance.rate > AcceptanceEstimate().rate
    assert controller.choose([estimate], [100], [1000]) == [4]  # cheap drafts, high acceptance: K_max
    for _ in range(30):  # every draft rejected: speculation stops
        controller.report(StepReport(1, 4, 0.01, 5, 1.25, [Outcome(estimate, 4, 0)]))
    assert controller.new_estimate().rate < 0.3
    assert controller.choose([estimate], [100], [1000]) == [0]


# ------------------------------------------------------------------------------------------- proposers
def test_build_proposer_maps_each_method_once():
    kw = dict(vocab_size=97, max_num_seqs=2, max_model_len=64)
    assert isinstance(build_proposer(None, **kw), NullProposer)
    assert isinstance(build_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=0), **kw), NullProposer)
    ngram = build_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2), **kw)
    assert isinstance(ngram, NgramProposer) and ngram.max_n == 2
    assert tree_of(SpeculativeConfig(method="eagle", model="heads", num_speculative_tokens=3, tree="dynamic")) == DynamicTree()
    assert tree_of(SpeculativeConfig(method="eagle", model="heads", num_speculative_tokens=3, tree=[[0], [1]])) == \
        TreeShape.from_choices([[0], [1]])


def test_the_null_proposer_never_drafts_and_the_interface_has_defaults():
    null = NullProposer()
    proposal = null.propose([object(), object()], [3, 3])
    assert proposal.drafts == [Draft([]), Draft([])] and proposal.forward_seconds is None and null.max_width(5) == 0
    base = Proposer()
    assert base.prefill(None, 0, 4) == 0 and base.cached_tokens(None) == 0 and base.memory_bytes == 0
    assert base.max_width(4) == 4 and base.cache is None and base.kv_caches == {}
    assert base.read_prompt(None) is None and base.observe([], [], [], []) is None  # hidden states: ignored
    assert base.usable_prefix(None, ["block"] * 3) == 3 and base.restore_prefix(None, None, ["block"], 16, None) == 16
    assert base.save_prefix(None, None, [b"key"]) is None  # no K/V of its own: nothing to save


def test_tree_masks_and_depths_are_built_once_per_shape():
    parents = [-1, -1, 0, 2]
    assert ancestor_mask(parents) is ancestor_mask(tuple(parents))
    assert depths(parents) == [1, 1, 2, 3]
    shape = TreeShape.from_choices([[0], [1], [0, 0], [0, 0, 0]])
    assert shape.truncated(2) is shape.truncated(2) and shape.truncated(3) is shape and shape.truncated(0) is None


def test_cache_capacities_are_whole_key_blocks():
    assert cache().capacity == KEY_BLOCK
    with pytest.raises(ValueError):
        cache().truncate(0, 1)


def test_one_clock_times_the_controller_and_the_proposers():
    """The engine's clock is the controller's, and through `bind` the proposer's, an auto proposer's second
    drafter's too: a clock that ticks once per reading makes a 3-token proposal's forward 1/3 of a tick."""
    clock = step_clock()
    scripted = NgramProposer(max_n=1)
    controller = SpeculationController.for_proposer(scripted, 3, clock=clock)
    assert controller.clock is clock and scripted.controller is controller and scripted.clock() == 0.0

    @dataclass
    class Seq:
        tokens: list[int]

    proposal = scripted.propose([Seq([5, 6, 7, 5, 6, 7, 5])], [3])
    assert proposal.drafts[0].tokens == [6, 7, 5] and proposal.forward_seconds == pytest.approx(1 / 3)
    second = NgramProposer()
    auto = AutoModelProposer(SuffixProposer(None), second, 3)
    SpeculationController.for_proposer(auto, 3, clock=clock)
    assert second.controller is auto.controller and second.controller.clock is clock
    assert SpeculationController.for_proposer(NullProposer(), 3).k_max == 0  # a proposer that never drafts: no K
