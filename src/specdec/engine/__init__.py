"""The engine: a batch of sequences stepped through propose -> verify -> accept -> commit -> observe.

One module a concern: `engine` (the `Engine`, the step's outline), `sequence` (a running request),
`scheduler` (who runs in which cache row), `verification` (judging a sequence's draft), `output_text` and
`stop_strings` (a sequence's text and where it stops), `structured` (grammars), `prefix_cache` (prompt blocks
kept across requests), `memory` (what the weights and caches take), `outputs` and `metrics` (what a step
reports). Below it: the models, their K/V cache (`specdec.models.kv_cache`), sampling and the proposers
(`specdec.speculative`); above it: n / best_of (`specdec.fan_out`), the Python API, the server and the CLI.
"""

from specdec.engine.engine import Engine

__all__ = ["Engine"]
