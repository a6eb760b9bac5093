"""Heads on disk: their folders (`config.json` + `model.safetensors`), the ones shipped with specdec (package data
under `specdec/data/heads`, found by name or by the target's weights fingerprint), and loading them onto a target.
The modules themselves are `specdec.heads.modules`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.data import DATA_DIR
from specdec.heads.modules import HEAD_FORMATS, HeadsConfig, HeadsMismatchError, _Head, head_class, target_fingerprint
from specdec.methods import HEAD_METHODS


def save_heads(head: _Head, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu().contiguous()
        for name, t in head.state_dict().items()
    }
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(dataclasses.asdict(head.config), indent=2) + "\n")


def read_heads_config(directory: str | Path) -> HeadsConfig:
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no draft heads (no config.json)")
    return HeadsConfig(**json.loads(path.read_text()))


PRETRAINED = DATA_DIR / "heads"  # package data, outside the code folders


def resolve_heads(name_or_path: str) -> Path:
    """A heads folder: a path, or the name of heads shipped with specdec (`specdec/data/heads/NAME`)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    shipped = PRETRAINED / name_or_path
    if shipped.is_dir():
        return shipped
    names = sorted(p.name for p in PRETRAINED.iterdir() if (p / "config.json").is_file()) if PRETRAINED.is_dir() else []
    raise FileNotFoundError(
        f"no draft heads at {name_or_path!r}: not a folder, and not a shipped name ({', '.join(names) or 'none'})"
    )


def shipped_heads(target, methods: tuple[str, ...] = HEAD_METHODS) -> Path | None:
    """The folder of heads shipped with specdec for `target` (its weights' fingerprint), of the first of
    `methods` that has some (Medusa first: it measured better on this project's CPUs); None: none."""
    if not PRETRAINED.is_dir():
        return None
    found = {}
    fingerprint = None
    for folder in sorted(PRETRAINED.iterdir()):
        if not (folder / "config.json").is_file():
            continue
        config = read_heads_config(folder)
        fingerprint = fingerprint or target_fingerprint(target)
        if config.target_fingerprint == fingerprint and config.method in methods:
            found.setdefault(config.method, folder)
    return next((found[m] for m in methods if m in found), None)


def is_heads_folder(name_or_path: str) -> bool:
    """Whether `name_or_path` names heads (a folder with a heads config.json, or a shipped name)."""
    try:
        read_heads_config(resolve_heads(name_or_path))
    except (FileNotFoundError, TypeError, ValueError):
        return False
    return True


def load_heads(directory: str | Path, target, method: str | None = None, quantization: str = "auto") -> _Head:
    """Heads from `directory`, attached to `target` in its dtype: on a target on the block kernels, their
    matrices in `quantization` ("auto" or "q8_0": Q8_0; "q4_0": Q4_0, `HEAD_FORMATS`; "none": float). Refuses
    heads of another method or trained for another target, and a format they cannot run in."""
    fmt = "q8_0" if quantization == "auto" else quantization
    if fmt not in (*HEAD_FORMATS, "none"):
        raise ValueError(f"heads run their matrices as {', '.join(HEAD_FORMATS)} or none (float), not {quantization!r}")
    if fmt != "none" and quantization != "auto" and not target.on_block_kernels:
        raise ValueError(f"heads in {fmt} run on the block kernels, with a target on them (a GGUF on CPU)")
    config = read_heads_config(directory)
    if method is not None and config.method != method:
        raise ValueError(f"{directory} holds {config.method} heads, not {method}")
    fingerprint = target_fingerprint(target)
    if config.target_fingerprint != fingerprint:
        raise HeadsMismatchError(
            f"the {config.method} heads in {directory} were trained for target {config.target!r} "
            f"(weights fingerprint {config.target_fingerprint}); this target's fingerprint is {fingerprint}"
        )
    head = head_class(config.method)(config)
    state = load_file(str(Path(directory) / "model.safetensors"))
    head.load_state_dict(state)
    head = head.to(dtype=target.dtype).attach(target).requires_grad_(False).eval()
    return head.to_block_kernels(target, fmt) if target.on_block_kernels and fmt != "none" else head
