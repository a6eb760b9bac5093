#!/usr/bin/env bash
# Set up (venv, packages, default model pair) and start the OpenAI-compatible server on the default pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specdec serve "$@"
