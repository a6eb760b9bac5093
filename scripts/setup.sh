#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with specdec and its extras, then the default model
# pair (pulled once into $SPECDEC_HOME, default ~/.cache/specdec). Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
if ! $PY -c "import torch" 2>/dev/null; then
  # An exact pin: on CPU-only machines this is the local CPU build; a loose requirement would pull a
  # multi-GB CUDA build there. Where a CUDA build is wanted, install it into .venv before this script.
  $PY -m pip install -q "torch==2.13.0"
fi
if ! $PY -c "import specdec, fastapi, transformers, openai, pytest, llguidance, matplotlib, ray.serve" 2>/dev/null; then
  $PY -m pip install -q -e ".[dev]"
fi
if [ "${SPECDEC_SKIP_PULL:-0}" != "1" ]; then
  .venv/bin/specdec models pull qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
fi
