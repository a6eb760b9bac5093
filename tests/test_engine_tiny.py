"""The engine on tiny random models: exact stop rules inside accepted drafts, greedy equivalence between
speculative and plain decoding (token for token, fp32 and bf16, every proposer, K in 1/3/5/8, fixed and
adaptive, single and batched), seeded sampling, abort, and the metrics' bookkeeping."""

from __future__ import annotations

import asyncio
import random
import time
from functools import lru_cache

import pytest
import torch

from conftest import tiny_model
from fakes import FakeTokenizer, ScriptedProposer, letter, noisy_copy, one_intra_op_thread, step_clock, \
    varied_model
from specdec.config import SamplingParams
from specdec.engine import verification
from specdec.engine import Engine
from specdec.engine.stop_strings import StopStrings
from specdec.server.async_engine import AsyncEngine, RequestFailedError
from specdec.speculative.costs import CostModel
from specdec.speculative.draft_model import DraftModelProposer, draft_vocabulary
from specdec.speculative.proposers import Draft, NgramProposer
from specdec.testing.degraded import PermutedLogitsModel

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# repetitive prompts (so prompt lookup has something to find) and one without repeats
PROMPTS = (
    (1, 2, 3, 4, 1, 2, 3, 4, 1, 2),
    (50, 60, 50, 60, 50, 60, 50),
    (7, 3, 88, 41, 9, 12),
)


class SetCosts(CostModel):
    """Draft and verification costs set by the test alone (`CostModel.record_*` called on it): what the
    engine measures of them is ignored."""

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        pass

    def record_verify(self, rows: int, seconds: float) -> None:
        pass


class SpeculationPays(CostModel):
    """Fixed costs, measurements ignored: a draft forward costs 1% of a target pass, and a target pass
    costs the same for 1 to 64 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.draft, self.verify = {1: 0.01}, {1: 1.0, 64: 1.0}
        self.prefill = {"target": 0.01, "draft": 0.0001}

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        pass

    def record_verify(self, rows: int, seconds: float) -> None:
        pass

    def record_prefill(self, model: str, tokens: int, seconds: float) -> None:
        pass


@lru_cache(maxsize=None)
def target(dtype_name: str):
    return varied_model(seed=0, dtype=DTYPES[dtype_name])


@lru_cache(maxsize=None)
def draft(dtype_name: str, kind: str):
    if kind == "other seed":
        return varied_model(seed=1, dtype=DTYPES[dtype_name])
    if kind == "noisy copy":  # agrees with the target about half the time
        return noisy_copy(target(dtype_name), std=0.35)
    if kind == "self":
        return target(dtype_name)
    raise ValueError(kind)


def make_proposer(dtype_name: str, kind: str, max_batch_size: int = 1):
    if kind == "ngram":
        return NgramProposer(max_n=3)
    # the target drafting for itself must agree on every token: it may never restart on a short window
    window = MAX_LEN if kind == "self" else 16
    return DraftModelProposer(draft(dtype_name, kind), max_batch_size, MAX_LEN, window=window)


def run(engine: Engine, requests, join_at=None, on_step=None):
    """Add `requests` ([(id, prompt, params)]), request i at step join_at[i] (default 0), and step until all
    finish, calling `on_step(outputs)` after each step if given. Returns {id: final output} and checks that
    the streamed deltas add up to the final output."""
    join_at = join_at or [0] * len(requests)
    finals, streamed_ids, streamed_text = {}, {}, {}
    step = 0
    while len(finals) < len(requests):
        for (rid, prompt, params), at in zip(requests, join_at):
            if at == step:
                engine.add_request(rid, list(prompt), params)
        outputs = engine.step()
        if on_step is not None:
            on_step(outputs)
        for out in outputs:
            streamed_ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            streamed_text[out.request_id] = streamed_text.get(out.request_id, "") + out.new_text
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        step += 1
        assert step < 10_000
    assert not engine.has_unfinished_requests()
    for rid, out in finals.items():
        if out.error is not None:  # failed mid-step: the final output need not add up
            continue
        assert streamed_ids[rid] == out.token_ids
        assert streamed_text[rid] == out.text  # a streamed stop-string prefix would show here
    return finals


def generate(engine: Engine, prompt, params: SamplingParams):
    return run(engine, [("r", prompt, params)])["r"]


@lru_cache(maxsize=None)
def plain(dtype_name: str, prompt: tuple[int, ...], max_tokens: int = 40) -> tuple[int, ...]:
    engine = Engine(target(dtype_name), FakeTokenizer(), max_model_len=MAX_LEN)
    out = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    return tuple(out.token_ids)


def assert_metrics_consistent(out) -> None:
    m = out.metrics
    assert m.emitted_tokens == len(out.token_ids)
    assert m.num_accepted_tokens <= m.num_draft_tokens and m.num_drafts <= m.target_passes
    assert sum(m.accepted_per_position) == m.num_accepted_tokens
    assert all(a >= b for a, b in zip(m.accepted_per_position, m.accepted_per_position[1:]))  # a chain
    assert m.accepted_per_position[:1] <= [m.num_drafts]
    assert m.tokens_per_pass == pytest.approx(m.emitted_tokens / m.target_passes)
    assert m.mean_acceptance_length == (pytest.approx(1 + m.num_accepted_tokens / m.num_drafts) if m.num_drafts else 0)


# ------------------------------------------------------------------------------------------- stop rules
def oracle(continuation: list[int], wrong_at: int | None = None):
    """A scripted proposer that drafts the target's own greedy continuation (so every drafted token is
    accepted), optionally with a wrong token at output position `wrong_at` (rejected there)."""

    def script(seq):
        n = len(seq.tokens) - len(seq.prompt_ids)
        draft = list(continuation[n:])
        if wrong_at is not None and n <= wrong_at < n + len(draft):
            draft[wrong_at - n] = (continuation[wrong_at] + 1) % 96
        return draft

    return ScriptedProposer(script)


STOP_PROMPT = (11, 12, 13, 14, 15)


@pytest.fixture(scope="module")
def continuation():
    """The fp32 target's greedy continuation of STOP_PROMPT; its first 8 tokens are distinct and none is 96."""
    with torch.inference_mode():
        cont = list(plain("fp32", STOP_PROMPT, 40))
    assert len(set(cont[:8])) == 8 and 96 not in cont[:12], cont
    return cont


@pytest.mark.parametrize("eos_at", range(6))
def test_eos_inside_an_accepted_draft_ends_the_output_there(continuation, eos_at):
    """K = 5, every drafted token accepted: the first pass emits continuation[0:6]. Make continuation[eos_at]
    the EOS id: the output is continuation[:eos_at + 1], nothing after the EOS is emitted."""
    eos = continuation[eos_at]
    proposer = oracle(continuation)
    engine = Engine(target("fp32"), FakeTokenizer(eos_token_ids=(eos,)), proposer, num_speculative_tokens=5,
                    max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30))
    assert out.token_ids == continuation[: eos_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", eos)
    assert out.text == "".join(letter(t) for t in continuation[:eos_at])  # the EOS itself has no text
    assert proposer.calls[0][2] == continuation[:5]  # the draft did carry the tokens after the EOS
    assert out.metrics.target_passes == 1 and out.metrics.num_accepted_tokens == 5
    assert_metrics_consistent(out)
    # with ignore_eos the same pass keeps going
    engine = Engine(target("fp32"), FakeTokenizer(eos_token_ids=(eos,)), oracle(continuation), num_speculative_tokens=5,
                    max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert out.token_ids == continuation[:30] and out.finish_reason == "length"


@pytest.mark.parametrize("eos_at", [0, 2, 4])
def test_eos_as_the_recovered_token(continuation, eos_at):
    """The draft is wrong at position eos_at; the target's own token there (the recovered token) is EOS."""
    eos = continuation[eos_at]
    engine = Engine(target("fp32"), FakeTokenizer(eos_token_ids=(eos,)), oracle(continuation, wrong_at=eos_at),
                    num_speculative_tokens=5, max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30))
    assert out.token_ids == continuation[: eos_at + 1] and out.stop_reason == eos
    assert out.metrics.num_accepted_tokens == eos_at


@pytest.mark.parametrize("k", [1, 5, 8])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 7, 9, 13])
def test_max_tokens_is_never_exceeded(continuation, k, max_tokens):
    """Every drafted token is accepted, so each pass could emit k + 1 tokens; the output stops at exactly
    max_tokens, and no pass is asked to draft beyond it."""
    proposer = oracle(continuation)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=k, max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert out.token_ids == continuation[:max_tokens]
    assert out.finish_reason == "length" and out.stop_reason is None
    produced = 0
    for _, asked, _ in proposer.calls:
        assert asked <= max_tokens - produced - 1
        produced += asked + 1
    assert_metrics_consistent(out)


@pytest.mark.parametrize("start", [0, 1, 2, 3])
def test_stop_string_inside_an_accepted_draft_truncates_there(continuation, start):
    """Stop string = the text of continuation[start:start + 2], completed inside the first pass's
    accepted draft (K = 5): the text ends right before it, no token after the one completing it is
    emitted, finish_reason "stop" and stop_reason the string."""
    text = "".join(letter(t) for t in continuation)
    stop = text[start:start + 2]
    assert text.find(stop) == start
    proposer = oracle(continuation)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=5, max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=("zzzz", stop)))
    assert out.text == text[:start]
    assert out.token_ids == continuation[: start + 2]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.metrics.target_passes == 1


def test_stop_string_across_steps(continuation):
    """A stop string that begins in one pass's output and ends in the next: the final text ends before it,
    and the streamed `new_text` never carried its beginning (regression: "ngplon" streamed, "ngpl" final)."""
    text = "".join(letter(t) for t in continuation)
    stop = text[4:8]  # the first pass (K = 5) emits tokens 0..5, the second completes the string at 7
    assert text.find(stop) == 4
    engine = Engine(target("fp32"), FakeTokenizer(), oracle(continuation), num_speculative_tokens=5,
                    max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=stop))
    assert out.text == text[:4] and out.token_ids == continuation[:8]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


@pytest.mark.parametrize("order", [1, -1])
def test_of_several_stop_strings_the_first_completed_wins(continuation, order):
    """Two stop strings completed in the same pass: the text is cut at the one that ends first, whatever their
    order in the request."""
    text = "".join(letter(t) for t in continuation)
    first, second = text[1:3], text[3:5]
    engine = Engine(target("fp32"), FakeTokenizer(), oracle(continuation), num_speculative_tokens=5,
                    max_model_len=MAX_LEN)
    out = generate(engine, STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=(second, first)[::order]))
    assert (out.text, out.stop_reason, out.token_ids) == (text[:1], first, continuation[:3])


def test_stop_strings_find_the_first_completed():
    stops = StopStrings(("ab", "b", "cde", "e"))
    assert stops.find("xxab", 0) == (2, "ab")  # "ab" and "b" end together: the longer began first
    assert stops.find("xxab", 4) is None  # nothing new: nothing ends past 4
    assert stops.find("xxcde", 4) == (2, "cde")  # begun before the new text
    assert stops.find("ab", 1) == (0, "ab") and stops.longest == 3
    with pytest.raises(ValueError):
        StopStrings(("a", ""))


def test_stop_string_checks_do_not_scale_with_their_number():
    """100,000 stop strings: a check of a few new characters costs set lookups per distinct length, not a
    scan of every string (the old scan: ~40 ms per token here; 1,000 checks now: ~6 ms)."""
    many = StopStrings(tuple(f"{i:08d}" for i in range(100_000)))
    text = "no stop string in here, " * 40
    t0 = time.perf_counter()
    for end in range(len(text) - 1000, len(text)):
        assert many.find(text[:end], end - 1) is None
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------------------------------- greedy equivalence
PROPOSERS = ("other seed", "noisy copy", "self", "ngram")


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_a_draft_with_a_vocabulary_keeps_greedy_output_exact(dtype_name, k):
    """A draft that proposes only 40 of the 97 tokens (`draft_vocab_size`): drafts are accepted where the
    target's token is among them, and the output is plain decoding's."""
    accepted = 0
    for prompt in PROMPTS:
        vocab = draft_vocabulary(40, 97, [])
        engine = Engine(target(dtype_name), FakeTokenizer(), DraftModelProposer(draft(dtype_name, "noisy copy"), 1, MAX_LEN,
                        vocab=vocab), num_speculative_tokens=k, max_model_len=MAX_LEN)
        out = generate(engine, prompt, GREEDY)
        assert tuple(out.token_ids) == plain(dtype_name, prompt), f"prompt {prompt}"
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("kind", PROPOSERS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_greedy_speculative_equals_plain(dtype_name, kind, k, adaptive):
    totals = [0, 0, 0]  # drafts, drafted tokens, accepted tokens
    for prompt in PROMPTS:
        engine = Engine(target(dtype_name), FakeTokenizer(), make_proposer(dtype_name, kind), num_speculative_tokens=k,
                        adaptive=adaptive, max_model_len=MAX_LEN)
        if adaptive:  # costs where drafting pays: the controller's choices (and this test's counts) do not
            engine.controller.costs = SpeculationPays()  # depend on how fast this machine runs a tiny model
        out = generate(engine, prompt, GREEDY)
        assert tuple(out.token_ids) == plain(dtype_name, prompt), f"prompt {prompt}"
        assert_metrics_consistent(out)
        m = out.metrics
        totals = [totals[0] + m.num_drafts, totals[1] + m.num_draft_tokens, totals[2] + m.num_accepted_tokens]
        if kind == "self":  # the target drafting for itself: every drafted token must be accepted
            assert m.num_accepted_tokens == m.num_draft_tokens > 0
    drafts, drafted, accepted = totals
    assert drafts > 0  # the proposer did draft (ngram: its lookups found matches)
    if kind == "noisy copy" and not adaptive:  # exercises partial acceptance and rollback (adaptive K may,
        assert 0 < accepted < drafted         # rightly, draft only a few probes with a draft as slow as this)
    if kind == "ngram":
        assert accepted > 0


def test_stock_tiny_model_greedy_equivalence():
    """The stock `tiny_model` (no weight scaling) too, in bf16, with its own seed-1 sibling as draft."""
    tgt, drf = tiny_model("llama", 0, torch.bfloat16), tiny_model("llama", 1, torch.bfloat16)
    prompt = [4, 8, 15, 16, 23, 42]
    ref = generate(Engine(tgt, FakeTokenizer(), max_model_len=MAX_LEN), prompt, GREEDY).token_ids
    for proposer, k in ((DraftModelProposer(drf, 1, MAX_LEN), 4), (DraftModelProposer(tgt, 1, MAX_LEN), 5),
                        (NgramProposer(), 3)):
        out = generate(Engine(tgt, FakeTokenizer(), proposer, num_speculative_tokens=k,
                              max_model_len=MAX_LEN), prompt, GREEDY)
        assert out.token_ids == ref


BATCH_REQUESTS = [
    # (id, prompt, max_tokens, step at which it joins)
    ("a", (1, 2, 3, 4, 1, 2, 3, 4, 1, 2), 25, 0),
    ("b", (50, 60, 50), 9, 0),
    ("c", (7, 3, 88, 41, 9, 12, 30, 31, 32, 7, 3, 88), 30, 2),
    ("d", (20, 21, 22, 20, 21), 17, 3),
    ("e", (5, 5, 5, 5, 5, 5, 5, 5), 12, 7),
    ("f", (90, 1, 90, 2, 90, 3), 21, 7),
]


@pytest.mark.parametrize(
    "kind,k,adaptive",
    [("plain", 0, False), ("ngram", 3, False), ("noisy copy", 4, False), ("noisy copy", 5, True), ("self", 3, False),
     ("other seed", 2, True)],
)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_batched_outputs_equal_unbatched(dtype_name, kind, k, adaptive):
    """max_batch_size = 3; six requests of different prompt lengths and max_tokens join at different steps
    (waiting when the batch is full) and leave as they finish (rows are repacked): every output is its own
    unbatched plain greedy output."""
    proposer = None if kind == "plain" else make_proposer(dtype_name, kind, max_batch_size=3)
    engine = Engine(target(dtype_name), FakeTokenizer(), proposer, num_speculative_tokens=k, adaptive=adaptive,
                    max_model_len=MAX_LEN, max_batch_size=3)
    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in BATCH_REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in BATCH_REQUESTS])
    for rid, prompt, n, _ in BATCH_REQUESTS:
        assert tuple(finals[rid].token_ids) == plain(dtype_name, prompt, 40)[:n], f"request {rid}"
        assert_metrics_consistent(finals[rid])
        if kind == "self":
            assert finals[rid].metrics.num_accepted_tokens == finals[rid].metrics.num_draft_tokens
    assert engine.metrics.emitted_tokens == sum(n for _, _, n, _ in BATCH_REQUESTS)  # cumulative metrics


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_adaptive_batch_under_shifting_costs_stays_exact(seed):
    """Stress: up to 8 sequences of random prompts join at random steps while the measured costs are
    set at random, so the batch's K switches on and off, probes come every few steps and draft rows
    restart on a 4-token window; every output is still its own plain greedy output."""
    rnd = random.Random(seed)
    engine = Engine(target("fp32"), FakeTokenizer(), DraftModelProposer(draft("fp32", "noisy copy"), 8, MAX_LEN,
                    window=4), num_speculative_tokens=4, adaptive=True, max_model_len=MAX_LEN, max_batch_size=8,
                    prefill_chunk=rnd.choice([3, 8, 64]))
    engine.controller.policy.probe_interval = engine.controller.policy.probe_every = 2
    engine.controller.costs = SetCosts()  # costs come from `perturb` alone: the run is deterministic
    requests = [(str(i), tuple(rnd.randrange(96) for _ in range(rnd.randrange(2, 30))), rnd.randrange(5, 40))
                for i in range(12)]
    join_at = [rnd.randrange(0, 30) for _ in requests]

    def perturb(outputs):  # a random cost curve each time, as a machine could measure (rows cost more)
        if rnd.random() < 0.3:
            step, per_row = rnd.random(), rnd.random() / 8
            batch, rows = rnd.randrange(1, 9), rnd.randrange(1, 50)
            CostModel.record_draft(engine.costs, batch, rnd.random() * step)
            CostModel.record_verify(engine.costs, rows, step * (1 + per_row * (rows - 1)))

    finals = run(engine, [(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                          for rid, p, n in requests], join_at=join_at, on_step=perturb)
    for rid, prompt, n in requests:
        assert tuple(finals[rid].token_ids) == plain("fp32", prompt, n), f"request {rid}"
    assert 0 < engine.metrics.num_drafts < engine.metrics.target_passes, engine.metrics  # K switched on and off


@pytest.mark.parametrize("kind", ["scripted", "other seed", "noisy copy", "ngram"])
def test_batch_with_a_sequence_at_the_end_of_the_context(kind):
    """max_model_len = 32: request "0" runs to the last position of the context while request "1" drafts
    K = 5. The batch's target pass pads "0" to the widest draft, and a draft model keeps feeding rows that
    asked for fewer tokens: neither may run past the caches (regression: "sequence of 33 tokens exceeds the
    KV cache capacity of 32")."""
    L = 32
    requests = [("0", tuple(range(1, 21)), 12), ("1", (3, 4, 5, 3, 4, 5, 3, 4, 5), 23)]
    if kind == "scripted":  # no draft for "0", five (wrong) drafted tokens for "1" at every step
        proposer = ScriptedProposer(lambda seq: [] if seq.request_id == "0" else [1, 2, 3, 4, 5])
    else:
        proposer = NgramProposer() if kind == "ngram" else DraftModelProposer(draft("fp32", kind), 2, L)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=5, max_model_len=L,
                    max_batch_size=2)
    finals = run(engine, [(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                          for rid, p, n in requests])
    for rid, prompt, n in requests:
        assert tuple(finals[rid].token_ids) == plain("fp32", prompt, n)
        assert len(prompt) + len(finals[rid].token_ids) <= L


def test_abort_leaves_the_others_exact():
    engine = Engine(target("bf16"), FakeTokenizer(), make_proposer("bf16", "noisy copy", 3), num_speculative_tokens=3,
                    max_model_len=MAX_LEN, max_batch_size=3)
    for rid, prompt in zip("xyz", PROMPTS):
        engine.add_request(rid, list(prompt), GREEDY)
    finals = {}
    for step in range(200):
        if step == 3:
            engine.abort_request("y")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert finals["y"].finish_reason == "abort" and 0 < len(finals["y"].token_ids) < 40
    assert tuple(finals["x"].token_ids) == plain("bf16", PROMPTS[0])
    assert tuple(finals["z"].token_ids) == plain("bf16", PROMPTS[2])


# ------------------------------------------------------------------------------------------- one sequence's fault
BAD_PROMPT = (9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7)  # 11 tokens to prefill: 4 chunks of 3


class InjectedFault(RuntimeError):
    pass


def inject(engine: Engine, fault: str, monkeypatch, bad: str = "bad", at: int = 2) -> None:
    """Make one part of the step go wrong for request `bad` only, from its `at`-th time on: "judging"
    (`verification.accept` raises), "detokenizing" (its detokenizer raises, halfway through appending),
    "prefilling" (the target's forward over one of its prompt chunks, fed on its own, raises), "reading" (its
    prompt chunks ride in the running sequences' pass, and committing one of them raises) or "drafting" (the
    proposer drafts ids outside the vocabulary, which the target pass cannot take)."""
    calls = 0

    def fail_at_call() -> None:
        nonlocal calls
        calls += 1
        if calls >= at:
            raise InjectedFault(f"{fault} failed")

    if fault == "judging":
        accept = verification.accept

        def judging(seq, *args):
            if seq.request_id == bad:
                fail_at_call()
            return accept(seq, *args)

        monkeypatch.setattr(verification, "accept", judging)
    elif fault == "prefilling":
        model = engine.target

        class FailingPrefill:  # the target, failing on the bad request's prompt chunks (fed in a row view)
            def __getattr__(self, name):
                return getattr(model, name)

            def __call__(self, tokens, positions, cache, **kw):
                joining = engine.prefilling
                if cache is not engine.cache and joining is not None and joining.request_id == bad:
                    fail_at_call()
                return model(tokens, positions, cache, **kw)

        engine.target = engine.planner.target = FailingPrefill()  # (the planner feeds prompts with it)
    elif fault == "reading":
        read = engine.prefill.read

        def reading(seq, *args):
            if seq.request_id == bad:
                fail_at_call()
            return read(seq, *args)

        monkeypatch.setattr(engine.prefill, "read", reading)
    elif fault == "detokenizing":
        add_request = engine.add_request

        def add_and_break(request_id, prompt, params, cache_salt=None):
            add_request(request_id, prompt, params, cache_salt)
            detokenizer = engine.waiting[-1].output.detokenizer
            add = detokenizer.add

            def failing(ids):
                if request_id == bad:
                    fail_at_call()
                return add(ids)

            detokenizer.add = failing

        engine.add_request = add_and_break
    elif fault == "drafting":
        propose = engine.proposer.propose

        def drafting(seqs, ks):
            proposal = propose(seqs, ks)
            proposal.drafts = [Draft([engine.vocab_size + 3] * len(d.tokens)) if s.request_id == bad and d.tokens
                               else d for s, d in zip(seqs, proposal.drafts)]
            return proposal

        engine.proposer.propose = drafting
    else:
        raise ValueError(fault)


@pytest.mark.parametrize("fault,kind", [(f, k) for f in ("judging", "detokenizing", "prefilling", "reading")
                                        for k in ("plain", "noisy copy", "ngram")]
                         + [("drafting", "noisy copy"), ("drafting", "ngram")])
def test_a_fault_in_one_sequence_ends_it_alone(fault, kind, monkeypatch):
    """A request whose own part of a step raises ends alone, finish_reason "abort" with the error said;
    every other request of the batch (running, being prefilled, waiting, joining later) still gets
    exactly its plain greedy output. A draft the target cannot take is dropped: then nobody fails.
    "prefilling" feeds prompts in chunks of their own; the others let them ride in the running
    sequences' pass (the default)."""
    proposer = None if kind == "plain" else make_proposer("fp32", kind, max_batch_size=3)
    engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=4, max_model_len=MAX_LEN,
                    max_batch_size=3, prefill_chunk=3, prefill_itl_factor=None if fault == "prefilling" else 2.0)
    inject(engine, fault, monkeypatch)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    requests = [("bad", BAD_PROMPT, greedy(30))] + [(rid, prompt, greedy(n)) for rid, prompt, n, _ in BATCH_REQUESTS]
    finals = run(engine, requests, join_at=[1] + [at for *_, at in BATCH_REQUESTS])
    for rid, prompt, n, _ in BATCH_REQUESTS:
        assert tuple(finals[rid].token_ids) == plain("fp32", prompt, 40)[:n], f"request {rid}"
        assert finals[rid].error is None
    bad = finals["bad"]
    if fault == "drafting":
        assert tuple(bad.token_ids) == plain("fp32", BAD_PROMPT, 30) and bad.error is None
        return
    assert bad.finish_reason == "abort" and bad.error == f"InjectedFault: {fault} failed"
    assert tuple(bad.token_ids) == plain("fp32", BAD_PROMPT, 30)[:len(bad.token_ids)]  # what it had is right
    assert bad.token_ids == [] if fault in ("prefilling", "reading") else 0 < len(bad.token_ids) < 30  # midway
    assert engine.cache.lengths == [0, 0, 0] and not engine.running  # every row freed


def test_async_engine_serves_on_after_one_request_fails(monkeypatch):
    """Through the async engine: the failing request's stream raises RequestFailedError (naming it, not the
    exception), the others complete exactly, and a request added afterwards is served exactly too."""
    engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "noisy copy", 2), num_speculative_tokens=3,
                    max_model_len=MAX_LEN, max_batch_size=2)
    inject(engine, "judging", monkeypatch, at=3)
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def tokens(request_id: str, prompt) -> list[int]:
        stream = await async_engine.add_request(request_id, list(prompt), GREEDY)
        return [t async for out in stream for t in out.new_token_ids]

    async def main():
        results = await asyncio.gather(tokens("bad", BAD_PROMPT), tokens("good", PROMPTS[0]), return_exceptions=True)
        after = await tokens("after", PROMPTS[1])
        return results, after

    try:
        (failed, good), after = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert isinstance(failed, RequestFailedError) and "bad" in str(failed) and "Injected" not in str(failed)
    assert tuple(good) == plain("fp32", PROMPTS[0]) and tuple(after) == plain("fp32", PROMPTS[1])


CHUNKED_REQUESTS = [
    # (id, prompt, max_tokens, step at which it joins); prefill_chunk 3, max_batch_size 3
    ("a", (1, 2, 3, 4, 1, 2, 3, 4, 1, 2), 8, 0),  # 9 tokens to feed: 3 steps
    ("b", (50, 60, 50), 40, 0),  # waits for a's prefill, then joins with a's last chunk's leftover budget
    ("c", tuple(range(10, 40)), 12, 4),  # 29 tokens to feed: ten steps while a and b decode (a leaves)
    ("d", (20, 21, 22, 20, 21), 17, 5),  # waits: one prompt is prefilled at a time
    ("e", (7, 3, 88, 41, 9, 12, 30, 31, 32, 7, 3, 88), 10, 6),
    ("f", (5,), 9, 8),  # one token: nothing to prefill
]


@pytest.mark.parametrize(
    "kind,k,adaptive",
    [("plain", 0, False), ("ngram", 3, False), ("noisy copy", 4, False), ("noisy copy", 5, True), ("self", 3, False),
     ("other seed", 2, True)],
)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("itl_factor", [None, 2.0], ids=["own chunks", "riding"])
def test_chunked_prefill_keeps_the_batch_decoding_and_outputs_exact(itl_factor, dtype_name, kind, k, adaptive):
    """prefill_chunk = 3: a joining prompt is fed at most 3 tokens per step (all joining prompts together),
    while the running sequences take their step in every step; a sequence that leaves while one is being
    prefilled moves the prefilled rows along. Every output is still its own unbatched plain greedy output.
    Prompts are fed in chunks of their own, or ride in the running sequences' pass while some run."""
    proposer = None if kind == "plain" else make_proposer(dtype_name, kind, max_batch_size=3)
    engine = Engine(target(dtype_name), FakeTokenizer(), proposer, num_speculative_tokens=k, adaptive=adaptive,
                    max_model_len=MAX_LEN, max_batch_size=3, prefill_chunk=3, prefill_itl_factor=itl_factor)
    if itl_factor is not None:  # riding 2 tokens a step whatever the steps' times: c's prefill spans b's end
        engine.chunk_budget.tokens = lambda batch_size: 2
    prompts = {rid: prompt for rid, prompt, _, _ in CHUNKED_REQUESTS}
    joined: set[str] = set()
    seen = dict(fed=0, steps_decoding_while_prefilling=0, prefilling_row_moves=0, prefilling=None, row=-1)

    def on_step(outputs):
        running_before = seen.pop("running_before", set())
        joined.update(out.request_id for out in outputs)  # a sequence decodes in the step it joins,
        joined.update(s.request_id for s in engine.running)  # or (its last rows rode in the pass) from the next
        prefilling = engine.prefilling
        fed = sum(len(prompts[r]) - 1 for r in joined)
        if prefilling is not None:
            fed += engine.cache.lengths[prefilling.row]
            assert engine.cache.lengths[prefilling.row] < len(prefilling.prompt_ids) - 1
            assert prefilling.row == len(engine.running)  # the row after the running ones
            if prefilling.request_id == seen["prefilling"]:  # it was being prefilled during this step
                seen["steps_decoding_while_prefilling"] += bool(running_before)
                seen["prefilling_row_moves"] += prefilling.row < seen["row"]
        assert 0 <= fed - seen["fed"] <= 3  # the prefill budget of one step
        # no stall: every sequence running at the start of the step gained tokens in it
        assert running_before <= {out.request_id for out in outputs if out.new_token_ids}
        assert all(len(out.new_token_ids) > 0 for out in outputs if out.request_id in joined)
        seen.update(fed=fed, prefilling=prefilling and prefilling.request_id, row=prefilling.row if prefilling else -1,
                    running_before={s.request_id for s in engine.running})

    requests = [(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for rid, prompt, n, _ in CHUNKED_REQUESTS]
    finals = run(engine, requests, join_at=[at for *_, at in CHUNKED_REQUESTS], on_step=on_step)
    for rid, prompt, n, _ in CHUNKED_REQUESTS:
        assert tuple(finals[rid].token_ids) == plain(dtype_name, prompt, 40)[:n], f"request {rid}"
        assert_metrics_consistent(finals[rid])
    assert seen["fed"] == sum(len(p) - 1 for p in prompts.values())
    assert seen["steps_decoding_while_prefilling"] >= 5  # c's prefill alone spans ten steps
    assert seen["prefilling_row_moves"] >= 1  # a sequence left while c was being prefilled
    assert all(length == 0 for length in engine.cache.lengths)


def test_abort_while_prefilling():
    """prefill_chunk 3, draft model: aborting a running sequence while a long prompt is being prefilled moves
    that prompt's row along; aborting the sequence being prefilled frees its row; the others stay exact."""
    engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "noisy copy", 2), num_speculative_tokens=3,
                    max_model_len=MAX_LEN, max_batch_size=2, prefill_chunk=3)
    long1, long2 = tuple(range(10, 40)), tuple(range(40, 70))
    engine.add_request("x", list(PROMPTS[1]), GREEDY)  # 6 tokens to feed: steps 1 and 2, then it decodes
    engine.add_request("long1", list(long1), GREEDY)  # 29 tokens to feed, from step 3
    engine.add_request("long2", list(long2), GREEDY)
    outputs = {}

    def step():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    for _ in range(4):
        step()
    assert [s.request_id for s in engine.running] == ["x"] and len(outputs["x"]) == 3
    assert engine.prefilling.request_id == "long1" and engine.prefilling.row == 1 and engine.cache.lengths[1] == 6
    engine.abort_request("x")
    step()  # x leaves row 0: long1, 6 tokens prefilled, moves there and is fed 3 more
    assert outputs["x"][-1].finish_reason == "abort" and engine.running == []
    assert tuple(outputs["x"][-1].token_ids) == plain("fp32", PROMPTS[1])[:len(outputs["x"][-1].token_ids)]
    assert engine.prefilling.request_id == "long1" and engine.prefilling.row == 0 and engine.cache.lengths[0] == 9
    assert engine.cache.lengths[1] == 0
    while engine.prefilling.request_id == "long1":
        step()
    assert [s.request_id for s in engine.running] == ["long1"] and engine.prefilling.request_id == "long2"
    step()
    engine.abort_request("long2")
    step()
    (aborted,) = outputs["long2"]
    assert aborted.finished and aborted.finish_reason == "abort" and aborted.token_ids == []
    assert engine.prefilling is None and engine.cache.lengths[1] == 0
    engine.add_request("z", list(PROMPTS[2]), GREEDY)
    while engine.has_unfinished_requests():
        step()
    assert tuple(outputs["long1"][-1].token_ids) == plain("fp32", long1)
    assert tuple(outputs["z"][-1].token_ids) == plain("fp32", PROMPTS[2])
    assert engine.metrics.prompt_tokens == len(PROMPTS[1]) + len(long1) + len(long2) + len(PROMPTS[2])


def test_prefill_time_sums_the_chunks():
    """A clock that ticks once per reading: each chunk's prefill time is one tick, so a 10-token prompt fed
    3 tokens at a time (9 tokens: 3 chunks) takes 3 ticks, in the request's metrics and the cumulative ones."""
    engine = Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, prefill_chunk=3, clock=step_clock())
    out = generate(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert out.metrics.prefill_time == 3.0 and engine.metrics.prefill_time == 3.0
    assert tuple(out.token_ids) == plain("fp32", PROMPTS[0])[:5]


def widths_fed(model):
    """Wrap `model.forward` to record the number of tokens of each call; returns the list (and the original)."""
    fed, original = [], model.forward

    def counting(tokens, *args, **kwargs):
        fed.append(tokens.shape[1])
        return original(tokens, *args, **kwargs)

    model.forward = counting
    return fed, original


def test_the_draft_reads_the_prompt_at_prefill_while_speculating():
    """With speculation on, the engine feeds the draft model each prompt chunk it feeds the target (so the
    draft sees the whole prompt, not a short window, and a join does not stall the next draft step);
    counted as draft time. A prompt longer than the draft's window gives drafts made with its whole context:
    the target drafting for itself (window 4) then agrees on every token."""
    prompt = tuple(range(30, 60))
    drafter = varied_model(seed=0, dtype=torch.float32)  # the target's weights, another module
    fed, original = widths_fed(drafter)
    try:
        engine = Engine(target("fp32"), FakeTokenizer(), DraftModelProposer(drafter, 1, MAX_LEN, prefill_chunk=8,
                        window=4), num_speculative_tokens=3, max_model_len=MAX_LEN, prefill_chunk=12)
        out = generate(engine, prompt, GREEDY)
    finally:
        drafter.forward = original
    assert fed[:6] == [8, 4, 8, 4, 5, 1]  # chunks of 12, 12, 5 prompt tokens (draft chunks of 8), then drafting
    assert tuple(out.token_ids) == plain("fp32", prompt)
    assert out.metrics.num_accepted_tokens == out.metrics.num_draft_tokens > 0
    assert out.metrics.draft_time > 0


def test_the_draft_skips_prompts_joining_while_speculation_is_off():
    """An adaptive engine whose draft never agrees stops speculating; a prompt joining then is not fed to
    the draft (a probe restarts on a short window instead), and the output stays exact. Before anything is
    measured the draft reads the prompt: its first steps measure it with its whole context."""
    degraded = PermutedLogitsModel(varied_model(seed=0, dtype=torch.float32), seed=1)
    engine = Engine(target("fp32"), FakeTokenizer(), DraftModelProposer(degraded, 1, MAX_LEN, window=4),
                    num_speculative_tokens=4, adaptive=True, max_model_len=MAX_LEN)
    controller = engine.controller
    reads = lambda: controller.draft_reads_prompt([], 1, 29, GREEDY.max_tokens)  # noqa: E731  (a 30-token prompt)
    assert reads()  # nothing measured: the draft reads it, and its first steps measure it
    controller.costs.record_draft(1, 0.01)
    controller.costs.record_verify(1, 1.0)
    controller.costs.record_verify(2, 1.0)
    assert reads()  # at the prior acceptance of a draft with its prompt (0.9), a cheap draft pays
    controller.costs.record_prefill("draft", 10, 100.0)  # but not if reading takes longer than 40 tokens save
    assert not reads()
    controller.costs = CostModel()
    generate(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert controller.with_prompt is not None and controller.with_prompt.rate < 0.5  # it read it, and disagreed
    assert not reads()
    prompt = tuple(range(30, 60))
    fed, original = widths_fed(degraded.inner)
    try:
        out = generate(engine, prompt, GREEDY)
    finally:
        degraded.inner.forward = original
    assert max(fed, default=0) <= 4 + 1  # never the 29-token prompt: at most a window (+ the last token)
    assert tuple(out.token_ids) == plain("fp32", prompt)


def test_prefill_chunk_must_be_positive():
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, prefill_chunk=0)


def test_num_queued_counts_the_requests_behind_a_full_batch():
    """What the server's --max-waiting-requests bounds: waiting requests that no free row awaits."""
    engine = Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, max_batch_size=2)
    for rid in "abc":
        engine.add_request(rid, [1, 2, 3], GREEDY)
    assert len(engine.waiting) == 3 and engine.num_queued() == 1  # two of them take the free rows next step
    engine.step()
    assert len(engine.running) == 2 and engine.num_queued() == 1
    engine.abort_request("a")
    engine.step()
    assert len(engine.running) == 2 and engine.num_queued() == 0


# ------------------------------------------------------------------------------------------- seeded sampling
SAMPLING = dict(temperature=0.9, top_k=40, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("kind,k", [("plain", 0), ("ngram", 3), ("noisy copy", 4), ("other seed", 2)])
def test_seeded_sampling_is_reproducible(kind, k):
    def sampled(seed: int) -> list[int]:
        proposer = None if kind == "plain" else make_proposer("fp32", kind)
        engine = Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=k, max_model_len=MAX_LEN)
        return generate(engine, PROMPTS[0], SamplingParams(seed=seed, **SAMPLING)).token_ids

    first = sampled(123)
    assert sampled(123) == first
    # 30 tokens at temperature 0.9 from a 97-token vocabulary: two seeds agreeing on all of them is
    # vanishingly unlikely (and the seeds are fixed)
    others = [sampled(s) for s in (124, 7)]
    assert all(o != first for o in others) and others[0] != others[1]
    assert first != list(plain("fp32", PROMPTS[0]))[:30]  # it did sample


def test_seeded_sampling_does_not_depend_on_the_batch():
    """Each sequence has its own generator, and the target's logits are the same bits batched or not:
    with prompt lookup (which draws nothing), a seeded request samples the same tokens alone or in a batch."""
    params = [SamplingParams(seed=s, **SAMPLING) for s in (1, 2, 3)]
    alone = [
        generate(Engine(target("bf16"), FakeTokenizer(), NgramProposer(), num_speculative_tokens=3,
                        max_model_len=MAX_LEN), prompt,
                 p).token_ids
        for prompt, p in zip(PROMPTS, params)
    ]
    engine = Engine(target("bf16"), FakeTokenizer(), NgramProposer(), num_speculative_tokens=3, max_model_len=MAX_LEN,
                    max_batch_size=3)
    finals = run(engine, [(str(i), prompt, p) for i, (prompt, p) in enumerate(zip(PROMPTS, params))], join_at=[0, 1, 4])
    assert [finals[str(i)].token_ids for i in range(3)] == alone
