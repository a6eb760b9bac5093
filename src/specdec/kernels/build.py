"""Compiling a kernel source into a library of torch ops, once per machine (torch's extension cache)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def build_ops(name: str, source: Path, flags: list[str]) -> None:
    """Compile `source` with `flags` (and OpenMP) and load it: its TORCH_LIBRARY registers its ops. The
    build is cached under a name holding a hash of the source and flags, so an edit rebuilds."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    cpp_extension.load(name=f"{name}_{digest}", sources=[str(source)], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
