"""specdec's native libraries: what they are built from, the one CPU-feature probe, and loading them.

Built once at install (`setup.py`: setuptools with torch's `BuildExtension`, every library below, each ISA
build of the block kernels a library of its own) into `specdec/_native/`, with a manifest of the digests of
their sources and flags. At run time `library_path` returns the installed file; no compiler is needed.

A developer's checkout whose C++ differs from what was built (an edited source, or no build at all, as when
running from `PYTHONPATH=src`) builds the library on first use instead, with torch's `cpp_extension` (cached
under torch's extension directory by the digest, so an edit rebuilds): see docs/native-build.md.

This module imports nothing of specdec: `setup.py` loads it by path to read the same descriptions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent.parent  # src/specdec (or site-packages/specdec)
NATIVE_DIR = PACKAGE / "_native"  # the libraries built at install, and their manifest
MANIFEST = "manifest.json"
CSRC = PACKAGE / "kernels" / "csrc"

# -ffp-contract=off: no fused multiply-add other than the ones the source asks for (the same in every build)
KERNEL_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
_VNNI = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
# The builds of the block kernels, fastest first: the compiler's flags of each, and the CPU flags
# (/proc/cpuinfo) it needs to run.
ISA_FLAGS = {
    "avx512amx": _VNNI + ["-mavx512vbmi", "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mavx512bf16", "-DSPECDEC_AMX"],
    "avx512vnni": _VNNI,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
ISA_CPU_FLAGS = {
    "avx512amx": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                            "avx512vbmi", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}),
    "avx512vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}


@dataclass(frozen=True)
class Library:
    """One native library: `name` is its file's (and for torch ops libraries, its `torch.ops.<name>`)."""

    name: str
    sources: tuple[str, ...]  # relative to the package root (src/specdec)
    flags: tuple[str, ...]
    headers: tuple[str, ...] = ()  # what the sources include (part of the digest)
    torch: bool = True  # a library of torch ops (loaded with torch.ops.load_library), else plain C (ctypes)

    def digest(self, root: Path = PACKAGE) -> str | None:
        """sha256 of the sources, headers and flags; None when the sources are not there."""
        h = hashlib.sha256(" ".join(self.flags).encode())
        for rel in sorted(self.sources + self.headers):
            path = root / rel
            if not path.is_file():
                return None
            h.update(rel.encode() + b"\0" + path.read_bytes())
        return h.hexdigest()


OWN_LIBRARIES = ("int8",)  # folders under csrc/ built as libraries of their own, not into the block kernels


def _kernel_files() -> tuple[tuple[str, ...], tuple[str, ...]]:
    files = sorted(p.relative_to(PACKAGE).as_posix() for p in CSRC.rglob("*")
                   if p.suffix in (".cpp", ".h") and p.relative_to(CSRC).parts[0] not in OWN_LIBRARIES)
    return tuple(f for f in files if f.endswith(".cpp")), tuple(f for f in files if f.endswith(".h"))


def qgemm_library(isa: str) -> Library:
    sources, headers = _kernel_files()
    name = f"specdec_qgemm_{isa}"
    return Library(name, sources, tuple(KERNEL_FLAGS + ISA_FLAGS[isa] + [f"-DSPECDEC_QLIB={name}"]), headers)


def libraries() -> list[Library]:
    """Every native library specdec has: the block kernels once per ISA, the int8 kernel, the suffix trie."""
    return [qgemm_library(isa) for isa in ISA_FLAGS] + [
        Library("specdec_int8", ("kernels/csrc/int8/int8_gemm.cpp",), ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")),
        Library("specdec_suffix_trie", ("speculative/suffix_trie.cpp",), ("-O2", "-std=c++17"), torch=False),
    ]


def library(name: str) -> Library:
    return next(lib for lib in libraries() if lib.name == name)


# ------------------------------------------------------------------------------ the CPU-feature probe
@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def runs_isa(isa: str) -> bool:
    """Whether this CPU has the flags of the `isa` build (AMX also needs the OS's leave: qgemm checks it)."""
    return ISA_CPU_FLAGS[isa] <= cpu_flags()


# ------------------------------------------------------------------------------------------ loading
@functools.lru_cache(maxsize=None)
def _manifest() -> dict[str, str]:
    try:
        return json.loads((NATIVE_DIR / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def installed_path(name: str) -> Path | None:
    """The library built at install, if there is one and its sources are the ones here (or not shipped)."""
    lib = library(name)
    built = _manifest().get(name)
    files = sorted(NATIVE_DIR.glob(f"{name}.*.so")) + sorted(NATIVE_DIR.glob(f"{name}.so"))
    if built is None or not files:
        return None
    here = lib.digest()
    if here is not None and here != built:
        logger.info("%s: the sources differ from the installed build; building this checkout's", name)
        return None
    return files[0]


def missing() -> list[str]:
    """The libraries with no installed build matching this checkout's sources (scripts/setup.sh rebuilds then)."""
    return [lib.name for lib in libraries() if installed_path(lib.name) is None]


def jit_build(lib: Library) -> Path | None:
    """Build `lib` from this checkout's sources (a compiler needed): the developer's fallback. A torch ops
    library is built and loaded by torch's cpp_extension (returns None); a plain one by the C++ compiler
    (returns its file). Cached by digest under torch's extension directory, so an edit rebuilds."""
    from torch.utils import cpp_extension

    digest = lib.digest()
    if digest is None:
        raise RuntimeError(f"{lib.name}: neither an installed build nor its sources (reinstall specdec)")
    name = f"{lib.name}_{digest[:16]}"
    sources = [str(PACKAGE / s) for s in lib.sources]
    if lib.torch:
        cpp_extension.load(name=name, sources=sources, extra_cflags=list(lib.flags), extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
        return None
    import subprocess

    out = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / f"{name}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([os.environ.get("CXX", "c++"), *lib.flags, "-shared", "-fPIC", *sources, "-o", str(tmp)],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, out)  # atomic: a concurrent build never loads half a file
    return out


_lock = threading.Lock()
_done: dict[str, Path | None] = {}


def library_path(name: str) -> Path:
    """The file of the plain library `name`: the installed build, else (a developer's checkout) one built now."""
    assert not library(name).torch, name
    with _lock:
        if name not in _done:
            _done[name] = installed_path(name) or jit_build(library(name))
        return _done[name]


def load_ops(name: str):
    """`torch.ops.<name>`, loading the torch ops library `name` once: the installed build, else (a
    developer's checkout) one built now."""
    import torch

    with _lock:
        if name not in _done:
            path = installed_path(name)
            if path is not None:
                torch.ops.load_library(str(path))
            else:
                jit_build(library(name))
            _done[name] = path
    return getattr(torch.ops, name)
