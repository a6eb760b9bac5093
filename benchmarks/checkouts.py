"""Running a benchmark's worker under another checkout's code (`--old-src`): side-by-side measures of a change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_worker(script: str, src: Path, threads: int, *args: str) -> dict:
    """`script --worker *args` in a process importing specdec from `src` with `threads` threads; the JSON of
    its last line of output."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, script, "--worker", *args], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
