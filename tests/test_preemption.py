"""Admission by current length, and preemption by recomputation (issue 31), as vLLM schedules: a request joins
when what the batch holds now fits the K/V pools (with a watermark), not what `max_tokens` may come to; when the
running requests outgrow the pools, the newest steps out to the head of the queue and joins again later, all its
tokens so far read again as its prompt. Outputs stay the unbatched ones, token for token, for every proposer
(their state of a preempted sequence rebuilt from its tokens), with and without the prefix cache (whose blocks a
preempted sequence saves and may find again), greedy and seeded; every page stays accounted for."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeTokenizer, one_intra_op_thread, step_clock
from specdec.config import ModelConfig, SamplingParams
from specdec.engine import Engine
from specdec.engine.scheduler import Scheduler
from specdec.models.kv_cache import PAGE, KVCache
from specdec.speculative.auto_model import AutoModelProposer
from specdec.speculative.proposers import SuffixProposer
from specdec.speculative.suffix import SuffixCache
from specdec.speculative.draft_model import DraftModelProposer
from test_engine_tiny import MAX_LEN, draft, run, target
from test_prefix_cache import KINDS, assert_pages_accounted, make_engine

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

# 4 prompts of 60 tokens, 60 to write each: all four join (4 pages each), and outgrow a pool of 256 slots
PROMPTS = [tuple((5 * i + 11 * j + 2) % 90 for i in range(60)) for j in range(4)]
MAX_TOKENS = 60
RIDE = 8  # prompt tokens a step while others decode


def engine_for(kind: str, blocks: int = 0, block: int = PAGE) -> Engine:
    """4 rows sharing 256 slots (+ the drafts' pads), `blocks` prefix-cache blocks of `block` tokens. A joining
    prompt rides `RIDE` tokens a step in the running rows' passes, and the engine's clock counts calls, not seconds (the
    measured riding budget and auto speculation's measured costs would make the schedule, and whether the pool is
    outgrown before the first request ends, follow the machine's load)."""
    if kind in ("suffix", "auto"):
        suffix = SuffixProposer(SuffixCache(8, 100))
        proposer = suffix if kind == "suffix" else AutoModelProposer(
            suffix, DraftModelProposer(draft("fp32", "noisy copy"), 4, MAX_LEN, window=16), 3, True, "draft_model")
        engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=5 if kind == "suffix" else 8,
                        max_model_len=MAX_LEN, max_batch_size=4, row_tokens=MAX_LEN, prefill_chunk=48,
                        prefix_cache_blocks=blocks, prefix_block_size=block, clock=step_clock())
    else:
        engine = make_engine(kind, chunk=48, blocks=blocks, batch=4, block=block, row_tokens=MAX_LEN,
                             clock=step_clock())
    engine.chunk_budget.tokens = lambda batch_size: RIDE
    return engine


def alone(prompt, params: SamplingParams, kind: str = "plain") -> tuple[list[int], object]:
    """The request on an engine of its own, nothing else running (never preempted)."""
    out = run(engine_for(kind), [("r", prompt, params)])["r"]
    assert out.metrics.preemptions == 0
    return list(out.token_ids), out


def run_pool(engine: Engine, requests) -> tuple[dict, list[list[str]]]:
    """Run `requests` together; every page accounted for after each step. Returns the final outputs and who
    ran in each step (running, then the joining one)."""
    batches = []

    def on_step(_outputs):
        assert_pages_accounted(engine)
        batches.append([s.request_id for s in engine.running] + ([engine.prefilling.request_id]
                                                                  if engine.prefilling else []))

    finals = run(engine, requests, on_step=on_step)
    pool = engine.cache.num_pages
    assert len(engine.cache.free) + assert_pages_accounted(engine)["target"] == pool  # every page back (or cached)
    return finals, batches


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("blocks,block", [(0, PAGE), (4, PAGE), (16, 8)],
                         ids=["no prefix cache", "mapped prefix cache", "copied prefix cache"])
@pytest.mark.parametrize("kind", [*KINDS, "suffix", "auto"])
def test_requests_that_outgrow_the_pool_are_preempted_and_recomputed_exactly(kind, blocks, block):
    """All four join by their current lengths (16 pages of 24), grow past the pool, and the newest step out and
    back in, as often as it takes: every output is the one alone, every page accounted for."""
    engine = engine_for(kind, blocks, block)
    finals, batches = run_pool(engine, [(str(j), prompt, GREEDY) for j, prompt in enumerate(PROMPTS)])
    assert max(map(len, batches)) == 4  # admitted by what they hold, not by max_tokens
    assert sum(out.metrics.preemptions for out in finals.values()) > 0
    assert engine.metrics.preemptions == sum(out.metrics.preemptions for out in finals.values())
    for j, prompt in enumerate(PROMPTS):
        assert list(finals[str(j)].token_ids) == alone(prompt, GREEDY)[0], f"request {j}"
    assert finals["0"].metrics.preemptions == 0  # the oldest runs on


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_a_preempted_seeded_request_draws_the_same_tokens(kind):
    """A seeded request's sampler is its own and recomputation draws nothing: preempted, it draws what it draws
    alone (drafts that depend on its tokens alone, as prompt lookup's, are the same too)."""
    params = [SamplingParams(temperature=1.0, seed=10 + j, max_tokens=MAX_TOKENS, ignore_eos=True) for j in range(4)]
    finals, _ = run_pool(engine_for(kind), [(str(j), prompt, p) for j, (prompt, p) in enumerate(zip(PROMPTS, params))])
    assert sum(out.metrics.preemptions for out in finals.values()) > 0
    for j, (prompt, p) in enumerate(zip(PROMPTS, params)):
        assert list(finals[str(j)].token_ids) == alone(prompt, p, kind)[0], f"request {j}"


def test_a_preempted_request_keeps_its_prompt_logprobs_and_logprobs():
    """The newest request asks for its prompt's and its tokens' log-probabilities: preempted, it reports each
    position once, the values it reports alone."""
    want = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    requests = [(str(j), prompt, want if j == 3 else GREEDY) for j, prompt in enumerate(PROMPTS)]
    finals, _ = run_pool(engine_for("ngram"), requests)
    out = finals["3"]
    assert out.metrics.preemptions > 0
    _, ref = alone(PROMPTS[3], want, "ngram")
    assert len(out.prompt_logprobs) == len(PROMPTS[3]) and len(out.logprobs) == MAX_TOKENS
    assert out.token_ids == ref.token_ids
    for got, want in [(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]), (out.logprobs, ref.logprobs)]:
        # the same tokens, ranks and alternatives; the values up to the rounding of rows computed in a batch
        # (the tiny fp32 model's matmuls are not row-invariant as the kernels are)
        assert [(x.token_id, x.rank, [t for t, _ in x.top]) for x in got] == \
            [(x.token_id, x.rank, [t for t, _ in x.top]) for x in want]
        assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=1e-5)


def test_requests_asking_for_the_whole_context_run_together():
    """Agents ask for max_tokens up to the context: two such requests, each of which alone may come to fill the
    pool, run side by side while what they hold fits (before, each reserved max_tokens: one at a time)."""
    engine = engine_for("plain")
    p = SamplingParams(temperature=0, max_tokens=MAX_LEN - 20, stop_token_ids=[40])
    prompts = [tuple((3 * i + j) % 90 for i in range(20)) for j in range(2)]
    finals, batches = run_pool(engine, [(str(j), prompt, p) for j, prompt in enumerate(prompts)])
    assert any(len(b) == 2 for b in batches)
    for j, prompt in enumerate(prompts):
        assert list(finals[str(j)].token_ids) == alone(prompt, p)[0]


# ------------------------------------------------------------------------------------------- the scheduler
class Seq:
    def __init__(self, request_id: str, need: int) -> None:
        self.request_id, self.need, self.row = request_id, need, -1


def test_the_scheduler_admits_by_current_need_and_preempts_the_newest():
    """A pool of 8 pages: a (3 pages) joins alone, b (3) beside it with the watermark's page to spare, c (2)
    waits (3 + 3 + 2 + 1 > 8). a grows to 5 pages: 5 + 3 fit; to 6: b, the newest, steps out to the head of the
    queue (its row freed), never a, the only one left. A joining sequence steps out before a running one."""
    config = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=8, hidden_size=4, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                         max_position_embeddings=128, rms_norm_eps=1e-6)
    cache = KVCache(config, 4, 128, torch.float32, num_pages=8)
    scheduler = Scheduler(4, [cache], need=lambda s: s.need)
    a, b, c = Seq("a", 40), Seq("b", 40), Seq("c", 20)
    for s in (a, b, c):
        scheduler.add(s)
    for s in (a, b):
        assert scheduler.joining() is s
        scheduler.join(s)
    assert scheduler.joining() is None and list(scheduler.waiting) == [c]
    a.need = 80
    assert scheduler.victim() is None
    a.need = 90
    assert scheduler.victim() is b
    scheduler.preempt(b)
    assert scheduler.running == [a] and list(scheduler.waiting) == [b, c] and b.row == -1
    a.need = 128
    assert scheduler.victim() is None  # the only one
    a.need = 40
    assert scheduler.joining() is b and b.row == 1
    a.need = 90
    assert scheduler.victim() is b  # joining
    scheduler.preempt(b)
    assert scheduler.prefilling is None and list(scheduler.waiting) == [b, c]


def test_preemptions_are_reported_per_request_and_counted_by_the_server():
    """A request's `preemptions` reach its `specdec` usage field (`SpecMetrics.to_dict`) and the server's
    `specdec:num_preemptions_total` (vLLM's name), each counted once however many outputs report it."""
    from prometheus_client.parser import text_string_to_metric_families

    from specdec.engine.metrics import SpecMetrics
    from specdec.engine.outputs import RequestOutput
    from specdec.server.metrics import ServerMetrics

    server = ServerMetrics("m")

    def output(preemptions: int, finished: bool) -> RequestOutput:
        return RequestOutput("r", [1, 2], new_token_ids=[3], finished=finished,
                             metrics=SpecMetrics(preemptions=preemptions))

    for n, finished in [(0, False), (1, False), (1, False), (2, True)]:
        server.on_step([output(n, finished)])
    samples = {s.name: s.value for family in text_string_to_metric_families(server.render().decode())
               for s in family.samples}
    assert samples["specdec:num_preemptions_total"] == 2
    assert SpecMetrics(preemptions=2).to_dict()["preemptions"] == 2
