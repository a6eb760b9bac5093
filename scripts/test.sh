#!/usr/bin/env bash
# Set up (venv, packages, default model pair) and run the whole test suite, real-model tests included; the
# 25 slowest tests are listed at the end (the suite should stay under ~20 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"
