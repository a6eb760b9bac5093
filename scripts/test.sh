#!/usr/bin/env bash
# Set up (venv, packages, default model pair) and run the whole test suite, real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
