"""Builds specdec's native libraries at install, with setuptools and torch's `BuildExtension`.

What is built is described once, in `src/specdec/kernels/native.py` (loaded here by path): the block kernels
once per instruction set (generic, avx2, avx512vnni, avx512amx; the CPU's flags pick one at run time), the
int8 kernel and the suffix trie, each a library under `specdec/_native/`, with `manifest.json` holding the
digest of each one's sources and flags. Everything else is pyproject.toml's.

    pip install --no-build-isolation -e .   # a checkout (scripts/setup.sh): the libraries land in src/specdec/_native
    pip wheel --no-build-isolation .        # a wheel holding them

`--no-build-isolation` builds against the torch already installed (the libraries must match the torch they
load into); ninja compiles a library's files in parallel (`MAX_JOBS` jobs, default: the CPU count).
See docs/native-build.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_specdec_native", ROOT / "src" / "specdec" / "kernels" / "native.py")
native = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = native  # (dataclasses look their module up)
_spec.loader.exec_module(native)

_QUIET = ["-g0"]  # no debug sections (after Python's own CFLAGS, in case the compiler's holds -g elsewhere)


def extension(lib) -> Extension:
    name = f"specdec._native.{lib.name}"
    sources = [f"src/specdec/{s}" for s in lib.sources]
    depends = [f"src/specdec/{h}" for h in lib.headers]
    if lib.torch:
        return CppExtension(name, sources, depends=depends, extra_compile_args=list(lib.flags) + _QUIET,
                            extra_link_args=["-fopenmp"])
    return Extension(name, sources, depends=depends, extra_compile_args=list(lib.flags) + _QUIET, language="c++")


class BuildNative(BuildExtension):
    """torch's BuildExtension, each library compiled in a folder of its own (the block kernels' builds share
    their sources: their objects must not overwrite one another), the build's time reported, and the
    manifest written next to the libraries."""

    def build_extensions(self) -> None:
        # the flags of the first-use build (cpp_extension.load): not Python's own -g and -fwrapv
        self.compiler.compiler_so = [f for f in self.compiler.compiler_so if f not in ("-g", "-fwrapv")]
        super().build_extensions()

    def build_extension(self, ext) -> None:
        temp = self.build_temp
        self.build_temp = os.path.join(temp, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = temp

    def run(self) -> None:
        start = time.perf_counter()
        if self.inplace:  # (specdec/_native is no package of its own: setuptools would not make it)
            Path(self.get_ext_fullpath(self.extensions[0].name)).parent.mkdir(parents=True, exist_ok=True)
        super().run()
        manifest = json.dumps({lib.name: lib.digest() for lib in native.libraries()}, indent=1, sort_keys=True)
        inplace = self.inplace
        for self.inplace in sorted({False, inplace}):
            target = Path(self.get_ext_fullpath(self.extensions[0].name)).parent / native.MANIFEST
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(manifest + "\n")
        self.inplace = inplace
        print(f"specdec: native libraries built in {time.perf_counter() - start:.0f} s", flush=True)


setup(
    ext_modules=[extension(lib) for lib in native.libraries()],
    cmdclass={"build_ext": BuildNative.with_options(no_python_abi_suffix=True)},
)
