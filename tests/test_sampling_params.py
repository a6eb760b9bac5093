"""vLLM's sampling parameters under speculation: penalties, logit_bias, min_p, min_tokens, stop_token_ids,
logprobs and prompt logprobs, n / best_of.

Greedy: every parameter, every proposer (chains and trees), fixed and adaptive K: the output is token for
token plain decoding's with the same parameters, and plain decoding itself matches a naive reference that
re-runs the whole sequence each step and applies the parameters one token at a time. Logprobs are the same
with and without speculation. Sampling: the distribution of emitted tokens, through the engine with a draft
model, is the processed target distribution (penalties counting the drafted tokens before each position),
checked with the tolerance of `test_sampling_distribution`, and a sampler that forgets drafted history fails
the same check.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_model
from fakes import FakeTokenizer, ScriptedProposer, noisy_copy, one_intra_op_thread
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.fan_out import fan_out, pick_best, sub_requests
from specdec.models.gguf_file import GGUFFile
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import process_logits, process_rows
from specdec.speculative.draft_model import DraftModelProposer
from test_engine_tiny import MAX_LEN, PROMPTS, STOP_PROMPT, continuation, oracle, run, target  # noqa: F401
from test_engine_tiny import make_proposer
from test_sampling_distribution import assert_follows
from test_tokenizer import write_tiny_gguf

_one_thread = pytest.fixture(scope="module", autouse=True)(one_intra_op_thread)

PARAMS = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "all penalties": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.5),
    "logit_bias": dict(logit_bias={5: 4.0, 17: 3.5, 60: -100.0}),
    "min_tokens": dict(min_tokens=12, ignore_eos=False),
    "stop_token_ids": dict(stop_token_ids=[91, 74]),
}
EOS = 96


def params(name: str, max_tokens: int = 30, **extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **PARAMS[name], **extra})


def plain(prompt, p: SamplingParams):
    return run(Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN), [("r", prompt, p)])["r"]


def full_logits(seq: list[int]) -> torch.Tensor:
    """[len(seq), V] the target's logits at every position, from one forward over a fresh cache."""
    model = target("fp32")
    with torch.inference_mode():
        return model(torch.tensor([seq]), torch.arange(len(seq))[None], model.new_cache(1, len(seq)))[0]


def naive_greedy(prompt, p: SamplingParams) -> list[int]:
    """The reference: a full forward over the whole sequence per token, parameters applied token by token."""
    out = []
    for _ in range(p.max_tokens):
        seq = list(prompt) + out
        logits = full_logits(seq)[-1].double()
        for token, bias in p.logit_bias:
            logits[token] += bias
        if len(out) < p.min_tokens:
            for token in set(p.stop_token_ids) | ({EOS} if not p.ignore_eos else set()):
                logits[token] = -math.inf
        for token in set(seq):
            if p.repetition_penalty != 1 and (token in prompt or token in out):
                x = logits[token]
                logits[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(out):
            logits[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
        token = int(logits.argmax())
        out.append(token)
        if token in p.stop_token_ids or (token == EOS and not p.ignore_eos):
            break
    return out


@pytest.mark.parametrize("name", list(PARAMS))
def test_plain_decoding_applies_each_parameter_as_the_naive_reference(name):
    p = params(name)
    for prompt in PROMPTS:
        out = plain(prompt, p)
        assert out.token_ids == naive_greedy(prompt, p), (name, prompt)
    # not vacuous: the parameter changes the output of at least one prompt
    neutral = SamplingParams(temperature=0, max_tokens=30, ignore_eos=p.ignore_eos)
    assert any(plain(prompt, p).token_ids != plain(prompt, neutral).token_ids for prompt in PROMPTS), name


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("kind,k", [("ngram", 3), ("noisy copy", 1), ("noisy copy", 5), ("other seed", 3)])
@pytest.mark.parametrize("name", list(PARAMS))
def test_greedy_speculation_with_each_parameter_equals_plain(name, kind, k, adaptive):
    p = params(name)
    for prompt in PROMPTS:
        engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", kind), num_speculative_tokens=k,
                        adaptive=adaptive, max_model_len=MAX_LEN)
        out = run(engine, [("r", prompt, p)])["r"]
        expected = plain(prompt, p)
        assert (out.token_ids, out.finish_reason, out.stop_reason) == \
            (expected.token_ids, expected.finish_reason, expected.stop_reason), (name, kind, prompt)


def test_penalties_count_the_drafted_tokens_before_each_position(continuation):
    """An oracle draft (the output of plain decoding with the penalty) is accepted whole only if every
    position of the pass sees the drafted tokens before it: K = 8, one pass emits 9 tokens."""
    p = params("frequency", max_tokens=9)
    expected = plain(STOP_PROMPT, p).token_ids
    engine = Engine(target("fp32"), FakeTokenizer(), oracle(expected), num_speculative_tokens=8, max_model_len=MAX_LEN)
    out = run(engine, [("r", STOP_PROMPT, p)])["r"]
    assert out.token_ids == expected
    assert out.metrics.target_passes == 1 and out.metrics.num_accepted_tokens == 8


def test_each_row_of_a_pass_sees_the_drafted_tokens_on_its_own_path():
    from specdec.engine.verification import drafted_paths
    from specdec.speculative.proposers import Draft

    assert drafted_paths(Draft([5, 7])) == [[], [5], [5, 7]]
    # a tree: nodes 0 and 1 are the root's children, node 2 is node 0's child, node 3 node 2's
    tree = Draft([5, 7, 9, 4], parents=[-1, -1, 0, 2])
    assert drafted_paths(tree) == [[], [5], [7], [5, 9], [5, 9, 4]]


def test_a_stop_token_inside_an_accepted_draft_ends_the_output_there(continuation):
    stop = continuation[3]
    p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    engine = Engine(target("fp32"), FakeTokenizer(), oracle(continuation), num_speculative_tokens=6,
                    max_model_len=MAX_LEN)
    out = run(engine, [("r", STOP_PROMPT, p)])["r"]
    assert out.token_ids == continuation[:4] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text.endswith(FakeTokenizer().decode([stop]))  # kept in the output, as vLLM does


def test_min_tokens_holds_eos_back_inside_a_draft(continuation):
    """The target's greedy token 2 is EOS: with min_tokens 5 it is masked, and the draft carrying it there
    is rejected at that position."""
    eos = continuation[2]
    tok = FakeTokenizer(eos_token_ids=(eos,))
    p = SamplingParams(temperature=0, max_tokens=20, min_tokens=5)
    expected = run(Engine(target("fp32"), tok, max_model_len=MAX_LEN), [("r", STOP_PROMPT, p)])["r"]
    assert len(expected.token_ids) >= 5 and eos not in expected.token_ids[:5]
    out = run(Engine(target("fp32"), tok, oracle(continuation), num_speculative_tokens=5,
                     max_model_len=MAX_LEN), [("r", STOP_PROMPT, p)])["r"]
    assert out.token_ids == expected.token_ids
    assert out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens  # the drafted EOS was refused


# ------------------------------------------------------------------------------------------------ logprobs
def teacher_forced_logprobs(prompt, tokens, p: SamplingParams) -> torch.Tensor:
    """[len(tokens), V] log-probabilities of plain decoding's processed distribution at each output position,
    from one full forward over prompt + tokens."""
    logits = full_logits(list(prompt) + list(tokens))[len(prompt) - 1:-1]
    rows = process_rows(logits, p, list(prompt), [], [list(tokens[:i]) for i in range(len(tokens))],
                        frozenset(p.stop_token_ids) | ({EOS} if not p.ignore_eos else frozenset()))
    return torch.log_softmax(rows, -1) if p.greedy else torch.log(process_logits(rows, p))


def assert_same_logprobs(got, want) -> None:
    """The same entries; values equal to 1e-5, not bit for bit: these float models' rows differ in the last
    bits between passes of different widths (the block kernels are row-invariant: test_exactness checks the
    real model's logprobs bit for bit)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


@pytest.mark.parametrize("kind,k", [("plain", 0), ("ngram", 3), ("noisy copy", 4)])
def test_greedy_logprobs_are_identical_with_and_without_speculation(kind, k):
    p = params("all penalties", logprobs=3)
    ref = plain(PROMPTS[0], p)
    engine = Engine(target("fp32"), FakeTokenizer(), None if kind == "plain" else make_proposer("fp32", kind),
                    num_speculative_tokens=k, max_model_len=MAX_LEN)
    out = run(engine, [("r", PROMPTS[0], p)])["r"]
    assert out.token_ids == ref.token_ids
    assert_same_logprobs(out.logprobs, ref.logprobs)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    expected = teacher_forced_logprobs(PROMPTS[0], out.token_ids, p)
    for i, entry in enumerate(out.logprobs):
        assert entry.logprob == pytest.approx(float(expected[i, entry.token_id]), abs=1e-4)
        assert entry.rank == 1  # greedy picks the most likely token
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id
        assert [t for t, _ in entry.top] == expected[i].topk(3).indices.tolist()
    assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs), abs=1e-5)


def test_sampled_logprobs_are_those_of_the_processed_distribution_at_each_position():
    p = SamplingParams(temperature=0.8, top_k=20, min_p=0.02, frequency_penalty=1.0, max_tokens=24, seed=3,
                       ignore_eos=True, logprobs=2)
    engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "noisy copy"), num_speculative_tokens=4,
                    max_model_len=MAX_LEN)
    out = run(engine, [("r", PROMPTS[1], p)])["r"]
    assert out.metrics.num_accepted_tokens > 0
    expected = teacher_forced_logprobs(PROMPTS[1], out.token_ids, p)
    for i, entry in enumerate(out.logprobs):
        assert entry.logprob == pytest.approx(float(expected[i, entry.token_id]), abs=1e-4)
        assert entry.logprob > -math.inf  # a token the processing excludes is never emitted


def test_prompt_logprobs_do_not_depend_on_the_prefill_chunk():
    prompt = list(PROMPTS[0]) * 3
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    outs = [run(Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN, prefill_chunk=chunk),
                [("r", prompt, p)])["r"] for chunk in (4, 7, 512)]
    assert_same_logprobs(outs[0].prompt_logprobs, outs[1].prompt_logprobs)
    assert_same_logprobs(outs[0].prompt_logprobs, outs[2].prompt_logprobs)
    entries = outs[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    expected = torch.log_softmax(full_logits(prompt).float(), -1)
    for i in range(1, len(prompt)):
        assert entries[i].token_id == prompt[i]
        assert entries[i].logprob == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-4)


# ------------------------------------------------------------------------------------------------ n, best_of
def test_n_sequences_are_seeded_apart_and_best_of_keeps_the_likeliest():
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=11, n=2, best_of=4, ignore_eos=True)
    children = fan_out(p)
    assert [c.seed for c in children] == [11, 12, 13, 14]
    assert [c.seed for c in fan_out(SamplingParams(seed=2**64 - 2, n=3))] == [2**64 - 2, 2**64 - 1, 0]
    engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "noisy copy", max_batch_size=4),
                    num_speculative_tokens=3, max_model_len=MAX_LEN, max_batch_size=4)
    finals = run(engine, [(f"s{i}", PROMPTS[2], c) for i, c in enumerate(children)])
    outs = [finals[f"s{i}"] for i in range(4)]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # seeded apart
    for o, c in zip(outs, children):  # each child is its own seeded plain sample
        alone = run(Engine(target("fp32"), FakeTokenizer(), max_model_len=MAX_LEN), [("r", PROMPTS[2], c)])["r"]
        assert o.cumulative_logprob == pytest.approx(
            float(teacher_forced_logprobs(PROMPTS[2], o.token_ids, c).gather(
                1, torch.tensor(o.token_ids)[:, None]).sum()), abs=1e-4)
        assert alone.cumulative_logprob is not None
    best = pick_best(list(outs), p)
    ranked = sorted(outs, key=lambda o: -o.cumulative_logprob)
    assert [b.token_ids for b in best] == [r.token_ids for r in ranked[:2]] and [b.index for b in best] == [0, 1]



def test_sub_requests_plan_each_prompts_sequences_for_the_api_and_the_server():
    """One plan for LLM and the server: best_of sequences per prompt, seeded apart, named by (prompt, sequence)."""
    plan = sub_requests([[1, 2], [3]], SamplingParams(seed=5, n=2, best_of=3), lambda i, j: f"r-{i}-{j}")
    assert [[(s.prompt_index, s.request_id, s.prompt_ids, s.params.seed) for s in group] for group in plan] == [
        [(0, "r-0-0", [1, 2], 5), (0, "r-0-1", [1, 2], 6), (0, "r-0-2", [1, 2], 7)],
        [(1, "r-1-0", [3], 5), (1, "r-1-1", [3], 6), (1, "r-1-2", [3], 7)]]
    assert [len(group) for group in sub_requests([[1]], SamplingParams(n=4), lambda i, j: f"{j}")] == [4]

# ------------------------------------------------------------------------------------------------ distribution
SAMPLED = SamplingParams(temperature=0.7, min_p=0.05, frequency_penalty=2.0, presence_penalty=0.5,
                         repetition_penalty=1.2, logit_bias={3: 1.5, 40: 2.0}, max_tokens=3, ignore_eos=True)
DIST_PROMPT = (9, 9, 3, 40, 9)
RUNS = 4000


def sampled_pairs(broken: bool = False) -> torch.Tensor:
    """[RUNS, 2] the first two tokens of RUNS seeded requests through the engine, the target drafting for
    itself without the penalties and bias (so its drafts are often but not always accepted), K = 2: the
    second token comes from position 1 of a pass whenever the first was an accepted drafted token."""
    import specdec.engine.verification as engine_module

    original = engine_module.process_rows
    if broken:  # a sampler that forgets the drafted tokens before each position
        engine_module.process_rows = lambda logits, p, prompt, out, drafted, stop: original(
            logits, p, prompt, out, [[] for _ in drafted], stop)
    try:
        engine = Engine(target("fp32"), FakeTokenizer(), make_proposer("fp32", "self", max_batch_size=16),
                        num_speculative_tokens=2, max_model_len=MAX_LEN, max_batch_size=16)
        requests = [(str(i), DIST_PROMPT, SamplingParams(**{**SAMPLED.__dict__, "seed": 1000 + i}))
                    for i in range(RUNS)]
        finals = run(engine, requests)
    finally:
        engine_module.process_rows = original
    assert engine.metrics.num_accepted_tokens > RUNS // 4  # many second tokens came from drafted positions
    return torch.tensor([finals[str(i)].token_ids[:2] for i in range(RUNS)])


def exact_probs(history: list[int]) -> torch.Tensor:
    logits = full_logits(list(DIST_PROMPT) + history)[-1:]
    return process_logits(process_rows(logits, SAMPLED, list(DIST_PROMPT), history, [[]], frozenset()), SAMPLED)[0]


def check_pairs(pairs: torch.Tensor) -> None:
    assert_follows(pairs[:, 0], exact_probs([]), "first token")
    firsts = torch.bincount(pairs[:, 0]).topk(2).indices.tolist()  # the two commonest first tokens
    for first in firsts:
        seconds = pairs[pairs[:, 0] == first, 1]
        assert len(seconds) >= 300
        assert_follows(seconds, exact_probs([first]), f"second token after {first}")


def test_sampling_with_penalties_min_p_and_logit_bias_follows_the_processed_distribution():
    check_pairs(sampled_pairs())


def test_the_distribution_check_catches_a_sampler_that_forgets_drafted_history():
    with pytest.raises(AssertionError, match="second token after"):
        check_pairs(sampled_pairs(broken=True))


# ------------------------------------------------------------------------------------------------ grammars
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """The tiny byte-level tokenizer (264 tokens) and random models of its vocabulary: a target and a
    noisy copy as draft."""
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny_gguf(path)
    tokenizer = Tokenizer.from_gguf(GGUFFile(path))
    model = tiny_model("qwen2", 2, torch.float32, vocab_size=tokenizer.vocab_size)
    with torch.no_grad():
        for w in model.parameters():
            if w.dim() > 1:
                w.mul_(3.0)
    return tokenizer, model, noisy_copy(model, std=0.3)


def scripted_with_errors(continuation: list[int], vocab: int):
    """Drafts the given continuation with every third token wrong (a token id the grammar mostly forbids)."""
    def script(seq):
        n = seq.num_output
        return [(t + 7) % vocab if (n + i) % 3 == 2 else t for i, t in enumerate(continuation[n:])]
    return ScriptedProposer(script)


@pytest.mark.parametrize("response_format", [{"type": "json_object"},
                                             {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}])
def test_constrained_greedy_output_is_plain_constrained_decoding_under_speculation(byte_level, response_format):
    """Drafts right two tokens in three: each pass's rows after accepted drafted tokens are masked in the
    grammar state those tokens lead to, and a wrong token is refused where it stands. Output: plain
    constrained decoding's, token for token, for every K."""
    tokenizer, model, _ = byte_level
    prompt = tokenizer.encode("Answer in JSON: the answer is")
    p = SamplingParams(temperature=0, max_tokens=80, response_format=response_format)
    plain_out = run(Engine(model, tokenizer, max_model_len=MAX_LEN), [("r", prompt, p)])["r"]
    assert plain_out.finish_reason == "stop", plain_out.text  # the grammar completed, then EOS
    value = json.loads(plain_out.text)
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
        assert 0 <= value["n"] <= 999 and value["tag"] in ("red", "green", "blue")
    for k in (1, 4, 8):
        proposer = scripted_with_errors(plain_out.token_ids, tokenizer.vocab_size)
        out = run(Engine(model, tokenizer, proposer, num_speculative_tokens=k,
                         max_model_len=MAX_LEN), [("r", prompt, p)])["r"]
        assert out.token_ids == plain_out.token_ids, k
        assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


def test_a_draft_model_drafts_under_the_grammar_too(byte_level):
    """The draft model masks its own logits in the grammar state of its drafted path: without that it almost
    never agreed with the constrained target (0-1 of ~240 drafted tokens); with it, 30 of 124 here."""
    tokenizer, model, draft_model = byte_level
    prompt = tokenizer.encode("Answer in JSON: the answer is")
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    p = SamplingParams(temperature=0, max_tokens=80, response_format=rf)
    plain_out = run(Engine(model, tokenizer, max_model_len=MAX_LEN), [("r", prompt, p)])["r"]
    out = run(Engine(model, tokenizer, DraftModelProposer(draft_model, 1, MAX_LEN), num_speculative_tokens=4,
                     max_model_len=MAX_LEN),
              [("r", prompt, p)])["r"]
    assert out.token_ids == plain_out.token_ids
    assert out.metrics.num_accepted_tokens >= 10, out.metrics


def test_constrained_sampling_with_a_draft_model_stays_in_the_schema(byte_level):
    tokenizer, model, draft_model = byte_level
    prompt = tokenizer.encode("Answer in JSON: the answer is")
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    accepted = 0
    for seed in range(3):
        p = SamplingParams(temperature=0.9, seed=seed, max_tokens=100, response_format=rf)
        out = run(Engine(model, tokenizer, DraftModelProposer(draft_model, 1, MAX_LEN), num_speculative_tokens=4,
                         max_model_len=MAX_LEN),
                  [("r", prompt, p)])["r"]
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"ok", "n", "tag"}, out.text
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0


def test_a_bad_response_format_is_refused_when_the_request_is_added(byte_level):
    tokenizer, model, _ = byte_level
    engine = Engine(model, tokenizer, max_model_len=MAX_LEN)
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}):
        with pytest.raises(ValueError):
            engine.add_request("r", [1, 2, 3], SamplingParams(response_format=bad))
    assert not engine.has_unfinished_requests()
