"""Run the methods on the same prompts, taking turns, and summarize each one against plain decoding.

Every method gets its own engine on the one loaded target (`LLM.engine_for`), kept for the whole run (an
adaptive controller learns across requests, as a server's does). Each engine first decodes a few tokens of
the first prompt unmeasured (first calls pay one-time costs); then, prompt by prompt, every method
decodes it in turn, so the machine's drift hits all alike.

Terms: a request's *decode time* is its time less the target's prefill (a draft model reading the prompt
counts: it is a cost of drafting); *decode tokens/s* = emitted tokens / decode time, pooled over the prompts
(`SpecMetrics.tokens_per_second` of the merged metrics); *speedup* = a method's decode tokens/s over plain
decoding's, pooled, with the spread of the same ratio prompt by prompt. Example: plain emits 64 tokens in
8 s (8 tokens/s), a method the same 64 in 5 s (12.8 tokens/s): speedup 1.6.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from specdec.bench.methods import Method
from specdec.bench.prompts import Prompt
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.engine.metrics import SpecMetrics

WARMUP_TOKENS = 4


@dataclass
class MethodRun:
    """What one method did, prompt by prompt."""

    method: Method
    memory_bytes: int  # what its drafting adds: draft weights (or heads) and their cache
    metrics: list[SpecMetrics] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # output token ids


def decode(engine: Engine, prompt_ids: list[int], params: SamplingParams):
    """One request to its end on an idle engine; its final output (metrics included)."""
    engine.add_request("bench", prompt_ids, params)
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pass
    return out


def run_methods(methods: list[Method], engines: list[Engine], prompt_ids: list[list[int]], params: SamplingParams,
                progress: bool = True) -> list[MethodRun]:
    """Each method (on its engine, e.g. `LLM.engine_for(method.spec)`) on each prompt, the methods taking turns
    prompt by prompt; a progress bar on stderr."""
    warmup = dataclasses.replace(params, max_tokens=min(WARMUP_TOKENS, params.max_tokens))
    for engine in engines:
        decode(engine, prompt_ids[0], warmup)
    runs = [MethodRun(m, e.proposer.memory_bytes if e.proposer is not None else 0) for m, e in zip(methods, engines)]
    with tqdm(total=len(prompt_ids) * len(methods), desc="bench", unit="request", disable=not progress) as bar:
        for ids in prompt_ids:
            for run, engine in zip(runs, engines):
                bar.set_postfix_str(run.method.name, refresh=False)
                out = decode(engine, ids, params)
                run.metrics.append(out.metrics)
                run.outputs.append(out.token_ids)
                bar.update()
    for run, engine in zip(runs, engines):  # what grows with use (suffix decoding's tries), once all have run
        run.memory_bytes = max(run.memory_bytes, engine.proposer.memory_bytes if engine.proposer is not None else 0)
    return runs


@dataclass(frozen=True)
class Summary:
    """One method's figures, as the report shows them."""

    name: str
    config_json: str | None  # its --speculative-config (None: plain decoding)
    pooled: SpecMetrics  # over all prompts
    tokens_per_s: float  # decode tokens/s, pooled
    speedup: float  # over plain, pooled
    speedup_per_prompt: list[float]
    tokens_per_pass: float  # emitted / target passes (plain decoding: 1)
    per_position: list[float]  # acceptance rate at each draft position
    time_split: tuple[float, float, float]  # draft, target, other: fractions of the decode time
    memory_bytes: int
    identical: int | None  # greedy: how many outputs equal plain decoding's; None when sampling
    speedup_by_category: dict[str, float]

    @property
    def speedup_quartiles(self) -> tuple[float, float]:
        """25th and 75th percentile of the per-prompt speedups."""
        low, high = np.percentile(self.speedup_per_prompt, [25, 75])
        return float(low), float(high)

    def to_dict(self) -> dict:
        """The figures at full precision (report.md rounds them for reading; rounding here too would make
        the two disagree in the last printed digit)."""
        low, high = self.speedup_quartiles
        return {"method": self.name, "speculative_config": self.config_json,
                "tokens_per_s": self.tokens_per_s, "speedup": self.speedup,
                "speedup_p25": low, "speedup_p75": high, "speedup_per_prompt": list(self.speedup_per_prompt),
                "tokens_per_pass": self.tokens_per_pass, "per_position": list(self.per_position),
                "time_split": dict(zip(("draft", "target", "other"), self.time_split)),
                "memory_bytes": self.memory_bytes, "identical": self.identical,
                "speedup_by_category": dict(self.speedup_by_category),
                "metrics": self.pooled.to_dict()}


def pooled(metrics: list[SpecMetrics]) -> SpecMetrics:
    total = SpecMetrics()
    for m in metrics:
        total.merge(m)
    return total


def summarize(runs: list[MethodRun], prompts: list[Prompt], greedy: bool) -> list[Summary]:
    """One Summary per run; runs[0] is plain decoding, the baseline."""
    base = runs[0]
    base_tps = pooled(base.metrics).tokens_per_second
    categories = sorted({p.category for p in prompts if p.category is not None})
    summaries = []
    for run in runs:
        m = pooled(run.metrics)
        decode_time = m.total_time - m.prefill_time
        by_category = {}
        for c in categories:
            picked = [i for i, p in enumerate(prompts) if p.category == c]
            by_category[c] = pooled([run.metrics[i] for i in picked]).tokens_per_second / \
                pooled([base.metrics[i] for i in picked]).tokens_per_second
        summaries.append(Summary(
            name=run.method.name,
            config_json=run.method.config_json,
            pooled=m,
            tokens_per_s=m.tokens_per_second,
            speedup=m.tokens_per_second / base_tps,
            speedup_per_prompt=[a.tokens_per_second / b.tokens_per_second for a, b in zip(run.metrics, base.metrics)],
            tokens_per_pass=m.tokens_per_pass,
            per_position=m.per_position_acceptance_rate,
            time_split=(m.draft_time / decode_time, m.target_time / decode_time,
                        1 - (m.draft_time + m.target_time) / decode_time),
            memory_bytes=run.memory_bytes,
            identical=sum(a == b for a, b in zip(run.outputs, base.outputs)) if greedy else None,
            speedup_by_category=by_category,
        ))
    return summaries


def recommend(summaries: list[Summary]) -> Summary:
    """The fastest method (pooled speedup) among those whose greedy outputs all equal plain decoding's;
    plain decoding itself when nothing beats it."""
    n = len(summaries[0].speedup_per_prompt)
    exact = [s for s in summaries if s.identical in (None, n)]
    return max(exact, key=lambda s: s.speedup)
