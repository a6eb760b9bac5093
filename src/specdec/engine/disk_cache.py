"""The prefix cache's disk tier: K/V blocks that outlive the process (a restart, an eviction from RAM, another
replica on the machine), so that a prompt read once is never computed again.

Each whole block a prefix cache saves (`PrefixCache.save`) is also written here, one file a block and cache,
named by the block's chain key (`prefix_cache.block_keys`: the hash of the salt and of every token up to the
block's end, so a salted tenant's blocks have keys no other tenant can produce). A lookup that the RAM blocks
do not cover reads the chain's next blocks back (`PrefixCache.lookup`) into RAM, and they are restored as any
cached block is.

The directory is `root / namespace`: the namespace is the hash of what decides a block's bits (the model
file's digest, the weights' format, the dtypes, the K/V format and the kernels' numerics), so a block written
by another model or another arithmetic is never read. Writes are atomic (a temporary file, then a rename);
each file ends with the sha256 of its header and data, and a file that is torn, truncated or changed is
removed and recomputed, never served. The directory is created 0700. Its size is kept within `budget`
bytes: past it, the least recently used files (by modification time, which a read refreshes) are removed,
under a lock file, so that several processes sharing the directory keep one budget between them; a killed
writer's temporary file goes once it is ten minutes old.

File layout: MAGIC, a 4-byte little-endian header length, the header (JSON: cache name, dtype, shape, tokens),
the data (the tensor's bytes), then the sha256 of header and data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

MAGIC = b"SPDKVB01"
NUMERICS_VERSION = "1"  # bumped when the kernels' arithmetic (so the K/V they write) changes
_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8)}


class ReadBlock(NamedTuple):
    """A block file read back and checked: its K/V (a view of the file's bytes) and how many tokens it holds."""

    data: torch.Tensor
    tokens: int


class _File(NamedTuple):
    path: Path
    size: int
    mtime: float


@dataclass
class DiskStats:
    hits: int = 0  # blocks read back
    misses: int = 0  # blocks looked for and not there
    writes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0  # files removed for the budget
    corrupt: int = 0  # files removed as torn, truncated or changed


def namespace(*parts: object) -> str:
    """The directory name for blocks whose bits `parts` decide (32 hex digits)."""
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:32]


def drafter_name(*parts: object) -> str:
    """The file name of a drafter's blocks whose bits `parts` decide beside the namespace's (its weights' digest,
    format, dtype, K/V format, method): "draft-" and 16 hex digits. Example: a draft model's blocks beside
    the target's, in the target's folder, so that one budget and one LRU order hold both."""
    return "draft-" + namespace(*parts)[:16]


class DiskTier:
    """Blocks of K/V on disk under `root / space`, within `budget` bytes (shared with other processes there)."""

    def __init__(self, root: str | Path, space: str, budget: int, names: dict[str, str] | None = None) -> None:
        """`names`: the caches whose blocks it keeps (a prefix cache's names) and the name of their files: the
        target's "target" (the namespace is its bits'); a drafter's own K/V (a draft model's, EAGLE's pairs)
        under a name that holds the digest of what else decides their bits (`drafter_name`)."""
        if budget <= 0:
            raise ValueError(f"a disk tier needs a positive budget, got {budget} bytes")
        root = Path(root).expanduser()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir = root / space
        self.dir.mkdir(exist_ok=True, mode=0o700)
        for d in (root, self.dir):
            os.chmod(d, 0o700)
        self.budget = budget
        self.names = {"target": "target"} if names is None else dict(names)
        self.stats = DiskStats()
        self._stats_lock = threading.Lock()
        self._lock = self.dir / ".lock"
        self._since_check = 0  # bytes written since the directory's size was last summed

    def path(self, key: bytes, name: str) -> Path:
        return self.dir / f"{key.hex()}.{name}"

    def has(self, key: bytes, name: str) -> bool:
        return self.path(key, name).is_file()

    def read(self, key: bytes, name: str) -> ReadBlock | None:
        """The block's data and its tokens, or None where there is none or it fails its checks (then removed)."""
        path = self.path(key, name)
        try:
            with open(path, "rb") as f:  # into one buffer, which the tensor then views (no copies)
                raw = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(raw)
        except OSError:
            self.stats.misses += 1
            return None
        parsed = _parse(raw, name)
        return parsed if self._checked(path, None if parsed is None else len(raw)) else None

    def read_into(self, key: bytes, name: str, buffers: list, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
        """Read a block of cache `name` (data of `dtype` and `shape`) straight into `buffers` (writable, its bytes
        in order: a mapped cache's page of each layer, or a pool's block), with no buffer between and no copy
        after: one `preadv`, the checksum taken over them. Returns its tokens; None where there is none or it
        fails its checks (then removed, and `buffers` hold bytes never to be served). Both the read and the
        hash let other threads run (the GIL released), so blocks can be read side by side."""
        path = self.path(key, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            with self._stats_lock:
                self.stats.misses += 1
            return None
        try:
            tokens = _read_checked(fd, name, buffers, dtype, shape)
        except OSError:
            tokens = None
        finally:
            os.close(fd)
        ok = self._checked(path, None if tokens is None else sum(memoryview(b).nbytes for b in buffers))
        return tokens if ok else None

    def _checked(self, path: Path, nbytes: int | None) -> bool:
        """Count a block read back (`nbytes`) or failing its checks (None: then removed, never served), and mark a
        good one most recently used. Locked: blocks are read in several threads."""
        with self._stats_lock:
            if nbytes is None:
                self.stats.corrupt += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += nbytes
        if nbytes is None:
            _unlink(path)
            return False
        try:
            os.utime(path)
        except OSError:
            pass
        return True

    def write(self, key: bytes, name: str, data: torch.Tensor, tokens: int) -> None:
        """Keep `data` (a block of `tokens` tokens of cache `name`) under `key`: atomic, then within budget. A block
        already there is only marked used (its bits are the same: the key and namespace decide them)."""
        path = self.path(key, name)
        if path.is_file():
            try:
                os.utime(path)
                return
            except OSError:
                pass
        data = data.detach().to("cpu").contiguous()
        header = json.dumps({"name": name, "dtype": str(data.dtype), "shape": list(data.shape),
                             "tokens": tokens}).encode()
        payload = memoryview(data.view(torch.uint8).numpy()).cast("B")  # bytes, flat (hashed and written in place)
        h = hashlib.sha256(header)
        h.update(payload)
        parts = (MAGIC, struct.pack("<I", len(header)), header, payload, h.digest())
        size = sum(len(part) for part in parts)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.writelines(parts)
                os.replace(tmp, path)
            except BaseException:
                _unlink(Path(tmp))
                raise
        except OSError:  # a full or read-only disk: the block stays in RAM only
            return
        self.stats.writes += 1
        self.stats.bytes_written += size
        self._since_check += size
        if self._since_check >= self.budget // 16:
            self.enforce_budget()

    def usage(self) -> int:
        """Bytes of block files in the directory (all processes')."""
        return sum(size for _, size, _ in self._files())

    def enforce_budget(self, stale_s: float = 600.0) -> int:
        """Remove least recently used files until the directory holds at most the budget, and temporary files
        older than `stale_s` seconds (a writer killed mid-write leaves its own); returns how many blocks."""
        self._since_check = 0
        removed = 0
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                now = time.time()
                for entry in list(os.scandir(self.dir)):
                    try:
                        if entry.name.startswith(".tmp-") and now - entry.stat().st_mtime > stale_s:
                            _unlink(Path(entry.path))
                    except OSError:
                        pass
                files = sorted(self._files(), key=lambda f: f.mtime)  # oldest first
                total = sum(size for _, size, _ in files)
                for path, size, _ in files:
                    if total <= self.budget:
                        break
                    if _unlink(path):
                        removed += 1
                    total -= size
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self.stats.evictions += removed
        return removed

    def clear(self) -> None:
        for path, _, _ in self._files():
            _unlink(path)

    def _files(self) -> list[_File]:
        out = []
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return out
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat()
            except OSError:  # removed meanwhile (another process)
                continue
            out.append(_File(Path(entry.path), st.st_size, st.st_mtime))
        return out


def _parse(raw: bytearray, name: str) -> ReadBlock | None:
    """The tensor (a view of `raw`) and token count of a block file's bytes, or None if they fail any check."""
    start = len(MAGIC) + 4
    if len(raw) < start + 32 or raw[:len(MAGIC)] != MAGIC:
        return None
    (hlen,) = struct.unpack("<I", raw[len(MAGIC):start])
    if start + hlen + 32 > len(raw):
        return None
    view = memoryview(raw)
    if hashlib.sha256(view[start:-32]).digest() != raw[-32:]:
        return None
    try:
        header = json.loads(raw[start:start + hlen])
        dtype, shape, tokens = _DTYPES[header["dtype"]], [int(s) for s in header["shape"]], int(header["tokens"])
    except (ValueError, KeyError, TypeError):
        return None
    size = len(raw) - 32 - (start + hlen)
    if header.get("name") != name or math.prod(shape) * dtype.itemsize != size:
        return None
    data = torch.frombuffer(raw, dtype=torch.uint8, count=size, offset=start + hlen) if size else torch.empty(0, dtype=torch.uint8)
    return ReadBlock(data.view(dtype).reshape(shape), tokens)


def _read_checked(fd: int, name: str, buffers: list, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """`DiskTier.read_into`'s reading of an open block file: its tokens, or None if it fails any check."""
    size = os.fstat(fd).st_size
    start = len(MAGIC) + 4
    head = os.pread(fd, 4096, 0)
    if len(head) < start or head[:len(MAGIC)] != MAGIC:
        return None
    (hlen,) = struct.unpack("<I", head[len(MAGIC):start])
    if len(head) < start + hlen:
        head = os.pread(fd, start + hlen, 0)
    want = sum(memoryview(b).nbytes for b in buffers)
    if size != start + hlen + want + 32 or math.prod(shape) * dtype.itemsize != want:
        return None
    header = bytes(head[start:start + hlen])
    try:
        meta = json.loads(header)
        ok = meta["name"] == name and meta["dtype"] == str(dtype) and [int(s) for s in meta["shape"]] == list(shape)
        tokens = int(meta["tokens"])
    except (ValueError, KeyError, TypeError):
        return None
    if not ok or os.preadv(fd, buffers, start + hlen) != want:
        return None
    h = hashlib.sha256(header)
    for b in buffers:
        h.update(b)
    return tokens if h.digest() == os.pread(fd, 32, size - 32) else None


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


def file_digest(path: str | Path, home: Path) -> str:
    """sha256 of a model file (or of a folder's files, in name order), remembered in `home`/digests.json by
    path, size and modification time, so that it is computed once per file (about a second a GB)."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stamp = hashlib.sha256(json.dumps([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
    memo = home / "digests.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp.hexdigest() in known:
        return known[stamp.hexdigest()]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    digest = h.hexdigest()
    known[stamp.hexdigest()] = digest
    try:
        home.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest
