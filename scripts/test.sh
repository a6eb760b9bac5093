#!/usr/bin/env bash
# Set up (venv, packages, default model pair) and run the whole test suite, real-model tests included; the
# 25 slowest tests are listed at the end (the suite should stay under ~20 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One test process a core (pytest-xdist; at most 4, as each may hold the real pair), each on one intra-op thread
# so that they do not oversubscribe the cores; idle workers take tests from busy ones (worksteal), so that a long
# module does not finish alone. SPECDEC_TEST_WORKERS=1 runs everything in this process, on every core.
workers=${SPECDEC_TEST_WORKERS:-$(nproc)}
(( workers > 4 )) && workers=4
parallel=()
if (( workers > 1 )); then
  export OMP_NUM_THREADS=1
  parallel=(-n "$workers" --dist worksteal)
fi
exec .venv/bin/python -m pytest -q --durations=25 "${parallel[@]}" "$@"
