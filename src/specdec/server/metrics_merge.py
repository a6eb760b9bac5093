"""The Prometheus metrics of several replicas as one server's: every sample summed over the replicas.

Counters, histograms (buckets, sums, counts) and the running-requests gauge all add up across replicas;
a `_created` sample (a counter's start time) takes the earliest. Parsed and written with prometheus_client.

Example: replica 0 has `specdec:prompt_tokens_total{model_name="m"} 10.0` and replica 1 has 5.0: the merge
has `specdec:prompt_tokens_total{model_name="m"} 15.0`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_metrics(texts: list[bytes]) -> bytes:
    """The Prometheus text of the sum of `texts` (each one replica's `ServerMetrics.render()`)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            sums = values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                before = sums.get(key)
                if before is None:
                    sums[key] = s.value
                else:
                    sums[key] = min(before, s.value) if s.name.endswith("_created") else before + s.value
    for name, merged in families.items():
        merged.samples = [Sample(sample, dict(labels), value) for (sample, labels), value in values[name].items()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
