#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with specdec and its extras, then the default model
# pair and Gemma 3 270M (the real second family the tests run), pulled once into $SPECDEC_HOME (default
# ~/.cache/specdec). Safe to run again: it skips what is done.
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
# setup.py compiles the native libraries (the kernels once per instruction set, the suffix trie) against this
# torch: no build isolation (an isolated build would fetch a torch of its own), ninja running MAX_JOBS compiles
# at once (default: the CPU count). Rebuilt when a C++ source changed since (`native.missing()`).
if ! $PY -c "import setuptools, ninja; assert int(setuptools.__version__.split('.')[0]) >= 68" 2>/dev/null; then
  $PY -m pip install -q "setuptools>=68" ninja
fi
if ! $PY -c "import specdec, fastapi, transformers, openai, pytest, xdist, llguidance, matplotlib, ray.serve
from specdec.kernels import native
assert not native.missing(), native.missing()" 2>/dev/null; then
  start=$(date +%s)
  $PY -m pip install -q --no-build-isolation -e ".[dev]"
  echo "setup: specdec installed, its native libraries built, in $(( $(date +%s) - start )) s"
fi
if [ "${SPECDEC_SKIP_PULL:-0}" != "1" ]; then
  .venv/bin/specdec models pull qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct gemma-3-270m
fi
