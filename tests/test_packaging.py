"""The files specdec reads at run time ship with it: pyproject's package data covers them, and they are found
next to the modules that read them, not through the source checkout's layout."""

from __future__ import annotations

import tomllib
from pathlib import Path, PurePosixPath

import specdec
from specdec.data import DATA_DIR
from specdec.training import TrainConfig

ROOT = Path(specdec.__file__).parent
PYPROJECT = ROOT.parent.parent / "pyproject.toml"


def read_at_run_time() -> list[PurePosixPath]:
    """The prompt sets (bench, training), the shipped heads (data/heads), the native libraries' sources (the
    digests of an installed build are checked against them; a developer's edit is built on first use)."""
    files = [p for p in (ROOT / "data").rglob("*")  # (a .gitignore is the repository's, not read at run time)
             if p.is_file() and p.suffix not in (".py", ".pyc") and not p.name.startswith(".")]
    files += [p for p in (ROOT / "kernels").rglob("*") if p.suffix in (".cpp", ".h")]
    files += list((ROOT / "speculative").glob("*.cpp"))
    return sorted(PurePosixPath(p.relative_to(ROOT).as_posix()) for p in files)


def test_the_files_read_at_run_time_are_package_data():
    globs = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]["specdec"]
    files = read_at_run_time()
    assert {"data/humaneval/HumanEval.jsonl.gz", "data/spec_bench/question.jsonl", "kernels/csrc/qmm.cpp",
            "kernels/csrc/quant/q45_k.h", "speculative/suffix_trie.cpp",
            "data/heads/qwen2.5-coder-1.5b-instruct-medusa/model.safetensors",
            "data/heads/qwen2.5-coder-1.5b-instruct-eagle3/model.safetensors"} <= set(map(str, files))
    missing = [str(f) for f in files
               if not any(len(f.parts) == len(PurePosixPath(g).parts) and f.match(g) for g in globs)]
    assert missing == []


def test_weights_ship_as_data_outside_the_code_folders():
    """The shipped heads' weights lie in specdec/data, not beside the modules; the heads module finds them there."""
    from specdec.heads.files import PRETRAINED, resolve_heads

    weights = sorted(p.relative_to(ROOT).parts[0] for p in ROOT.rglob("*.safetensors"))
    assert weights and set(weights) == {"data"}
    assert PRETRAINED == DATA_DIR / "heads"
    assert resolve_heads("qwen2.5-coder-1.5b-instruct-medusa") == PRETRAINED / "qwen2.5-coder-1.5b-instruct-medusa"


def test_training_finds_its_prompts_inside_the_package():
    assert DATA_DIR == ROOT / "data"
    assert TrainConfig(method="eagle", out=Path("unused")).data_dir == DATA_DIR
    assert (DATA_DIR / "humaneval" / "HumanEval.jsonl.gz").is_file()
    assert (DATA_DIR / "spec_bench" / "question.jsonl").is_file()
