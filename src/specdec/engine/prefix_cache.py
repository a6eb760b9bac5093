"""Automatic prefix caching: the K/V of token prefixes, kept after requests end, in blocks keyed by the prefix.

A sequence's tokens are cut into blocks of `block_size`; block i is keyed by the chain hash (sha256, as
vLLM) of the salt and of tokens[0 : (i + 1) * block_size], so equal keys mean equal whole prefixes, and a
request with another `cache_salt` never shares a block. A block holds, for each cache saved into it (the
target's, and the draft's: a draft model's or EAGLE's), the K/V of its slots, in one of two ways:

- *mapped* (a cache named in `mapped`, whose blocks are its pages: `block_size` = `PAGE`, slot s of a row
  holding token s's K/V): the block is the page the row wrote, which the cache holds on (`KVCache.hold`)
  when the row leaves; restoring maps the chain's pages into the new row (`KVCache.map`), shared, with
  nothing copied, and a row that writes into a shared page writes a copy of it (`KVCache.reserve`). The
  pages come out of the cache's own pool, in which the engine sets `num_blocks` pages aside for them.
- *copied* (the others: EAGLE's pairs, whose blocks straddle pages, and blocks of another size): the slots
  are copied out of the row into a pool preallocated for `num_blocks` blocks, and back into a row.

The models' kernels give a token's K/V the same bits whatever pass computed it, so a restored prefix is
exactly what prefilling it would have written.

A sequence's last tokens past its whole blocks (fewer than `block_size`) are kept too, as a *tail*: a block
keyed by the chain hash of the whole blocks before it and of its own tokens (a shorter input than a whole
block's, so never equal to one), holding only that many slots. A lookup takes, after the longest chain of
whole blocks, the longest tail cached there whose tokens all match the prompt's next ones, so a prompt sent
again, or a conversation's next turn (the previous turn's prompt and answer, then new text), restores all
but the tokens it must compute, as llama.cpp's per-slot cache does, instead of up to a block less. A tail
matches whole or not at all, so a guess at another request's tokens is confirmed a whole tail at a time, as
a whole block is (a match token by token would let an unsalted client read another's prompt one token per
guess).

With a disk tier (`disk_cache.DiskTier`), every whole block the target's cache saves is also written to disk
under its key, and a lookup whose chain the RAM blocks stop short of reads the next blocks from disk into RAM
blocks (a page of the mapped cache each), which are then restored as any cached block is: a restarted
process, or one sharing the directory, finds a prompt read before without computing it. Where the tier keeps
the draft's cache too (`DiskTier.names`), its blocks are written alike and read back when a proposer asks
which blocks hold it (`held`).

When the pool is full, saving evicts the least recently used block, but never one whose pages a row holds too
(mapped into a running sequence, or still its own: evicting it would free no memory, as vLLM keeps a block
in use out of its free queue). Rows may take a mapped cache's whole pool: a pass that finds no free page
evicts blocks no row holds, least recently used first (`reclaim`), as vLLM's cached blocks are free ones.
Lookups and saves touch a chain from its last block to its first, so a chain loses its deepest blocks first
and never a block its kept ones extend.

Slot s of a row holds what tokens[0 : s + 1 + shift] determine: shift 0 for a model's K/V (token s's), 1
for EAGLE's (its slot s pairs the feature of token s with token s + 1). Block i then holds slots
[i * block_size - shift, (i + 1) * block_size - shift) of the row (slot -1 of block 0 is left unused).

Example (block_size 4): a finished sequence [5 6 7 8 9 1 2 3 4 0] whose target cache holds its first 9
tokens is saved as 2 blocks (tokens 0..7). A prompt [5 6 7 8 9 1 2 3 7 7] then finds both blocks (its
first 9 tokens: 2 whole blocks, both cached): 8 slots are copied into its row and it prefills from token 8.
With tails, the first sequence's 9th token was kept as a tail too (key: block 1's key and token [9]), so the
prompt restores 9 slots and prefills from token 9.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from specdec.engine.disk_cache import DiskTier
from specdec.models.kv_cache import PAGE, KVCache

BLOCK_SIZE = 16  # tokens per block (vLLM's default)
MAX_RUNS = 8  # runs of consecutive pool blocks copied one by one; past that, one gathered copy
PARALLEL_READS = 64  # blocks read back from disk in one lookup from which two threads read them


@dataclass
class Block:
    id: int  # index in the pools
    caches: set[str] = field(default_factory=set)  # the names of the caches saved into it
    size: int = 0  # the tokens it holds: block_size, or fewer for a tail
    pages: dict[str, int] = field(default_factory=dict)  # mapped caches: the page of each that it holds
    key: bytes = b""  # its key in `PrefixCache.blocks` (a block's files on disk are named by it)


def root_key(salt: str | None) -> bytes:
    """What the first block's key extends: nothing, or the salt's hash."""
    return b"" if salt is None else hashlib.sha256(b"salt" + salt.encode()).digest()


def next_key(key: bytes, tokens) -> bytes:
    """The key of a block (or tail) holding `tokens` after the block keyed `key`."""
    return hashlib.sha256(key + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class Run(NamedTuple):
    """Consecutive pool blocks copied as one slice: the row's blocks [start, start + count) are the pool's
    [first_id, first_id + count)."""

    start: int
    first_id: int
    count: int


def _runs(ids: list[int], pages: list[int] | None = None) -> list[Run]:
    """Each run of consecutive ids (and, given `pages`, of consecutive pages at the same places: a run is then
    one slice of the pool and one of the cache). Example: [4, 5, 6, 0, 9, 10] -> (start, first id, count)
    (0, 4, 3), (3, 0, 1), (4, 9, 2); with pages [0, 1, 3, 4, 5, 6] -> (0, 4, 2), (2, 6, 1), (3, 0, 1), (4, 9, 2)."""
    runs: list[Run] = []
    for i, block_id in enumerate(ids):
        last = runs[-1] if runs else None
        if last and block_id == last.first_id + last.count and (pages is None or pages[i] == pages[i - 1] + 1):
            runs[-1] = last._replace(count=last.count + 1)
        else:
            runs.append(Run(i, block_id, 1))
    return runs


def block_keys(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The key of each whole block of `tokens`: the chain hash of the salt and of every token up to the block's end.

    Example: block_keys([1, 2, 3, 4, 5], 2) has 2 keys: sha256(tokens 1 2), then sha256(that + tokens 3 4).
    """
    ids = np.asarray(tokens, dtype=np.int64)
    key = root_key(salt)
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = next_key(key, ids[start:start + block_size])
        keys.append(key)
    return keys


class PrefixCache:
    """Blocks of K/V for the caches named in `caches` (their shapes, dtypes and devices), `num_blocks` at most;
    those named in `mapped` (each with `num_blocks` pages set aside in its pool) keep their blocks as pages."""

    def __init__(self, caches: dict[str, KVCache], num_blocks: int, block_size: int = BLOCK_SIZE,
                 mapped: tuple[str, ...] = (), disk: DiskTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a prefix cache needs at least one block, got {num_blocks}")
        if mapped and block_size != PAGE:
            raise ValueError(f"blocks of {block_size} tokens cannot be pages of {PAGE}: only copied caches")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.mapped = {name: caches[name] for name in mapped}
        self.held_pages: dict[str, set[int]] = {name: set() for name in mapped}  # the pages its blocks hold
        self._spare: list[Block] = []  # blocks evicted to give their pages to rows, to be handed out again
        for name, cache in self.mapped.items():
            if cache.prefix_pages < num_blocks:
                raise ValueError(f"a mapped cache must set {num_blocks} pages aside, it sets {cache.prefix_pages}")
            cache.reclaim = lambda n, name=name: self.reclaim(name, n)
        self.pools = {}  # name -> [num_blocks, 2 * layers (keys, then values), kv_heads, block_size, head_dim]
        for name, cache in caches.items():
            if name in self.mapped:
                continue
            _, kv_heads, _, head_dim = cache.keys[0].shape  # [pages, kv_heads, PAGE, head_dim]
            shape = (num_blocks, 2 * len(cache.keys), kv_heads, block_size, head_dim)
            self.pools[name] = torch.empty(shape, dtype=cache.keys[0].dtype, device=cache.keys[0].device)
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._used = 0  # blocks ever handed out; past num_blocks, a block is had by evicting one
        self.disk = disk  # the target's whole blocks, written through and read back on a miss
        self.from_disk = 0  # blocks at the end of the last lookup's chain that came from disk
        self.tail_from_disk = False  # whether the last tail found came from disk
        self._byte_views: dict[str, tuple[int, list]] = {}  # `_views`
        self._pool: ThreadPoolExecutor | None = None  # `_read_blocks`' threads

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    def keys(self, tokens: list[int], salt: str | None = None, tail: bool = False) -> list[bytes]:
        """The keys of the whole blocks of `tokens`, and with `tail` that of the tokens past them, if any."""
        keys = block_keys(tokens, self.block_size, salt)
        rest = len(tokens) - len(keys) * self.block_size
        if tail and rest:
            keys.append(next_key(keys[-1] if keys else root_key(salt), tokens[-rest:]))
        return keys

    def lookup(self, keys: list[bytes]) -> list[Block]:
        """The cached blocks of the longest chain of `keys` from the first (touched: most recently used)."""
        chain = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None or block.size < self.block_size:
                break
            chain.append(block)
        self.from_disk = 0
        if self.disk is not None and len(chain) < len(keys):
            read = self._read_disk(keys[len(chain):], {block.id for block in chain})
            self.from_disk = len(read)
            chain += read
        self._touch(keys[:len(chain)])
        return chain

    def _read_disk(self, keys: list[bytes], keep: set[int]) -> list[Block]:
        """The blocks of `keys` (from the first, as long as each is on disk and intact) read into RAM blocks."""
        out: list[Block] = []
        file = self.disk.names["target"]
        for key in keys:  # the chain's blocks on disk, each given a RAM block, then all read side by side
            if not self.disk.has(key, file):
                break
            block = self._allocate(key, keep, self.block_size)
            if block is None:
                break
            keep.add(block.id)
            out.append(block)
        read = self._read_blocks("target", out, file)
        for block in out[read:]:  # past a block that failed (removed meanwhile, damaged, or no page free)
            self._drop_pages(block)
            block.caches.clear()
            del self.blocks[block.key]
            self._spare.append(block)
        return out[:read]

    def _read_blocks(self, name: str, blocks: list[Block], file: str) -> int:
        """Read `blocks` of cache `name` back from the disk tier (`_read_block`), in two threads where there are
        many (the reads and checksums release the GIL: 20k tokens of the default target's in ~0.6 s rather than
        ~0.9 s on 2 cores); how many from the first were read."""
        if len(blocks) < PARALLEL_READS or (os.cpu_count() or 1) < 2:
            return next((i for i, block in enumerate(blocks) if not self._read_block(name, block, file)), len(blocks))
        cache = self.mapped.get(name)
        pages = [cache.take_page() for _ in blocks] if cache is not None else [None] * len(blocks)
        if None in pages and cache is not None:  # no page free for some: read as far as there are
            for page in pages[pages.index(None):]:
                if page is not None:
                    cache.release(page)
            pages = pages[:pages.index(None)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="specdec-kv-read")
        self._views(name)  # (made here, not in the threads)
        ok = list(self._pool.map(lambda bp: self._read_block(name, bp[0], file, bp[1]), zip(blocks, pages)))
        return next((i for i, good in enumerate(ok) if not good), len(ok))

    def _read_block(self, name: str, block: Block, file: str, page: int | None = None) -> bool:
        """Read the whole block `block` of cache `name` back from the disk tier's `file` into its page (a mapped
        cache) or its pool's block: on a CPU straight from the file into them (`DiskTier.read_into`: 20k
        tokens of the default target's in ~0.9 s where reading, parsing and copying a layer at a time took
        ~1.7 s), else read then copied (`_fill`). False where it is not there, fails its checks or does not fit."""
        cache = self.mapped.get(name)
        dest = cache.keys[0] if cache is not None else self.pools[name]
        if dest.device.type != "cpu" or not all(t.is_contiguous() for t in (dest, *(cache.values if cache else ()))):
            if page is not None:
                cache.release(page)
            got = self.disk.read(block.key, file)
            return got is not None and got.tokens == block.size and self._fill(name, block, got.data)
        views = self._views(name)
        if cache is not None:
            page = cache.take_page() if page is None else page  # (given: taken for it, `_read_blocks`)
            if page is None:
                return False
            buffers, shape = [v[page] for v in views], (len(views), *dest.shape[1:])
        else:
            buffers, shape = [views[0][block.id]], tuple(dest.shape[1:])
        tokens = self.disk.read_into(block.key, file, buffers, dest.dtype, shape)
        if tokens != block.size:
            if cache is not None:
                cache.release(page)
            return False
        if cache is not None:
            block.pages[name] = page
            self.held_pages[name].add(page)
        block.caches.add(name)
        return True

    def _views(self, name: str) -> list:
        """Byte views (numpy) of cache `name`'s tensors, each layer's keys then values, or of its pool: what a
        block is read into. Kept while the tensors are the same."""
        cache = self.mapped.get(name)
        tensors = cache.keys + cache.values if cache is not None else [self.pools[name]]
        ptr = tensors[0].data_ptr()
        kept = self._byte_views.get(name)
        if kept is None or kept[0] != ptr:
            kept = self._byte_views[name] = (ptr, [t.view(torch.uint8).numpy() for t in tensors])
        return kept[1]

    def _fill(self, name: str, block: Block, data: torch.Tensor) -> bool:
        """Put `data` (a whole block of cache `name`, as `_block_data` gives it) into `block`; False if it does
        not fit the cache or no page is free."""
        cache = self.mapped.get(name)
        if cache is not None:
            layers = len(cache.keys)
            want = (2 * layers, *cache.keys[0].shape[1:])
            if tuple(data.shape) != want or data.dtype != cache.keys[0].dtype:
                return False
            page = cache.take_page()
            if page is None:
                return False
            data = data.to(cache.keys[0].device)
            for layer, kv in enumerate(cache.keys + cache.values):
                kv[page].copy_(data[layer])
            block.pages[name] = page
            self.held_pages[name].add(page)
        else:
            pool = self.pools[name]
            if tuple(data.shape) != tuple(pool.shape[1:]) or data.dtype != pool.dtype:
                return False
            pool[block.id].copy_(data)
        block.caches.add(name)
        return True

    def _block_data(self, name: str, block: Block) -> torch.Tensor:
        """Block `block` of cache `name` as one tensor [2 * layers (keys, then values), kv_heads, size, head_dim]."""
        cache = self.mapped.get(name)
        if cache is not None:
            page = block.pages[name]
            return torch.stack([kv[page] for kv in cache.keys + cache.values])
        return self.pools[name][block.id]

    def tail(self, name: str, keys: list[bytes], tokens: list[int], salt: str | None = None) -> Block | None:
        """The longest tail holding cache `name` cached after the chain of whole blocks `keys` (as `lookup` found
        it; salted with `salt`) whose tokens are all the first of `tokens`, or None. Found, it is touched with
        the chain, as its deepest block.

        Example (block size 4), after block [1 2 3 4], tokens [5 6 7]: tails [5 6 7], [5 6], then [5]."""
        after = keys[-1] if keys else root_key(salt)
        ids = np.asarray(tokens[:self.block_size - 1], dtype=np.int64)
        tails = [next_key(after, ids[:n]) for n in range(len(ids), 0, -1)]
        for key in tails:
            block = self.blocks.get(key)
            if block is not None and name in block.caches:
                self._touch(keys + [key])
                return block
        file = self.disk.names.get(name) if self.disk is not None else None
        self.tail_from_disk = False
        for n, key in zip(range(len(ids), 0, -1), tails if file is not None else []):  # a tail on disk
            if key in self.blocks or not self.disk.has(key, file):
                continue
            block = self._allocate(key, {self.blocks[k].id for k in keys if k in self.blocks}, n)
            if block is None:
                return None
            if self._read_block(name, block, file):
                self._touch(keys + [key])
                self.tail_from_disk = True
                return block
            del self.blocks[key]
            self._spare.append(block)
        return None

    def held(self, name: str, chain: list[Block]) -> int:
        """How many blocks from the first of `chain` hold cache `name`: those in RAM, then, where the disk tier
        keeps that cache, the next ones whose blocks of it are read back from disk (a restarted process finds a
        draft model's K/V and EAGLE's pairs there as the target's: reading them back costs a fraction of a
        second for 20k tokens, where recomputing a draft model's costs a prefill of its own, and EAGLE's a
        prefill of the target for its features)."""
        n = next((i for i, block in enumerate(chain) if name not in block.caches), len(chain))
        file = self.disk.names.get(name) if self.disk is not None else None
        while file is not None and n < len(chain) and chain[n].size == self.block_size:
            if not self._read_block(name, chain[n], file):
                break
            n += 1
        return n

    def save(self, name: str, keys: list[bytes], cache: KVCache, row: int, shift: int = 0, tail: int = 0) -> None:
        """Copy `row` of `cache` into the blocks `keys` (a chain from block 0) that do not hold `name` yet (a
        mapped cache: hold the row's pages as those blocks), adding missing blocks (evicting the least recently
        used ones, never one of this chain's: the chain is cut there instead). With `tail` > 0 the last key is a tail's, of that many tokens (`keys(..., tail=True)`)."""
        B = self.block_size
        chain: list[Block] = []
        in_chain: set[int] = set()
        for i, key in enumerate(keys):
            block = self.blocks.get(key)
            if block is None:
                block = self._allocate(key, in_chain, tail if tail and i == len(keys) - 1 else B)
                if block is None:
                    break
            self.blocks.move_to_end(key)
            chain.append(block)
            in_chain.add(block.id)
        todo = [(i, block) for i, block in enumerate(chain) if name not in block.caches]
        self._touch(keys[:len(chain)])
        if not todo:
            return
        if name in self.mapped:
            self._check_mapped(name, cache, shift)
            for i, block in todo:  # (the row holds a page for each slot it committed)
                block.pages[name] = cache.pages[row][i]
                cache.hold(block.pages[name])
                self.held_pages[name].add(block.pages[name])
                block.caches.add(name)
            self._write_disk(name, keys, todo)
            return
        device = cache.table.device  # (a tail's slots past its tokens are copied too, never read)
        pool, m, ids = self.pools[name], len(todo), [block.id for _, block in todo]
        index = torch.tensor(ids, device=device)
        if shift == 0 and B == PAGE and todo[-1][0] < len(cache.pages[row]):
            # block i is page i of the row, in the same layout ([kv_heads, B, head_dim]): each layer's pages
            # copied into the pool's blocks, a slice per run of both (10k tokens on 2 AVX2 cores: 0.35 s through
            # gathered and stacked copies of a row's slots, 0.11 s as runs of blocks)
            pages = [cache.pages[row][i] for i, _ in todo]
            runs = _runs(ids, pages)
            page_index = torch.tensor(pages, device=device) if len(runs) > MAX_RUNS else None
            for layer, kv in enumerate(cache.keys + cache.values):
                if page_index is None:
                    for start, first_id, count in runs:
                        pool[first_id:first_id + count, layer].copy_(kv[pages[start]:pages[start] + count])
                else:
                    pool.select(1, layer).index_copy_(0, index, kv.index_select(0, page_index))
        else:
            slots = torch.tensor([i * B + t - shift for i, _ in todo for t in range(B)], device=device)
            slots.clamp_(min=0, max=len(cache.pages[row]) * PAGE - 1)
            page, offset = cache.locate(slots, row)
            src = torch.stack([kv[page, :, offset] for kv in cache.keys + cache.values])  # [2 * layers, m * B, kv, hd]
            pool.index_copy_(0, index, src.unflatten(1, (m, B)).permute(1, 0, 3, 2, 4))
        for _, block in todo:
            block.caches.add(name)
        self._write_disk(name, keys, todo)

    def _write_disk(self, name: str, keys: list[bytes], todo: list[tuple[int, Block]]) -> None:
        """Write the newly saved blocks (and tail) of cache `name` through to the disk tier, if it keeps that
        cache."""
        file = self.disk.names.get(name) if self.disk is not None else None
        if file is None:
            return
        for i, block in todo:  # (a tail's slots past its tokens are written too, never read)
            self.disk.write(keys[i], file, self._block_data(name, block), block.size)

    def load(self, name: str, chain: list[Block], cache: KVCache, row: int, shift: int = 0,
             tail: Block | None = None) -> int:
        """Copy the blocks of `chain` (from block 0; each holding `name`), then `tail`'s tokens if given, into
        `row` of `cache` (a mapped cache: map their pages) and set the row's length: the number of slots
        restored, the blocks' tokens - shift."""
        blocks = chain + [tail] if tail is not None else chain
        n = sum(block.size for block in blocks) - shift
        cache.clear(row)
        if n <= 0:
            return 0
        if name in self.mapped:  # the blocks' pages become the row's first ones: nothing copied
            self._check_mapped(name, cache, shift)
            cache.map(row, [block.pages[name] for block in blocks])
            cache.advance(row, n)
            return n
        B, m, pool = self.block_size, len(blocks), self.pools[name]
        device = cache.table.device
        if shift == 0 and B == PAGE:
            # block i into page i of the row, each layer's blocks copied straight into the row's pages (10k
            # tokens on 2 AVX2 cores: 0.16 s through a gathered copy of the blocks, 0.05 s so)
            cache.reserve(row, m * B)
            pages, ids = cache.pages[row][:m], [block.id for block in blocks]
            runs = _runs(ids, pages)
            if len(runs) > MAX_RUNS:
                page_index, index = torch.tensor(pages, device=device), torch.tensor(ids, device=device)
            for layer, kv in enumerate(cache.keys + cache.values):
                if len(runs) <= MAX_RUNS:  # a slice per run of both
                    for start, first_id, count in runs:
                        kv[pages[start]:pages[start] + count].copy_(pool[first_id:first_id + count, layer])
                else:
                    kv.index_copy_(0, page_index, pool.select(1, layer).index_select(0, index))
        else:
            cache.reserve(row, n)
            ids = torch.tensor([block.id for block in blocks], device=device)
            data = pool.index_select(0, ids)  # [m, 2 * layers, kv_heads, B, head_dim]
            data = data.permute(1, 0, 3, 2, 4).flatten(1, 2)[:, shift:shift + n]  # [2 * layers, n, kv_heads, head_dim]
            page, offset = cache.locate(torch.arange(n, device=device), row)
            for layer, kv in enumerate(cache.keys + cache.values):
                kv[page, :, offset] = data[layer]
        cache.advance(row, n)
        return n

    def clear(self) -> None:
        for block in self.blocks.values():
            self._drop_pages(block)
        self.blocks.clear()
        self._spare.clear()
        self._used = 0

    def _check_mapped(self, name: str, cache: KVCache, shift: int) -> None:
        if cache is not self.mapped[name] and cache.keys is not self.mapped[name].keys:
            raise ValueError(f"cache {name!r} is mapped: its blocks are pages of the cache it was created with")
        if shift:
            raise ValueError(f"cache {name!r} is mapped: its slots hold their own tokens' K/V (shift 0), not {shift}")

    def reclaim(self, name: str, n: int) -> int:
        """Evict the least recently used blocks that no row holds until `n` pages of cache `name` are free again
        (or none is left to evict): a row's pass needs them. Returns how many pages were freed."""
        freed = 0
        for key, block in list(self.blocks.items()):
            if freed >= n:
                break
            if name in block.pages and not self._in_use(block):
                del self.blocks[key]
                block.caches.clear()
                self._drop_pages(block)
                self._spare.append(block)
                freed += 1
        return freed

    def pinned(self, name: str) -> int:
        """Pages of cache `name` that the blocks hold and a row holds too (no eviction can free them)."""
        cache = self.mapped.get(name)
        return 0 if cache is None else sum(cache.refs[page] > 1 for page in self.held_pages[name])

    def shared(self, name: str, pages: list[int]) -> int:
        """How many of `pages` (a row's, of cache `name`) are pages the blocks hold: memory counted as the
        prefix cache's, not the row's (`Scheduler`)."""
        held = self.held_pages.get(name)
        return sum(page in held for page in pages) if held else 0

    def _in_use(self, block: Block) -> bool:
        """Whether a row holds one of the pages of `block` too."""
        return any(self.mapped[name].refs[page] > 1 for name, page in block.pages.items())

    def _drop_pages(self, block: Block) -> None:
        for name, page in block.pages.items():
            self.mapped[name].release(page)
            self.held_pages[name].discard(page)
        block.pages.clear()

    def _allocate(self, key: bytes, keep: set[int], size: int) -> Block | None:
        if self._spare:
            block = self._spare.pop()
        elif self._used < self.num_blocks:
            block = Block(self._used)
            self._used += 1
        else:
            victim_key, block = next(((k, b) for k, b in self.blocks.items() if not self._in_use(b)), (None, None))
            if block is None or block.id in keep:
                return None
            del self.blocks[victim_key]
            block.caches.clear()
            self._drop_pages(block)
        block.size, block.key = size, key
        self.blocks[key] = block
        return block

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block ends most recently used: chains lose their tails first
            self.blocks.move_to_end(key)
