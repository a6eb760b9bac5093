"""Settings of the kernels measured once per machine and kept in `$SPECDEC_HOME/tuning.json`, not measured at
every load: today one, which row counts the 512-bit builds give the two-channel kernels (`pair_rows`).

The file maps "<CPU model> / <build>" to the measured values, e.g.
`{"AMD EPYC 9R14 96-Core Processor / avx512vnni": {"pair_rows": 0}}`; delete it to measure again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from specdec.config import specdec_home
from specdec.kernels.native import cpu_model

logger = logging.getLogger(__name__)


def tuning_path() -> Path:
    return specdec_home() / "tuning.json"


def _read() -> dict:
    try:
        return json.loads(tuning_path().read_text())
    except (OSError, ValueError):
        return {}


def _write(key: str, values: dict) -> None:
    """Add `key`'s values to the file (atomically: a concurrent reader sees the old file or the new one)."""
    path = tuning_path()
    data = _read()
    data[key] = values
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: measured again by the next process
        logger.warning("cannot write %s (%s)", path, exc)


def pair_rows(isa: str, lib_ops) -> int:
    """Which row counts (bit r - 1 for r = 1, 2 rows) take the kernels that read two weight channels at a time,
    for the `isa` build of the block kernels here: the tuning file's value, measured on first use (see
    `measure_pair_rows`). `SPECDEC_QGEMM_PAIRS` (0-3) sets it instead."""
    forced = os.environ.get("SPECDEC_QGEMM_PAIRS")
    if forced:
        if forced not in ("0", "1", "2", "3"):
            raise ValueError(f"SPECDEC_QGEMM_PAIRS={forced!r}; choose 0-3 (bit r - 1: r rows read two channels)")
        return int(forced)
    key = f"{cpu_model()} / {isa}"
    known = _read().get(key, {}).get("pair_rows")
    if isinstance(known, int) and 0 <= known <= 3:
        return known
    mask = measure_pair_rows(lib_ops)
    _write(key, {**_read().get(key, {}), "pair_rows": mask})
    logger.info("qgemm: measured pair_rows=%d for %s into %s", mask, key, tuning_path())
    return mask


def measure_pair_rows(lib_ops, trials: int = 5) -> int:
    """Those row counts measured faster with the two-channel kernels than with the one-channel ones (both give
    the same bits), on 42 MB of Q4_K blocks (more than a cache holds, as a decoding step's weights), the two
    taking turns. Leaves the library's setting as it found it."""
    before = lib_ops.pair_rows()
    K, N = 1536, 49152
    w = torch.full((N, K // 256, 144), 0x5A, dtype=torch.uint8)  # the values do not change the time
    w[:, :, 0:4] = torch.tensor([0.01, 0.002], dtype=torch.float16).view(torch.uint8)  # d, dmin of each block
    w = w.reshape(N, -1)
    mask = 0
    for rows in (1, 2):
        x = torch.randn(rows, K)
        best = {}
        for _ in range(trials):
            for pairs in (True, False):
                lib_ops.set_pair_rows(1 << (rows - 1) if pairs else 0)
                t0 = time.perf_counter()
                lib_ops.qmm(x, [w], [12], None)
                best[pairs] = min(best.get(pairs, float("inf")), time.perf_counter() - t0)
        if best[True] < best[False]:
            mask |= 1 << (rows - 1)
    lib_ops.set_pair_rows(before)
    return mask
