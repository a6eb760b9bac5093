"""A fingerprint of the engine's behaviour on tiny random models, for refactors that must change no bit: per
scenario, a sha256 over every step's streamed outputs (token ids, text, finish), the cache rows after each step
(lengths, pages held, free pages), and each request's final tokens, log-probabilities (as float hex), prompt
log-probabilities and metrics (times included: every engine runs on `step_clock`, which counts readings).

Scenarios: plain decoding batched past max_batch_size with sampled requests asking for log-probabilities;
prompt lookup and a draft model (fixed and adaptive K); Medusa, an EAGLE tree and a dynamic one; prefix-cache hits (a turn
after a turn, salted and not); preemption under a small pool (plain, prompt lookup, draft model, suffix, auto)
with prompts riding in the running rows' passes.

Run on two checkouts and compare (`PYTHONPATH=src python tests/engine_fingerprint.py > a.json`). The hashes
depend on the CPU's arithmetic (torch's kernels) too: `--record` writes them with the machine they were taken on
(tests/data/engine_fingerprint.json), which `tests/test_engine_fingerprint.py` checks on the same kind of machine.
Record again only for a change that is meant to change bits, and say so in its commit.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from fakes import FakeTokenizer, step_clock  # noqa: E402
from specdec.config import SamplingParams  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.speculative.draft_model import DraftModelProposer  # noqa: E402
from specdec.speculative.proposers import NgramProposer  # noqa: E402
from test_engine_tiny import MAX_LEN, draft, target  # noqa: E402
from test_preemption import PROMPTS as POOL_PROMPTS, engine_for  # noqa: E402
from specdec.speculative.head_proposers import EagleProposer  # noqa: E402
from specdec.speculative.tree import DynamicTree  # noqa: E402
from test_prefix_cache import make_engine, random_head  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [tuple((5 * i + 11 * j + 2) % 90 for i in range(10 + 7 * j)) for j in range(4)]
SHARED = tuple((7 * i + 3) % 90 for i in range(37))
# the metrics hashed (`SpecMetrics.to_dict`'s keys when recorded: a metric added later leaves the hashes be)
METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "acceptance_rate",
           "mean_acceptance_length", "tokens_per_pass", "target_passes", "emitted_tokens", "prompt_tokens",
           "cached_tokens", "disk_cached_tokens", "preemptions", "prefill_time_s", "draft_time_s", "target_time_s",
           "total_time_s", "tokens_per_second", "drafters")


def sampled(seed: int, logprobs: bool = False, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, max_tokens=max_tokens, ignore_eos=True, seed=seed,
                          logprobs=3 if logprobs else None, prompt_logprobs=2 if logprobs else None)


def _lp(entries) -> list:
    return [None if e is None else (e.token_id, float(e.logprob).hex(), e.rank,
                                    [(t, float(v).hex()) for t, v in e.top]) for e in entries or []]


def fingerprint(engine: Engine, requests, join_at=None) -> str:
    """Run `requests` ([(id, prompt, params, salt)]) to the end, request i added at step join_at[i]."""
    join_at = join_at or [0] * len(requests)
    h, finals, step = hashlib.sha256(), {}, 0
    while len(finals) < len(requests):
        for (rid, prompt, params, salt), at in zip(requests, join_at):
            if at == step:
                engine.add_request(rid, list(prompt), params, cache_salt=salt)
        outputs = engine.step()
        cache = engine.cache
        h.update(repr(([(o.request_id, o.new_token_ids, o.new_text, o.finish_reason) for o in outputs],
                       cache.lengths, cache.pages, len(cache.free))).encode())
        for o in outputs:
            if o.finished:
                finals[o.request_id] = o
        step += 1
        assert step < 5000
    for rid in sorted(finals):
        o = finals[rid]
        h.update(repr((rid, o.token_ids, o.text, o.finish_reason, _lp(o.logprobs), _lp(o.prompt_logprobs),
                       None if o.cumulative_logprob is None else float(o.cumulative_logprob).hex(),
                       {k: v for k, v in o.metrics.to_dict().items() if k in METRICS}, o.error)).encode())
    fingerprint.seen = {"steps": step, "preemptions": sum(o.metrics.preemptions for o in finals.values()),
                        "cached": sum(o.metrics.cached_tokens for o in finals.values()),
                        "drafted": sum(o.metrics.num_draft_tokens for o in finals.values())}
    return h.hexdigest()


def dynamic_tree_engine(batch: int = 2) -> Engine:
    """EAGLE-2's dynamic tree (top 2, beam 2, 3 deep) on random heads."""
    proposer = EagleProposer(random_head("eagle"), 97, batch, MAX_LEN, DynamicTree(2, 2), max_depth=3)
    return Engine(target("fp32"), FakeTokenizer(), proposer, num_speculative_tokens=3, max_model_len=MAX_LEN,
                  max_batch_size=batch, prefill_chunk=8, clock=step_clock())


def reqs(prompts, params, salts=None):
    return [(f"r{i}", p, params[i % len(params)], None if salts is None else salts[i])
            for i, p in enumerate(prompts)]


def scenarios():
    """(name, a function giving the fingerprint)."""
    tgt = target("fp32")

    def plain():
        e = Engine(tgt, FakeTokenizer(), max_model_len=MAX_LEN, max_batch_size=2, prefill_chunk=6, clock=step_clock())
        return fingerprint(e, reqs(PROMPTS, [GREEDY, sampled(1, True)]), join_at=[0, 0, 2, 5])

    def ngram(adaptive: bool):
        def f():
            e = Engine(tgt, FakeTokenizer(), NgramProposer(max_n=3), num_speculative_tokens=4, adaptive=adaptive,
                       max_model_len=MAX_LEN, max_batch_size=3, prefill_chunk=8, clock=step_clock())
            return fingerprint(e, reqs(PROMPTS, [GREEDY, sampled(2, True)]), join_at=[0, 1, 1, 4])
        return f

    def draft_model(adaptive: bool):
        def f():
            p = DraftModelProposer(draft("fp32", "noisy copy"), 3, MAX_LEN, window=16)
            e = Engine(tgt, FakeTokenizer(), p, num_speculative_tokens=3, adaptive=adaptive, max_model_len=MAX_LEN,
                       max_batch_size=3, prefill_chunk=8, clock=step_clock())
            return fingerprint(e, reqs(PROMPTS, [GREEDY, sampled(3)]), join_at=[0, 0, 3, 3])
        return f

    def heads(kind: str):
        def f():
            e = dynamic_tree_engine() if kind == "eagle dynamic tree" else \
                make_engine(kind, chunk=8, batch=2, clock=step_clock())
            return fingerprint(e, reqs(PROMPTS[:3], [GREEDY, sampled(4)]), join_at=[0, 2, 2])
        return f

    def prefix(kind: str):
        def f():  # the same prefix again, a later turn of it, and a salted tenant's
            e = make_engine(kind, chunk=8, blocks=16, batch=2, clock=step_clock())
            turn = SHARED + (4, 5, 6, 7, 8, 9, 10, 11, 12)
            prompts = [SHARED, SHARED, turn, SHARED + (1,), turn]
            return fingerprint(e, reqs(prompts, [GREEDY, sampled(5)], [None, None, None, "t", "t"]),
                               join_at=[0, 30, 31, 60, 90])
        return f

    def pool(kind: str, blocks: int = 0):
        def f():
            e = engine_for(kind, blocks=blocks)
            params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            prompts = [*POOL_PROMPTS, POOL_PROMPTS[1]]  # (the last finds the second's blocks, with a cache)
            return fingerprint(e, reqs(prompts, [params, sampled(6, max_tokens=60)]), join_at=[0, 0, 1, 2, 3])
        return f

    yield "plain batched, sampled with logprobs", plain
    yield "ngram K=4", ngram(False)
    yield "ngram K=4 adaptive", ngram(True)
    yield "draft model K=3", draft_model(False)
    yield "draft model K=3 adaptive", draft_model(True)
    for kind in ("medusa", "eagle tree", "eagle dynamic tree"):
        yield f"{kind}", heads(kind)
    for kind in ("plain", "ngram", "draft model", "eagle"):
        yield f"prefix cache hits, {kind}", prefix(kind)
    for kind in ("plain", "ngram", "draft model", "suffix", "auto"):
        yield f"preemption, riding prompts, {kind}", pool(kind)
    yield "preemption with the prefix cache, ngram", pool("ngram", blocks=24)


REFERENCE = Path(__file__).parent / "data" / "engine_fingerprint.json"


def machine() -> dict:
    """What the hashes depend on besides the code: torch's version and the CPU's kernels."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    return {"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "cpu": cpu}


def run(only=()) -> dict[str, str]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, f in scenarios():
            if only and not any(o in name for o in only):
                continue
            with torch.no_grad():
                out[name] = f()
            print(f"{name}: {out[name][:16]} {fingerprint.seen}", file=sys.stderr)
        return out
    finally:
        torch.set_num_threads(before)


def main() -> None:
    """`--record`: write the reference (`tests/test_engine_fingerprint.py` compares against it); else print the
    hashes of the scenarios named (by substring) or all."""
    args = sys.argv[1:]
    if args == ["--record"]:
        REFERENCE.write_text(json.dumps({"machine": machine(), "hashes": run()}, indent=1) + "\n")
        return
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
