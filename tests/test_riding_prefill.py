"""A joining prompt read inside the running sequences' verification pass (`Engine(prefill_itl_factor=...)`, the
default): every output equals what the engine gives with prompts fed in chunks of their own, for every
proposer, greedy and seeded; the rows committed per step follow the measured budget (`ChunkBudget`); a step's
time stays near the factor of a decode step's on a model whose costs are set by the test."""

from __future__ import annotations

import pytest

from fakes import FakeTokenizer, one_intra_op_thread
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.engine.prefill import ChunkBudget
from test_engine_tiny import MAX_LEN, run, target
from test_prefix_cache import KINDS, make_engine, params

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

SHORT = tuple((5 * i + 2) % 90 for i in range(9))
LONG = tuple((13 * i + 7) % 90 for i in range(61))  # 60 tokens to read while SHORT decodes


def riding_steps(engine: Engine) -> list[int]:
    """Record the prompt tokens that ride in each step's pass; returns the list."""
    steps, rode = [], engine.planner.rode

    def spy(riding):
        steps.append(len(riding.rows.tokens))
        return rode(riding)

    engine.planner.rode = spy
    return steps


def fed_while_decoding(engine: Engine) -> list[int]:
    """Record the prompt tokens each pass of their own reads in a step that others decode in (not those of
    prompts fed together while none decode); returns the list."""
    fed, feed, prompts, decoding = [], engine.prefill.feed, engine.planner.prompts, [False]

    def spy(target, seq, budget, batch, *rest):
        n = feed(target, seq, budget, batch, *rest)
        if decoding[0]:
            fed.append(n)
        return n

    def step_prompts(read):
        decoding[0] = bool(engine.running)
        return prompts(read)

    engine.prefill.feed, engine.planner.prompts = spy, step_prompts
    return fed


@pytest.mark.parametrize("way", ["ride", "own pass"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("budget", [1, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_riding_prompts_give_the_outputs_of_prompts_fed_on_their_own(kind, budget, sampled, way):
    """SHORT decodes (80 tokens) while LONG (60 tokens to read) joins: LONG's prompt rides `budget` tokens a
    step in SHORT's pass (a tree pass for "eagle tree"), or is read `budget` tokens a step in a pass of its
    own before SHORT's (where riding does not pay, `ride_pays`), then both decode together; then a third
    request joins while they run. Outputs equal an engine that feeds every prompt in a chunk of its own."""
    longer = SamplingParams(temperature=0.9 if sampled else 0, top_k=40, max_tokens=80, ignore_eos=True, seed=1)
    requests = [("short", SHORT, longer), ("long", LONG, params(sampled, 2)),
                ("third", SHORT[:5] + LONG[:20], params(sampled, 3))]
    join_at = [0, 2, 9]
    fed_alone = run(make_engine(kind, chunk=64, batch=3, prefill_itl_factor=None), requests, join_at=join_at)
    engine = make_engine(kind, chunk=64, batch=3)
    engine.chunk_budget.tokens = lambda batch_size: budget
    engine.planner.ride_pays = lambda tokens: way == "ride"
    steps, fed = riding_steps(engine), fed_while_decoding(engine)
    riding = run(engine, requests, join_at=join_at)
    assert {r: o.token_ids for r, o in riding.items()} == {r: o.token_ids for r, o in fed_alone.items()}
    read = steps if way == "ride" else fed
    assert len(read) >= 5 and max(read) <= budget  # as many tokens a step as the budget allowed
    if way == "own pass":
        assert steps == []
    assert all(length == 0 for length in engine.cache.lengths)


def test_a_prompt_rides_where_padding_the_running_rows_costs_less_than_a_pass_of_its_own():
    """`ride_pays` on measured pass costs a + b x rows: riding pays while b x B x (tokens - 1) <= a."""
    from specdec.engine.prefill import ride_pays
    from specdec.speculative.costs import CostModel

    assert ride_pays(CostModel(), 6, 8)  # nothing measured: ride
    zen1 = CostModel()  # a = 50 ms, b = 53 ms a row
    for rows in (1, 2, 6, 12):
        zen1.record_verify(rows, 0.050 + 0.053 * rows)
    assert ride_pays(zen1, 6, 1) and not ride_pays(zen1, 6, 2) and not ride_pays(zen1, 1, 3)
    cheap_rows = CostModel()  # a = 45 ms, b = 4.5 ms
    for rows in (1, 2, 4):
        cheap_rows.record_verify(rows, 0.045 + 0.0045 * rows)
    assert ride_pays(cheap_rows, 1, 11) and not ride_pays(cheap_rows, 1, 12)
    assert ride_pays(cheap_rows, 6, 2) and not ride_pays(cheap_rows, 6, 3)
    # passes of one width only: a line from the passes that prompts rode in or were read in (`record_pass`)
    batch = CostModel()
    batch.record_verify(6, 0.050 + 0.053 * 6)
    for rows in (8, 14, 20):
        batch.record_pass(rows, 0.050 + 0.053 * rows)
    assert batch.pass_time(12) == pytest.approx(0.050 + 0.053 * 12) and not ride_pays(batch, 6, 2)


def test_a_request_for_prompt_logprobs_is_fed_on_its_own():
    """The riding pass gives the prompt rows no logits: a request that wants its prompt's log-probabilities is
    fed in chunks of its own, and gets the same values as when it runs alone."""
    wants = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    alone = run(make_engine("plain"), [("p", LONG, wants)])["p"]
    engine = make_engine("plain", batch=2)
    steps = riding_steps(engine)
    both = run(engine, [("short", SHORT, params(False)), ("p", LONG, wants)], join_at=[0, 2])
    assert steps == [] and both["p"].token_ids == alone.token_ids
    assert both["p"].prompt_logprobs == alone.prompt_logprobs


def test_the_budget_keeps_a_step_within_the_factor_of_a_decode_step():
    """Costs set by the test, on a clock the target's passes move: a pass costs 1 unit, plus 0.25 a prompt
    row riding in it. With factor 2, the budget settles on (2 - 1) x 1 / 0.25 = 4 rows a step, and no step
    but the first (8 rows, before anything is measured) takes more than 2 units."""
    now = [0.0]
    model = target("fp32")

    class Timed:  # the target, each pass moving the clock by its cost
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, tokens, positions, cache, **kw):
            rows = tokens.shape[0] - (kw.get("logit_rows") or tokens.shape[0])  # the prompt's row, if one rode
            now[0] += 1.0 + 0.25 * rows * tokens.shape[1]
            return model(tokens, positions, cache, **kw)

    engine = Engine(Timed(), FakeTokenizer(), None, num_speculative_tokens=0, max_model_len=MAX_LEN, max_batch_size=2,
                    clock=lambda: now[0])
    engine.planner.ride_pays = lambda tokens: True  # (pads cost nothing here: this model's passes cost by prompt rows)
    steps = riding_steps(engine)
    step_times, last = [], [0.0]

    def on_step(outputs):
        step_times.append(now[0] - last[0])
        last[0] = now[0]

    run(engine, [("short", SHORT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)),
                 ("long", LONG, params(False))], join_at=[0, 3], on_step=on_step)
    assert steps[0] == 8 and steps[1:-1] == [4] * (len(steps) - 2) and sum(steps) == 60
    riding_times = step_times[3:3 + len(steps)]
    assert riding_times[0] == 1.0 + 0.25 * 8 and all(t <= 2.0 for t in riding_times[1:])


def test_chunk_budget_arithmetic():
    budget = ChunkBudget(factor=2, most=512, first=8, weight=1.0)
    assert budget.tokens(1) == 8  # nothing measured
    budget.record(1, 0.080, read=0)
    assert budget.tokens(1) == 8  # no step with a prompt measured yet
    budget.record(1, 0.240, read=8)  # 20 ms a token beyond the 80 ms decode step
    assert budget.tokens(1) == 4 and budget.tokens(3) == 4  # (batch 3: the nearest measured batch size's)
    budget.record(1, 10.0, read=1)
    assert budget.tokens(1) == 1  # at least one: the prompt always advances
    budget.record(1, 0.080, read=100)  # (no time beyond a decode step: a floor, not a division by zero)
    assert budget.tokens(1) == 512
    with pytest.raises(ValueError):
        ChunkBudget(factor=1.0, most=512)
