"""Prometheus metrics of the server, named as vLLM names them with a `specdec:` prefix.

Speculative decoding (vLLM v1's `vllm:spec_decode_*`, same meanings; see `specdec.engine.metrics`):

    specdec:spec_decode_num_drafts_total                       drafts proposed (one per step that drafted)
    specdec:spec_decode_num_draft_tokens_total                 tokens proposed
    specdec:spec_decode_num_accepted_tokens_total              proposed tokens the target kept
    specdec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
                                                               drafts whose token at position i was kept

From these:  acceptance rate = accepted_tokens / draft_tokens,
             mean acceptance length = 1 + accepted_tokens / drafts   (vLLM's; the bonus token included;
                                                                      `specdec.engine.metrics.mean_acceptance_length`).

Prefix caching (vLLM's names and meanings): `specdec:prefix_cache_queries_total` (prompt tokens looked up) and
`specdec:prefix_cache_hits_total` (those found cached); hit rate = hits / queries. The disk tier:
`specdec:prefix_cache_disk_hits_total` (cached tokens read back from disk), and gauges of its folder's bytes,
the bytes this process wrote and read, and the files it removed for the budget or as damaged.

Requests: `specdec:request_success_total{finished_reason}` (stop, length, abort), `specdec:prompt_tokens_total`,
`specdec:generation_tokens_total`, histograms `specdec:time_to_first_token_seconds`,
`specdec:request_time_per_output_token_seconds` (per request, (e2e - ttft) / (tokens - 1)),
`specdec:e2e_request_latency_seconds`, the gauge `specdec:num_requests_running`,
`specdec:num_preemptions_total` (vLLM's: times a running request stepped out of the batch for want of K/V
pages, counted at its next output), and
`specdec:http_requests_total{method, path, status}` for every HTTP answer, errors included; its labels are
bounded, so that clients cannot grow the registry: a method outside HTTP's standard ones and a path outside
the app's routes count as "other".

Every metric carries `model_name`. Each app gets its own registry, so tests can build several.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.engine.metrics import DrafterCounts
from specdec.engine.outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 1920.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class _Seen(NamedTuple):
    """A request's counters at its previous output: what the next one adds is the difference."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: list[int]
    preemptions: int


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"specdec:{name}", doc, m + list(extra), registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ("position",))
        # auto speculation: the same three counters by drafter (suffix, medusa, eagle, draft_model)
        self.drafter_counters = (
            counter("spec_decode_drafter_num_drafts", "Number of spec decoding drafts, by drafter.", ("drafter",)),
            counter("spec_decode_drafter_num_draft_tokens", "Number of draft tokens, by drafter.", ("drafter",)),
            counter("spec_decode_drafter_num_accepted_tokens", "Number of accepted tokens, by drafter.", ("drafter",)),
        )
        self._seen_drafters: dict[str, dict[str, DrafterCounts]] = {}  # request id -> its drafter counters so far
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prefix_cache_disk_hits = counter("prefix_cache_disk_hits",
                                              "Prefix cache hits read back from the disk tier, in cached tokens.")
        self._disk = None  # the prefix cache's disk tier (`watch_disk`)
        gauge = lambda name, doc: Gauge(f"specdec:{name}", doc, m, registry=r)  # noqa: E731
        self.disk_gauges = {
            "bytes": gauge("prefix_cache_disk_bytes", "Bytes of K/V blocks in the disk tier's folder (all processes')."),
            "written": gauge("prefix_cache_disk_written_bytes", "Bytes this process wrote to the disk tier."),
            "read": gauge("prefix_cache_disk_read_bytes", "Bytes this process read back from the disk tier."),
            "evictions": gauge("prefix_cache_disk_evictions", "Block files this process removed for the budget."),
            "corrupt": gauge("prefix_cache_disk_corrupt", "Block files removed as torn, truncated or changed."),
        }
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.request_success = counter("request_success", "Count of finished requests.", ("finished_reason",))
        self.http_requests = counter("http_requests", "HTTP answers by route and status.", ("method", "path", "status"))
        self.running = Gauge("specdec:num_requests_running", "Requests in the engine (running or queued there).",
                             m, registry=r)
        hist = lambda name, doc, buckets: Histogram(f"specdec:{name}", doc, m, buckets=buckets, registry=r)  # noqa: E731
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Histogram of time per output token (per request mean) in seconds.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                        E2E_BUCKETS)
        self._seen: dict[str, _Seen] = {}  # request id -> its counters at its previous output
        self._lock = threading.Lock()

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """After each engine step (engine thread): add each request's progress since its previous output."""
        name = self.model_name
        with self._lock:
            for out in outputs:
                s = out.metrics
                prev = self._seen.get(out.request_id)
                if prev is None:
                    prev = _Seen(0, 0, 0, [], 0)
                    self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                    self.prefix_cache_queries.labels(name).inc(len(out.prompt_token_ids))
                    self.prefix_cache_hits.labels(name).inc(s.cached_tokens)
                    self.prefix_cache_disk_hits.labels(name).inc(s.disk_cached_tokens)
                self.num_drafts.labels(name).inc(max(0, s.num_drafts - prev.drafts))
                self.num_draft_tokens.labels(name).inc(max(0, s.num_draft_tokens - prev.draft_tokens))
                self.num_accepted_tokens.labels(name).inc(max(0, s.num_accepted_tokens - prev.accepted))
                for pos, n in enumerate(s.accepted_per_position):
                    before = prev.per_position[pos] if pos < len(prev.per_position) else 0
                    if n > before:
                        self.accepted_per_pos.labels(name, str(pos)).inc(n - before)
                self.generation_tokens.labels(name).inc(len(out.new_token_ids))
                self.num_preemptions.labels(name).inc(max(0, s.preemptions - prev.preemptions))
                seen = self._seen_drafters.setdefault(out.request_id, {})
                for drafter, counts in s.drafters.items():
                    before = seen.get(drafter, DrafterCounts())
                    for counter_, n, b in zip(self.drafter_counters, counts, before):
                        if n > b:
                            counter_.labels(name, drafter).inc(n - b)
                    seen[drafter] = counts.copy()
                if out.finished:
                    self._seen.pop(out.request_id, None)
                    self._seen_drafters.pop(out.request_id, None)
                else:
                    self._seen[out.request_id] = _Seen(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                                                       list(s.accepted_per_position), s.preemptions)

    def request_finished(self, finish_reason: str, num_tokens: int, ttft: float | None, e2e: float) -> None:
        name = self.model_name
        self.request_success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(e2e)
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
            if num_tokens > 1:
                self.tpot.labels(name).observe((e2e - ttft) / (num_tokens - 1))

    def http_answer(self, method: str, path: str, status: int) -> None:
        """Count one answer; `path` must already be a route or "other" (the app knows its routes)."""
        method = method if method in HTTP_METHODS else "other"
        self.http_requests.labels(self.model_name, method, path, str(status)).inc()

    def watch_disk(self, disk) -> None:
        """Report the disk tier `disk` (`DiskTier`) in the gauges, read at each scrape."""
        self._disk = disk

    def render(self) -> bytes:
        if self._disk is not None:
            stats, name = self._disk.stats, self.model_name
            for key, value in (("bytes", self._disk.usage()), ("written", stats.bytes_written),
                               ("read", stats.bytes_read), ("evictions", stats.evictions), ("corrupt", stats.corrupt)):
                self.disk_gauges[key].labels(name).set(value)
        return generate_latest(self.registry)
