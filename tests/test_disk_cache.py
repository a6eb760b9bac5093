"""The prefix cache's disk tier (specdec.engine.disk_cache): blocks that outlive the process.

Exact: a fresh engine (a restarted process) on the same directory restores a prompt's blocks from disk and gives
the output of an engine without a cache, for every proposer, copied and mapped blocks, greedy and seeded.
Safe: a torn, truncated, changed or foreign file is removed and recomputed, never served; a writer killed
mid-write leaves no file that reads back wrong; a full disk leaves the block in RAM only; the directory is 0700;
the budget holds for several processes sharing the directory, least recently used files going first."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from specdec.engine.disk_cache import MAGIC, DiskTier, file_digest, namespace
from specdec.engine.prefix_cache import block_keys
from test_prefix_cache import A, KINDS, OTHER, assert_pages_accounted, cached, cold, make_engine, params
from test_engine_tiny import run

KEY = bytes(range(32))


def block(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-127, 128, (4, 2, 16, 8), generator=g, dtype=torch.int8)
    return torch.randn(4, 2, 16, 8, generator=g).to(dtype)


def test_a_block_reads_back_the_bits_it_was_written_with(tmp_path):
    disk = DiskTier(tmp_path / "kv", "space", 1 << 20)
    for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.int8)):
        data = block(i, dtype)
        disk.write(KEY[:31] + bytes([i]), "target", data, 16)
        got, tokens = disk.read(KEY[:31] + bytes([i]), "target")
        assert tokens == 16 and got.dtype == dtype and torch.equal(got, data)
    assert disk.read(KEY, "target") is None and disk.read(KEY[:31] + b"\x00", "draft") is None  # (other name)
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700 and stat.S_IMODE(os.stat(disk.dir).st_mode) == 0o700
    assert not [p for p in os.listdir(disk.dir) if p.startswith(".tmp")]  # written by rename, nothing left over
    assert (disk.stats.writes, disk.stats.hits, disk.stats.misses) == (3, 3, 2)


@pytest.mark.parametrize("damage", ["flipped bit", "truncated", "empty", "header", "wrong name", "foreign"])
def test_a_damaged_file_is_removed_and_never_served(tmp_path, damage):
    disk = DiskTier(tmp_path, "space", 1 << 20)
    disk.write(KEY, "target", block(0), 16)
    path = disk.path(KEY, "target")
    raw = bytearray(path.read_bytes())
    if damage == "flipped bit":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "truncated":
        raw = raw[:len(raw) - 100]
    elif damage == "empty":
        raw = bytearray()
    elif damage == "header":
        raw[len(MAGIC) + 6] ^= 0x01
    elif damage == "wrong name":  # a valid file of another cache, under this cache's name
        other = DiskTier(tmp_path, "other", 1 << 20)
        other.write(KEY, "draft", block(0), 16)
        raw = bytearray(other.path(KEY, "draft").read_bytes())
    else:
        raw = bytearray(b"not a block at all" * 10)
    path.write_bytes(bytes(raw))
    assert disk.read(KEY, "target") is None
    assert not path.exists() and disk.stats.corrupt == 1
    disk.write(KEY, "target", block(0), 16)  # computed again, written again
    assert torch.equal(disk.read(KEY, "target").data, block(0))


def test_a_full_disk_keeps_the_block_in_ram_only(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, "space", 1 << 20)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specdec.engine.disk_cache.tempfile.mkstemp", full)
    disk.write(KEY, "target", block(0), 16)  # no exception
    assert not disk.has(KEY, "target") and disk.stats.writes == 0


def test_the_budget_removes_the_least_recently_used_files_first(tmp_path):
    one = len(MAGIC) + 4 + 32 + 80 + block(0).numel() * 2  # about a file's size
    disk = DiskTier(tmp_path, "space", 10 * one)
    keys = [bytes([i]) * 32 for i in range(14)]
    for i, key in enumerate(keys[:9]):
        disk.write(key, "target", block(i), 16)
        os.utime(disk.path(key, "target"), (1000 + i, 1000 + i))  # written one after the other
    assert disk.read(keys[0], "target") is not None  # the oldest, read: now the most recently used
    for i, key in enumerate(keys[9:], start=9):
        disk.write(key, "target", block(i), 16)
    disk.enforce_budget()
    assert disk.usage() <= disk.budget
    kept = [disk.has(key, "target") for key in keys]
    assert kept[0] and all(kept[9:]) and not kept[1] and disk.stats.evictions >= 3


WRITER = """
import sys, torch
from specdec.engine.disk_cache import DiskTier
disk = DiskTier(sys.argv[1], "space", int(sys.argv[2]))
i = int(sys.argv[3])
while True:
    disk.write(i.to_bytes(32, "little"), "target", torch.full((64, 2, 16, 64), float(i % 7)).to(torch.bfloat16), 16)
    i += 2
    if i > int(sys.argv[4]):
        break
print("done", flush=True)
"""


def test_two_processes_share_one_directory_and_one_budget_and_a_killed_writer_leaves_nothing_wrong(tmp_path):
    budget = 6 << 20  # ~20 files of 262 KB
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(budget), str(start), "120"],
                                stdout=subprocess.PIPE, text=True) for start in (0, 1)]
    assert all(w.communicate(timeout=120)[0].strip() == "done" for w in writers)
    disk = DiskTier(tmp_path, "space", budget)
    one = 64 * 2 * 16 * 64 * 2 + 200  # a file's bytes
    # each writer enforces it every sixteenth of the budget it writes: at most that and a file more each
    assert disk.usage() <= budget + 2 * (budget // 16 + one)
    disk.enforce_budget()
    assert disk.usage() <= budget
    found = [i for i in range(122) if disk.has(i.to_bytes(32, "little"), "target")]
    assert len(found) >= 10  # the most recently written of both writers' blocks, read by a third process
    for i in found:
        data, _ = disk.read(i.to_bytes(32, "little"), "target")
        assert torch.equal(data, torch.full((64, 2, 16, 64), float(i % 7)).to(torch.bfloat16))
    # a writer killed mid-stream (SIGKILL): every block file there reads back whole or is not there
    killed = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "k"), str(64 << 20), "0", "1000000000"])
    deadline = time.time() + 60
    while time.time() < deadline and len(os.listdir(tmp_path / "k" / "space") if (tmp_path / "k" / "space").exists() else []) < 30:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    survivor = DiskTier(tmp_path / "k", "space", 64 << 20)
    names = [n for n in os.listdir(survivor.dir) if not n.startswith(".")]
    assert len(names) >= 30
    survivor.enforce_budget(stale_s=0)  # (a temporary file the writer left: removed once stale)
    assert not [n for n in os.listdir(survivor.dir) if n.startswith(".tmp-")]
    for name in names:
        i = int.from_bytes(bytes.fromhex(name.split(".")[0]), "little")
        data, _ = survivor.read(i.to_bytes(32, "little"), "target")
        assert torch.equal(data, torch.full((64, 2, 16, 64), float(i % 7)).to(torch.bfloat16))


def test_the_namespace_and_the_digest_tell_models_and_arithmetic_apart(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"one model")
    b.write_bytes(b"another model")
    home = tmp_path / "home"
    da = file_digest(a, home)
    assert da == file_digest(a, home) and da != file_digest(b, home)
    assert (home / "digests.json").is_file()
    spaces = {namespace(da, "gguf", "bf16", "auto", "cpu", "1", 16), namespace(file_digest(b, home), "gguf", "bf16", "auto", "cpu", "1", 16),
              namespace(da, "gguf", "bf16", "q8_0", "cpu", "1", 16), namespace(da, "gguf", "bf16", "auto", "cpu-amx", "1", 16),
              namespace(da, "gguf", "bf16", "auto", "cpu", "2", 16)}
    assert len(spaces) == 5


# ------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("block_size", [8, 16], ids=["copied", "mapped"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_restarted_engine_reads_the_prompt_from_disk_and_gives_the_output_of_no_cache(tmp_path, kind, sampled,
                                                                                        block_size):
    """A 37-token prompt on one engine (its blocks written through to disk), then the same prompt and the next
    turn of that conversation on a fresh engine on the same directory, whose RAM cache is empty: the target's
    whole blocks and the prompt's tail come from disk (proposers with K/V of their own compute theirs, EAGLE's pairs cannot be: it
    starts from none), and every output is the one an engine without a cache gives."""
    disk = lambda: DiskTier(tmp_path, "space", 1 << 30)  # noqa: E731
    first = run(make_engine(kind, 64, blocks=64, block=block_size, prefix_disk=disk()), [("first", A, params(sampled, 1))])
    first = first["first"]
    assert first.token_ids == cold(kind, 64, A, params(sampled, 1))
    # the whole blocks the finished row held (its prompt and all but its last output token), the tail of its
    # prompt (saved as it joined) and the row's tail (saved as it left)
    held = len(A) + len(first.token_ids) - 1
    assert len(os.listdir(tmp_path / "space")) == held // block_size + (36 % block_size > 0) + (held % block_size > 0)
    restarted = make_engine(kind, 64, blocks=64, block=block_size, prefix_disk=disk())
    turn = A + tuple(first.token_ids) + (5, 6, 7)
    outs = run(restarted, [("again", A, params(sampled, 2))])
    outs.update(run(restarted, [("next turn", turn, params(sampled, 3)), ("other", OTHER, params(sampled, 4))]))
    whole = 36 // block_size
    eagle = kind in ("eagle", "eagle tree")
    assert outs["again"].metrics.disk_cached_tokens == (0 if eagle else cached(whole, kind, 36 % block_size, block_size))
    assert outs["again"].metrics.cached_tokens == outs["again"].metrics.disk_cached_tokens
    assert outs["other"].metrics.cached_tokens == 0
    for rid, prompt, seed in (("again", A, 2), ("next turn", turn, 3), ("other", OTHER, 4)):
        assert outs[rid].token_ids == cold(kind, 64, prompt, params(sampled, seed)), rid


def test_damaged_files_on_disk_are_recomputed_with_the_same_output(tmp_path):
    disk = DiskTier(tmp_path, "space", 1 << 30)
    p = params(False)
    first = run(make_engine("plain", 64, blocks=64, block=16, prefix_disk=disk), [("first", A, p)])["first"]
    damaged = disk.path(block_keys(list(A), 16)[1], "target")  # the chain's second block
    raw = bytearray(damaged.read_bytes())
    raw[200] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    again = run(make_engine("plain", 64, blocks=64, block=16, prefix_disk=DiskTier(tmp_path, "space", 1 << 30)),
                [("again", A, p)])["again"]
    assert again.token_ids == first.token_ids
    assert again.metrics.disk_cached_tokens == 16  # the chain stops at the damaged block: only block 0 read
    assert damaged.read_bytes() != bytes(raw)  # removed, then written again whole when the row was saved


@pytest.mark.parametrize("block_size", [8, 16], ids=["copied", "mapped"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["draft model", "eagle", "eagle tree"])
def test_the_drafts_own_blocks_follow_the_targets_onto_disk(tmp_path, kind, sampled, block_size):
    """With the draft's cache kept on disk too (`DiskTier.names`), a restarted engine reads a draft model's K/V
    and EAGLE's pairs back with the target's: the bits its first process computed, the draft model reads none
    of the prompt itself, EAGLE starts from the whole blocks (without them it starts from none), and every
    output is the one an engine without a cache gives (greedy: plain decoding's)."""
    names = {"target": "target", "draft": "draft-0123456789abcdef"}
    disk = lambda: DiskTier(tmp_path, "space", 1 << 30, names)  # noqa: E731
    engine = make_engine(kind, 64, blocks=64, block=block_size, prefix_disk=disk())
    first = run(engine, [("first", A, params(sampled, 1))])["first"]
    held = len(A) + len(first.token_ids) - 1  # the tokens the finished row held
    keys = block_keys(list(A + tuple(first.token_ids)), block_size)[:held // block_size]
    written = {key: engine.prefix_cache._block_data("draft", engine.prefix_cache.blocks[key]).clone() for key in keys
               if "draft" in engine.prefix_cache.blocks[key].caches}
    assert len(written) >= 36 // block_size
    assert all(disk().has(key, names["draft"]) for key in written)
    restarted = make_engine(kind, 64, blocks=64, block=block_size, prefix_disk=disk())
    fed = []
    if kind == "draft model":  # what the draft model computes of the prompt itself
        prefill = restarted.proposer.prefill
        restarted.proposer.prefill = lambda seq, start, stop: fed.append(stop - start) or prefill(seq, start, stop)
    again = run(restarted, [("again", A, params(sampled, 2))])["again"]
    whole = 36 // block_size
    assert again.metrics.cached_tokens == again.metrics.disk_cached_tokens == \
        cached(whole, kind, 36 % block_size, block_size)  # (the tail too, but for EAGLE)
    if kind == "draft model":
        assert sum(fed) == 36 - whole * block_size  # it read only the tokens past the blocks
    pc = restarted.prefix_cache
    for key in keys[:whole]:  # restored bits == computed bits
        assert torch.equal(pc._block_data("draft", pc.blocks[key]), written[key])
    assert again.token_ids == cold(kind, 64, A, params(sampled, 2))
    if not sampled:
        assert again.token_ids == cold("plain", 64, A, params(sampled, 2))


@pytest.mark.parametrize("block_size", [8, 16], ids=["copied", "mapped"])
def test_blocks_read_in_two_threads_are_the_bits_and_stop_at_a_damaged_one(tmp_path, monkeypatch, block_size):
    """A lookup reads many blocks back in two threads (`PrefixCache._read_blocks`, here from 2 blocks on): the
    output is an engine's without a cache, a damaged block ends the chain there (the blocks read past it are
    given back: every page accounted), and the next lookup finds the chain up to it."""
    monkeypatch.setattr("specdec.engine.prefix_cache.PARALLEL_READS", 2)
    names = {"target": "target", "draft": "draft-0123456789abcdef"}
    disk = lambda: DiskTier(tmp_path, "space", 1 << 30, names)  # noqa: E731
    p = params(False)
    first = run(make_engine("draft model", 64, blocks=64, block=block_size, prefix_disk=disk()), [("first", A, p)])
    keys = block_keys(list(A), block_size)
    restarted = make_engine("draft model", 64, blocks=64, block=block_size, prefix_disk=disk())
    again = run(restarted, [("again", A, p)])["again"]
    assert again.metrics.disk_cached_tokens == 36  # (the whole blocks and the tail)
    assert again.token_ids == first["first"].token_ids == cold("plain", 64, A, p)
    assert_pages_accounted(restarted)
    bad = 1 if block_size == 8 else 0  # (blocks past it read, then given back: 2 of them, or 1 page)
    damaged = disk().path(keys[bad], "target")
    raw = bytearray(damaged.read_bytes())
    raw[300] ^= 0x01
    damaged.write_bytes(bytes(raw))
    third = make_engine("draft model", 64, blocks=64, block=block_size, prefix_disk=disk())
    out = run(third, [("third", A, p)])["third"]
    assert out.metrics.disk_cached_tokens == bad * block_size and out.token_ids == again.token_ids
    assert_pages_accounted(third)
