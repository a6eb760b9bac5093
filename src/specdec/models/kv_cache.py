"""A paged KV cache: rows of slots backed by pages of a pool, O(1) rollback, gather-commit for tree drafts.

Layout per layer: keys and values of shape [num_pages, num_kv_heads, PAGE, head_dim], a pool of pages of
PAGE slots. Row b holds one sequence: its slots are those of its pages, in order (`pages[b]`; slot s is
row s % PAGE of page `pages[b][s // PAGE]`), and `lengths[b]` of them are committed. A row takes pages from
the pool as it grows (`reserve`, called by the forward pass for the slots it writes) and gives them back
when it is cleared, so rows of very different lengths share one pool: no row reserves `capacity` (the
longest a row may grow) ahead. A forward pass writes the K/V of its new tokens into slots
`[lengths[b], lengths[b] + T)` without committing them; lengths move only through this class's methods
(`advance`, `truncate`, `clear`, `commit` gathering kept slots into place, `move_row`).

Rollback is free: truncate moves a length; rejected slots are simply overwritten by the next pass and
hidden by the attention mask until then (the row keeps its pages until it is cleared).

Example (one sequence): lengths = [10]; a verification pass writes 6 slots 10..15 (the row's first page
holds slots 0..15); the first 3 are accepted -> `advance(0, 3)`, lengths = [13]; slots 13..15 are dead
and will be overwritten.
Tree example: a pass wrote 7 tree nodes into slots 10..16 (a second page taken for slot 16) and the
accepted path is nodes 0, 2, 5 -> `commit(0, [0, 2, 5])` copies slots 12, 15 to 11, 12 and sets
lengths = [13].
Pool example: 3 rows, a pool of 8 pages of 16: row 0 holds 100 tokens (7 pages), row 1 holds 10 (1 page),
row 2 nothing: row 2 can take no page until a row is cleared.

Shared pages: a page may be held by several rows and by the prefix cache at once (`refs` counts its
holders; it is free when none holds it). The prefix cache keeps a finished sequence's whole blocks as the
pages its row wrote (`hold`), and a request that finds them cached maps them into its row (`map`) instead of
copying them. A row never writes a page another holds: a pass writing slots of a shared page first gives
the row a copy of it (copy on write, `reserve`), so what the others read keeps its bits.
Example: row 0 holds pages [3, 8] (20 tokens); the prefix cache holds both (refs 2 each); row 0 leaves
(refs 1: page 3 and 8 stay cached); row 1 maps them for a prompt of the same 20 tokens and more: its
first write, at slot 20 in page 8, copies page 8 into a free page, which the row writes instead.
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.config import KV_FORMATS, ModelConfig

KEY_BLOCK = 64  # attention key length granularity (see models.llama): row capacities are multiples of it
PAGE = 16  # slots a page (the prefix cache's block: vLLM's default block size)
Q8_BLOCK = 32


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of a Q8_0 K/V row: the int8 values, then an fp16 scale per 32."""
    return head_dim + head_dim // Q8_BLOCK * 2


def q8_encode(x: torch.Tensor) -> torch.Tensor:
    """K/V rows [..., D] -> their Q8_0 bytes, int8 [..., D + D / 16] (kernels/csrc/ops/kv_quant.h, the same IEEE
    operations): for each 32 values d = fp16(max |x| / 127), q = round(x / d) to nearest even, clamped to
    +-127, 0 where d = 0. Each row alone, so a token's bytes do not depend on the pass that wrote it."""
    D = x.shape[-1]
    xf = x.float().unflatten(-1, (D // Q8_BLOCK, Q8_BLOCK))
    d = (xf.abs().amax(-1) / 127.0).half()
    df = d.float()
    inv = torch.where(df != 0, 1.0 / torch.where(df != 0, df, 1.0), 0.0)
    q = torch.round(xf * inv[..., None]).clamp(-127, 127).to(torch.int8).flatten(-2)
    return torch.cat([q, d.view(torch.int8)], -1)


def q8_decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q8_0 rows [..., D + D / 16] -> their values q * d [..., D] (exact in fp32), in `dtype`."""
    D = rows.shape[-1] * Q8_BLOCK // (Q8_BLOCK + 2)
    q = rows[..., :D].float().unflatten(-1, (D // Q8_BLOCK, Q8_BLOCK))
    d = rows[..., D:].contiguous().view(torch.float16).float()
    return (q * d[..., None]).flatten(-2).to(dtype)


class KVCacheFull(RuntimeError):
    """The pool has no page left for a slot a pass must write."""


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_pages: int | None = None,
        kv_format: str = "auto",
    ) -> None:
        """`batch_size` rows of up to `capacity` slots each (whole attention key blocks), sharing `num_pages`
        pages (default: enough for every row at full capacity). `kv_format`: "auto" (rows of `dtype`) or "q8_0"
        (each row's Q8_0 bytes, `q8_encode`: written through `store`, read through `gather`, the attention
        kernel reading them as they are)."""
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv cache dtype {kv_format!r}: choose one of {', '.join(KV_FORMATS)}")
        if kv_format == "q8_0" and config.head_dim % Q8_BLOCK:
            raise ValueError(f"a q8_0 K/V cache needs a head size that is a multiple of {Q8_BLOCK} "
                             f"(this model's: {config.head_dim})")
        capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK  # whole attention key blocks
        num_pages = batch_size * capacity // PAGE if num_pages is None else num_pages
        self.dtype, self.kv_format = dtype, kv_format
        width = config.head_dim if kv_format == "auto" else q8_row_bytes(config.head_dim)
        shape = (num_pages, config.num_key_value_heads, PAGE, width)
        stored = dtype if kv_format == "auto" else torch.int8
        # (allocated, not written: a page is zeroed when first handed out, so a pool set aside for the prefix
        # cache, or for long rows, takes memory only as it is used)
        self.keys = [torch.empty(shape, dtype=stored, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.empty(shape, dtype=stored, device=device) for _ in range(config.num_hidden_layers)]
        self.zeroed = [False] * num_pages  # pages written since allocation (the others may hold any bits)
        self._zero(0)
        self.capacity = capacity
        self.batch_size = batch_size
        self.lengths = [0] * batch_size  # committed slots per row
        self.pages: list[list[int]] = [[] for _ in range(batch_size)]  # each row's pages, in slot order
        self.free = list(range(num_pages - 1, -1, -1))  # pages no one holds (taken from the end: low ids first)
        self.refs = [0] * num_pages  # each page's holders: rows, and the prefix cache
        self.prefix_pages = 0  # pages set aside for the prefix cache's blocks
        # the prefix cache's, for a cache whose blocks are its pages: free n pages by evicting cached blocks that
        # no row holds (rows may then take the whole pool, as vLLM's cached blocks are free ones)
        self.reclaim: Callable[[int], None] | None = None
        # each row's pages as the kernels read them ([rows, capacity // PAGE]; past a row's pages: page 0,
        # whose slots are never visible there, but read as masked keys: finite, as every page handed out)
        self.table = torch.zeros(batch_size, capacity // PAGE, dtype=torch.long, device=device)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_format: str = "auto") -> int:
        """Memory one token takes in the cache of a model (keys and values, all layers)."""
        row = (config.head_dim * torch.empty((), dtype=dtype).element_size() if kv_format == "auto"
               else q8_row_bytes(config.head_dim))
        return 2 * config.num_hidden_layers * config.num_key_value_heads * row

    def store(self, layer: int, page: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K/V [B, T, KV, D] at (page, offset) [B, T] of `layer` (encoded in the cache's format)."""
        if self.kv_format == "q8_0":
            k, v = q8_encode(k), q8_encode(v)
        else:  # rounded to the cache's dtype (an fp32 residual stream over a bf16 cache)
            k, v = k.to(self.keys[layer].dtype), v.to(self.values[layer].dtype)
        self.keys[layer][page, :, offset] = k
        self.values[layer][page, :, offset] = v

    @staticmethod
    def pages_for(slots: int) -> int:
        """Pages that hold `slots` slots."""
        return -(-slots // PAGE)

    @property
    def num_pages(self) -> int:
        return self.keys[0].shape[0]

    @property
    def row_pages(self) -> int:
        """Pages the running rows are admitted to (`Scheduler`): the whole pool where rows may evict the prefix
        cache's blocks (`reclaim`), else the pool less the prefix cache's share."""
        return self.num_pages if self.reclaim is not None else self.num_pages - self.prefix_pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # ----------------------------------------------------------------------------------- lengths
    def truncate(self, row: int, length: int) -> None:
        """Forget everything after `length` committed slots of `row` (O(1); the row keeps its pages)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def clear(self, row: int) -> None:
        """Free `row`: nothing in it is committed, and its pages go back to the pool."""
        self.lengths[row] = 0
        self._give_back(row)

    def advance(self, row: int, n: int) -> None:
        """Commit the first `n` slots written after the committed prefix of `row`."""
        if self.lengths[row] + n > self.capacity:
            raise ValueError(f"KV cache row {row} would exceed its capacity of {self.capacity} tokens")
        if self.lengths[row] + n > len(self.pages[row]) * PAGE:
            raise ValueError(f"KV cache row {row}: slots up to {self.lengths[row] + n} were never written")
        self.lengths[row] += n

    # ----------------------------------------------------------------------------------- pages
    def reserve(self, row: int, slots: int, start: int | None = None) -> None:
        """Make `row`'s slots [start, slots) writable (`start`: default the row's length): give it the pages it
        lacks for its first `slots` slots, from the pool, and a copy of each page there that others hold."""
        if slots > self.capacity:
            raise ValueError(f"sequence of {slots} tokens exceeds the KV cache capacity of {self.capacity}")
        pages, need = self.pages[row], self.pages_for(slots)
        first = (self.lengths[row] if start is None else start) // PAGE
        shared = [i for i in range(first, min(need, len(pages))) if self.refs[pages[i]] > 1]
        if need - len(pages) + len(shared) > len(self.free) and self.reclaim is not None:
            self.reclaim(need - len(pages) + len(shared) - len(self.free))
        if need - len(pages) + len(shared) > len(self.free):
            raise KVCacheFull(f"the KV cache has {len(self.free)} free pages of {PAGE} slots; row {row} needs "
                              f"{need - len(pages) + len(shared)} more")
        for i in shared:
            self._copy_on_write(row, i)
        fresh = []
        while len(pages) < need:
            page = self.free.pop()
            if not self.zeroed[page]:  # (masked slots are read: they must hold finite values)
                fresh.append(page)
            self.refs[page] = 1
            self.table[row, len(pages)] = page
            pages.append(page)
        if fresh:
            self._zero(*fresh)

    def pages_to_take(self, row: int, slots: int, start: int | None = None) -> int:
        """Pages of the pool that `reserve(row, slots, start)` takes: those `row` lacks for its first `slots` slots,
        and a copy of each page of slots [start, slots) that others hold. Example: a row of 20 committed slots
        holding 2 pages, none shared -> 0 for 32 slots, 1 for 33."""
        pages, need = self.pages[row], self.pages_for(slots)
        first = (self.lengths[row] if start is None else start) // PAGE
        return max(0, need - len(pages)) + sum(self.refs[pages[i]] > 1 for i in range(first, min(need, len(pages))))

    def reserve_slots(self, slots: torch.Tensor) -> None:
        """Reserve what writing `slots` [B, T] (row b's slots in row b) needs."""
        for row, (first, last) in enumerate(zip(slots.amin(1).tolist(), slots.amax(1).tolist())):
            self.reserve(row, last + 1, first)

    def map(self, row: int, pages: list[int]) -> None:
        """Give the empty `row` these pages (held by others: the prefix cache's) as its first ones, shared."""
        if self.pages[row]:
            raise ValueError(f"cannot map pages into row {row}: it holds {len(self.pages[row])} pages")
        if len(pages) * PAGE > self.capacity:
            raise ValueError(f"{len(pages)} pages exceed the KV cache capacity of {self.capacity}")
        for page in pages:
            self.refs[page] += 1
        self.table[row, :len(pages)] = torch.tensor(pages, dtype=torch.long)
        self.pages[row].extend(pages)

    def hold(self, page: int) -> None:
        """One more holder (the prefix cache) of `page`, which a row holds now."""
        if self.refs[page] < 1:
            raise ValueError(f"page {page} is free: only a page a row holds can be held")
        self.refs[page] += 1

    def take_page(self) -> int | None:
        """A free page for the prefix cache to hold (one holder), whose slots it then writes whole (a block read
        back from disk); None when no page is free."""
        if not self.free:
            return None
        page = self.free.pop()
        self.refs[page] = 1
        self.zeroed[page] = True  # (all its slots are written at once)
        return page

    def release(self, page: int) -> None:
        """One holder fewer of `page`: free when none is left."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)

    def _copy_on_write(self, row: int, i: int) -> None:
        """Give `row` a copy of its page i, which others hold too (a free page must be left)."""
        old, new = self.pages[row][i], self.free.pop()
        for kv in self.keys + self.values:
            kv[new].copy_(kv[old])
        self.refs[new] = 1
        self.zeroed[new] = True
        self.release(old)
        self.pages[row][i] = new
        self.table[row, i] = new

    def page_table(self, rows: int, slots: int) -> torch.Tensor:
        """The pages of rows 0..rows-1 holding their first `slots` slots, [rows, slots / PAGE] (a view)."""
        return self.table[:rows, :self.pages_for(slots)]

    def locate(self, slots: torch.Tensor, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each slot of `slots` [B, T] (of rows 0..B-1), or of `slots` [n] of `row`."""
        table = self.table if row is None else self.table[row]
        pages = torch.gather(table[:slots.shape[0]], 1, slots // PAGE) if row is None else table[slots // PAGE]
        return pages, slots % PAGE

    def gather(self, layer_cache: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
        """Slots 0..slots-1 of rows 0..rows-1 of one layer's keys or values, [rows, KV, slots, D] (a copy, in
        the activations' dtype)."""
        pages = self.page_table(rows, slots)  # [B, n]
        data = layer_cache[pages]  # [B, n, KV, PAGE, D]
        data = data.transpose(1, 2).flatten(2, 3)[:, :, :slots]
        return q8_decode(data, self.dtype) if self.kv_format == "q8_0" else data

    def _zero(self, *pages: int) -> None:
        index = torch.tensor(pages, device=self.keys[0].device) if len(pages) > 1 else None
        for kv in self.keys + self.values:
            if index is None:
                kv[pages[0]].zero_()
            else:
                kv.index_fill_(0, index, 0)
        for page in pages:
            self.zeroed[page] = True

    def trim(self, row: int, slots: int) -> None:
        """Give back the pages of `row` past its first `slots` slots and its committed ones (pages that a wide
        pass's pads took: a row padded to a riding prompt chunk's width). Example: a row of 20 committed slots
        holding 4 pages, trimmed to 24 slots, keeps 2."""
        keep = self.pages_for(max(slots, self.lengths[row]))
        pages = self.pages[row]
        while len(pages) > keep:
            self.release(pages.pop())

    def _give_back(self, row: int) -> None:
        for page in reversed(self.pages[row]):
            self.release(page)
        self.pages[row].clear()

    # ----------------------------------------------------------------------------------- rows
    def commit(self, row: int, indices: list[int]) -> None:
        """Keep the pending slots `indices` (offsets past the committed prefix, increasing) in that order.

        Offsets that are already in place (a chain, or a tree path that starts on the main branch) are
        not copied.
        """
        start = self.lengths[row]
        first_moved = next((i for i, idx in enumerate(indices) if idx != i), len(indices))
        if first_moved < len(indices):
            device = self.table.device
            src = self.locate(torch.tensor(indices[first_moved:], device=device) + start, row)
            dst = self.locate(torch.arange(start + first_moved, start + len(indices), device=device), row)
            for kv in self.keys + self.values:
                kv[dst[0], :, dst[1]] = kv[src[0], :, src[1]]
        self.advance(row, len(indices))

    def reshape(self, batch_size: int, capacity: int, num_pages: int | None = None) -> None:
        """Reallocate as `batch_size` rows of up to `capacity` slots sharing `num_pages` pages (default: every
        row at full capacity), keeping what the rows that remain hold. Rows dropped and slots cut must hold
        nothing committed, and no page may be shared (the prefix cache holds none yet). Example: 8 rows of 4096 ->
        reshape(1, 32768): row 0 keeps its slots."""
        capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        if any(n > 1 for n in self.refs):
            raise ValueError("cannot reshape a KV cache whose pages are shared")
        if any(self.lengths[batch_size:]) or max(self.lengths[:batch_size], default=0) > capacity:
            raise ValueError(f"cannot reshape a KV cache holding rows of lengths {self.lengths} to "
                             f"{batch_size} rows of {capacity} slots")
        num_pages = batch_size * capacity // PAGE if num_pages is None else num_pages
        rows = min(batch_size, self.batch_size)
        kept = [self.pages[r][:self.pages_for(self.lengths[r])] for r in range(rows)]
        if sum(map(len, kept)) > num_pages:
            raise ValueError(f"cannot reshape a KV cache holding {sum(map(len, kept))} pages to {num_pages} pages")
        old = list(zip(self.keys, self.values))
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                tensors[i] = t.new_empty((num_pages, *t.shape[1:]))
        self.capacity, self.batch_size = capacity, batch_size
        self.lengths = self.lengths[:rows] + [0] * (batch_size - rows)
        self.pages = [[] for _ in range(batch_size)]
        self.free = list(range(num_pages - 1, -1, -1))
        self.refs = [0] * num_pages
        self.zeroed = [False] * num_pages
        self._zero(0)
        self.table = torch.zeros(batch_size, capacity // PAGE, dtype=torch.long, device=self.table.device)
        for row, pages in enumerate(kept):
            self.reserve(row, len(pages) * PAGE)
            if pages:
                src = torch.tensor(pages, device=self.table.device)
                dst = self.table[row, :len(pages)]
                for (k_old, v_old), k, v in zip(old, self.keys, self.values):
                    k[dst] = k_old[src]
                    v[dst] = v_old[src]

    def row_view(self, row: int) -> "KVCache":
        """A one-row cache sharing this cache's pool, and `row`'s pages (what it reserves is the row's; its
        length is its own: the caller copies the length back)."""
        view = KVCache.__new__(KVCache)
        view.keys, view.values, view.free, view.refs = self.keys, self.values, self.free, self.refs
        view.zeroed, view.reclaim = self.zeroed, self.reclaim
        view.dtype, view.kv_format = self.dtype, self.kv_format
        view.prefix_pages = self.prefix_pages
        view.capacity, view.batch_size, view.lengths = self.capacity, 1, [self.lengths[row]]
        view.pages, view.table = [self.pages[row]], self.table[row:row + 1]
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Move row `src` onto row `dst` (used to keep running sequences packed in rows 0..B-1): its pages change
        hands, nothing is copied; `dst`'s own pages go back to the pool, and `src` is left empty."""
        if src == dst:
            return
        self._give_back(dst)
        self.pages[dst], self.pages[src] = self.pages[src], []
        self.table[dst] = self.table[src]
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0
