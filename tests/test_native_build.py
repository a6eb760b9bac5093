"""The native libraries are built at install (setup.py), so nothing needs a compiler at run time: with none
reachable (no cc, c++, gcc, g++ or clang on PATH; CC and CXX pointing at `false`; an empty torch extension
cache), a subprocess runs the block kernels of this CPU's build and of the portable one, the int8 kernel and the
suffix trie. And the table of block formats in C++ is the one qgemm.py states, and the C++ has one SIMD layer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from specdec.kernels import native, qgemm

SCRIPT = """
import torch
from specdec.kernels import int8_gemm, qgemm
from specdec.speculative.suffix import SuffixTrie, load_library

torch.manual_seed(0)
w = torch.randn(64, 256)
x = torch.randn(3, 256)
for isa in (qgemm.best_isa(), "generic"):
    y = qgemm.qmm(x, [qgemm.quantize_q8_0(w)], [8], isa=isa)
    assert y.shape == (3, 64) and (y - x @ w.T).abs().max() < 0.5, isa
    r = qgemm.ops(isa).rms_norm(x, torch.ones(256), 1e-6)
    assert torch.allclose(r, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5), isa
    print(isa, "ok")
assert int8_gemm.available(), int8_gemm.unavailable_reason()
lib = load_library()
assert lib is not None
trie = SuffixTrie(8, lib)
trie.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3])
assert trie.speculate([1, 2], 3).tokens[:1] == [3]
print("trie ok")
"""


def test_the_libraries_run_without_a_compiler(tmp_path):
    assert native.missing() == [], (
        f"not built at install: {native.missing()}: run scripts/setup.sh (or pip install --no-build-isolation -e .)")
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "CC": "/bin/false", "CXX": "/bin/false",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"), "SPECDEC_HOME": str(tmp_path / "home")}
    env.pop("SPECDEC_QGEMM_ISA", None)
    assert [cc for cc in ("cc", "c++", "gcc", "g++", "clang", "clang++") if shutil.which(cc, path=env["PATH"])] == []
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "generic ok" in run.stdout and "trie ok" in run.stdout
    assert not (tmp_path / "torch_extensions").exists() or not any((tmp_path / "torch_extensions").iterdir())


def test_the_table_of_formats_is_the_one_python_states():
    table = qgemm.ops("generic").formats()
    entries = {table[i]: tuple(table[i + 1:i + 4]) for i in range(0, len(table), 4)}
    assert {t: e[:2] for t, e in entries.items() if e[2] == 1} == qgemm.BLOCK
    assert {t: entries[t][0] for t in qgemm.X16_TYPES.values()} == {
        qgemm.X16_TYPES[t]: qgemm.BLOCK[t][0] for t in qgemm.X16_TYPES}
    assert all(entries[t][2] == 16 for t in qgemm.X16_TYPES.values())


def test_the_kernel_tests_pass_under_every_other_vector_build_this_cpu_runs(tmp_path):
    """tests/test_qgemm.py and tests/test_attention.py (bits, invariances, layouts) with each other vector build
    forced (`SPECDEC_QGEMM_ISA`): an AVX-512 machine checks the AVX2 build the way an AVX2 machine runs it
    (its 16-channel layouts, its widened Q5_0, its groups of 4 rows), not only against the others' bits. The
    portable build is compared inside those tests, and the AMX build takes over from AVX-512 VNNI only on
    passes of 12 rows or more."""
    default = qgemm.best_isa()
    others = [isa for isa in ("avx512vnni", "avx2") if isa != default and native.runs_isa(isa)]
    if not others:
        import pytest
        pytest.skip(f"no other vector build runs on this CPU than {default}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for isa in others:
        env = {**os.environ, "SPECDEC_QGEMM_ISA": isa, "SPECDEC_HOME": str(tmp_path / isa)}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not real",
                              "-n", "0", "tests/test_qgemm.py", "tests/test_attention.py"],
                             cwd=root, env=env, capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, (isa, run.stdout[-3000:], run.stderr[-2000:])
        assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-500:]


# One SIMD layer (issue 62, after ggml-cpu): the compiler's instruction-set macros are tested, and vector types
# named, only in the vector layer (isa/), the per-architecture forms of the ops' kernels (arch/) and the AMX
# kernel set (amx/); everywhere else the code reads what the layer says (SPECDEC_AVX2, SPECDEC_Z512, kMaxRows).
SIMD_FOLDERS = ("isa", "arch", "amx")
ISA_TEST = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b.*\b__(?:AVX|AMX|F16C|FMA|SSE)\w*", re.M)
VECTOR_TYPE = re.compile(r"\b(?:typedef|using)\b[^;]*\b__m(?:128|256|512)\w*|vector_size", re.M)
FORMAT_HEADER = re.compile(r'^\s*#\s*include\s*"[^"]*(?:quant/|repack/|formats?\.h)', re.M)


def simd_outside_the_layer(rel: str, text: str) -> list[str]:
    """`rel:line: text` for each instruction-set test or vector type in a file outside the SIMD folders, and for
    each block format an isa/ file includes (the layer knows no format)."""
    folder = rel.split("/")[0]
    rules = [FORMAT_HEADER] if folder == "isa" else [] if folder in SIMD_FOLDERS else [ISA_TEST, VECTOR_TYPE]
    return [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
            for rule in rules for m in rule.finditer(text)]


def test_instruction_sets_are_read_only_in_the_simd_layer():
    files = sorted(p for p in native.CSRC.rglob("*") if p.suffix in (".h", ".cpp"))
    assert any(p.parent.name == "ops" for p in files) and any(p.parent.name == "isa" for p in files)
    found = [hit for p in files for hit in simd_outside_the_layer(p.relative_to(native.CSRC).as_posix(), p.read_text())]
    assert found == []


def test_the_simd_layer_check_catches_what_it_forbids():
    assert len(simd_outside_the_layer("ops/x.cpp", "#if defined(__AVX2__)\n#elif defined(__AVX512F__) && 1\n")) == 2
    assert simd_outside_the_layer("quant/x.h", "#ifdef __F16C__\n  using V = __m256;\n") == [
        "quant/x.h:1: #ifdef __F16C__", "quant/x.h:2: using V = __m256"]
    assert simd_outside_the_layer("acts.h", "typedef float v8 __attribute__((vector_size(32)));") != []
    assert simd_outside_the_layer("isa/amx.h", '#include "../quant/q6_k.h"\n') == ['isa/amx.h:1: #include "../quant/']
    assert simd_outside_the_layer("ops/x.cpp", "#if defined(SPECDEC_Z512)\n  __m512 a = f(); // __AVX2__\n") == []
    assert simd_outside_the_layer("arch/x.h", "#if defined(__AVX2__)\nusing V = __m256;\n") == []
