"""The engine: a batch of sequences stepped through propose -> verify -> accept -> commit -> observe.

One module a concern: `engine` (the `Engine`, the step's outline), `planner` and `plan` (what a step does,
decided before its pass: the `StepPlan`), `sequence` (a running request), `scheduler` (who runs in which
cache row), `prefill` (a joining prompt), `failures` (a failure ends its sequence alone), `cache_pools` (the
caches' rows and pools), `verification` (judging a sequence's draft), `output_text` and
`stop_strings` (a sequence's text and where it stops), `structured` (grammars), `prefix_cache` (prompt blocks
kept across requests), `memory` (what the weights and caches take), `outputs` and `metrics` (what a step
reports). Below it: the models, their K/V cache (`specdec.models.kv_cache`), sampling and the proposers
(`specdec.speculative`); above it: n / best_of (`specdec.fan_out`), the Python API, the server and the CLI.
"""

from specdec.engine.engine import Engine

__all__ = ["Engine"]
