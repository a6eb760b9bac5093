"""Compiling kernel sources into one library of torch ops, once per machine (torch's extension cache)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def build_ops(name: str, sources: Path | list[Path], flags: list[str], headers: list[Path] = ()) -> None:
    """Compile `sources` (one file or several, linked into one library) with `flags` (and OpenMP) and load
    it: its TORCH_LIBRARY registers its ops. The build is cached under a name holding a hash of the sources,
    the `headers` they include and the flags, so an edit rebuilds."""
    from torch.utils import cpp_extension

    sources = [sources] if isinstance(sources, Path) else list(sources)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*sources, *headers]) + " ".join(flags).encode())
    cpp_extension.load(name=f"{name}_{digest.hexdigest()[:16]}", sources=[str(p) for p in sources],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
