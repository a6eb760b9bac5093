"""Who runs, and in which cache row: a waiting queue, a packed batch, one sequence joining at a time.

Requests wait in arrival order. Up to `max_batch_size` run, in cache rows 0..B-1 of every cache (the
target's, and a proposer's own); one sequence at a time joins through chunked prefill, in row B (the row
after the running ones). When a running sequence leaves, the last running one takes its row and the
joining one, if any, the row after them: rows stay packed, so a decoding pass covers rows 0..B-1.

Example: a, b, c running in rows 0, 1, 2 and d joining in row 3; b leaves -> c moves to row 1, d to row 2.

Rows are paged (`KVCache`): a row takes pages of its cache's pool as its sequence grows and gives them back when
it leaves, so sequences of any lengths run side by side while their pages fit the pool. As in vLLM, a sequence is
admitted by what it holds now, not by what it may come to hold: it joins when the pages of the running
sequences' and its own current lengths (+ the widest draft: what the next pass writes) fit every cache's pool
with a watermark to spare (1% of the pool, a page at least), and the requests behind it wait (first come, first
served). `max_tokens` reserves nothing: requests that ask for 30k output tokens each, as agents do, run
together while what they have written fits. When the running sequences outgrow the pool, the newest is
**preempted** (`victim`): its row is freed and it waits at the head of the queue, to join again with all its
tokens so far as its prompt (recomputed: the kernels give a row the same bits whatever its chunks, so its
output is the same). Example: a pool of 32768 slots, 8 rows; a 30k-token prompt joins beside two short
requests if their lengths and its own add up to less than 32768 less the watermark, and waits for them
otherwise; if the three then grow past 32768, the newest of them steps out until the others leave room.

A running sequence's whole pages that the prefix cache holds (a prompt it found cached, mapped into its row,
or its own prompt's blocks, kept for later requests) count as the prefix cache's memory, not its own (`shared`):
sequences sharing a long prompt hold it once. Example: pages of 16, a 4,096-slot pool and a 2,048-token system
prompt: four requests of it with 256 tokens each written fit together, where alone each would count 2,304.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from specdec.models.kv_cache import PAGE, KVCache


class Scheduled(Protocol):
    request_id: str
    row: int


class Scheduler:
    def __init__(self, max_batch_size: int, caches: list[KVCache],
                 need: Callable[[Scheduled], int] = lambda seq: 0,
                 shared: Callable[[KVCache, Scheduled], int] = lambda cache, seq: 0,
                 pinned: Callable[[KVCache], int] = lambda cache: 0, watermark: float = 0.01) -> None:
        """`need(seq)`: the slots `seq` takes in a row of the first cache (the target's) by the end of its next
        pass (its tokens so far + the widest draft; a joining one's whole prompt); the others add
        what their rows hold beyond the target's (`capacity` - the first's: a proposer's own drafts).
        `shared(cache, seq)`: pages of the running `seq`'s row of `cache` that the prefix cache holds, and that
        it will never write again (counted as the prefix cache's); `pinned(cache)`: the prefix cache's pages of
        `cache` that rows hold (where rows may evict the rest of its blocks: `KVCache.row_pages`); `watermark`:
        the share of each pool kept free when a sequence is admitted (vLLM's 1%), so that the batch grows a
        while before the newest must step out again."""
        self.max_batch_size = max_batch_size
        self.caches = caches  # every cache with a row per sequence: rows move and are freed in all of them
        self.margins = [c.capacity - caches[0].capacity for c in caches]
        self.need = need
        self.shared, self.pinned = shared, pinned
        self.watermark = watermark
        self.waiting: deque = deque()
        self.running: list = []
        self.prefilling = None  # joining: its prompt part-way into the caches, in row len(running)

    def add(self, seq: Scheduled) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling is not None)

    def num_queued(self) -> int:
        """Waiting requests that the next step cannot start: those queued behind a full batch.
        Example: max_batch_size 2, one running, three waiting -> 2 (one of the three takes the free row)."""
        free = self.max_batch_size - len(self.running) - (self.prefilling is not None)
        return max(0, len(self.waiting) - free)

    def joining(self) -> Scheduled | None:
        """The sequence being prefilled, starting the next waiting one (in a freed row) if none is and the
        batch has room; None if none can join."""
        if self.prefilling is None:
            if not self.waiting or len(self.running) >= self.max_batch_size or \
                    not self._fits(self.running, self.waiting[0], self.watermark if self.running else 0.0):
                return None
            self.prefilling = self.waiting.popleft()
            self.prefilling.row = len(self.running)
            self._free(self.prefilling.row)  # empty already (rows past the batch are freed); made sure
        return self.prefilling

    def join(self, seq: Scheduled) -> None:
        """The joining `seq` has its prompt in: it runs from now on (its row is already the next one)."""
        assert seq is self.prefilling
        self.prefilling = None
        self.running.append(seq)

    def remove(self, seq: Scheduled) -> None:
        """Take `seq` (waiting, joining or running) out, freeing its row and keeping the rows packed."""
        if seq is self.prefilling:
            self.prefilling = None
            self._free(seq.row)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            row = seq.row
            last = self.running.pop()
            if last is not seq:
                self.running[row] = last
                self._move(last, row)
            else:
                self._free(row)
            if self.prefilling is not None:
                self._move(self.prefilling, len(self.running))

    def victim(self) -> Scheduled | None:
        """The sequence to preempt before the next pass, None if the batch's next writes fit every pool: the
        joining one, else the newest running one (never the only one: a pool holds one sequence of the whole
        context)."""
        if len(self.running) + (self.prefilling is not None) < 2 or self._free_room() or \
                self._fits(self.running, self.prefilling):
            return None
        return self.prefilling if self.prefilling is not None else self.running[-1]  # (two members at least)

    def _free_room(self) -> bool:
        """Whether the pages the batch's rows may still take in their next pass (up to their need, and a copy of
        each shared page they may write) are free already in every pool: `victim`'s check of every step, in
        O(rows), before `_fits` walks the pages the prefix cache shares."""
        members = [*self.running, *([self.prefilling] if self.prefilling is not None else [])]
        for cache, margin in zip(self.caches, self.margins):
            want = 0
            for seq in members:
                held = cache.pages[seq.row]
                want += max(0, cache.pages_for(self.need(seq) + margin) - len(held))
                want += sum(cache.refs[page] > 1 for page in held[cache.lengths[seq.row] // PAGE:])
            if want > len(cache.free):
                return False
        return True

    def preempt(self, seq: Scheduled) -> None:
        """Take the joining or running `seq` out of the batch (its row freed, the rows kept packed) to the head
        of the queue: it joins again first, all its tokens so far read as its prompt."""
        self.remove(seq)
        seq.row = -1
        self.waiting.appendleft(seq)

    def widest_ride(self, most: int, width: int) -> int:
        """How many tokens (at most `most`) the joining sequence's prompt may read in the running ones' next pass,
        whose rows are `width` wide (1 + the widest draft) and padded to the widest row: the most whose pads
        fit the pools beside what the batch holds (at least `width`, which `victim` made room for). Example:
        width 4, rows a page short of 16 more slots each -> 4 + 15 tokens at most."""
        def fits(n: int) -> bool:
            return self._fits(self.running, self.prefilling, pad=n - width)

        if most <= width or fits(most):
            return most
        lo, hi = width, most  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _fits(self, running: list, seq: Scheduled | None, watermark: float = 0.0, pad: int = 0) -> bool:
        """Whether the pages that `running` (in rows) and `seq` (in a row, or waiting) take by the end of their
        next pass, less those the prefix cache holds for the ones in rows, fit every cache's pool (the rows'
        part of it), beside the prefix cache's pages that rows hold (which no eviction frees), with `watermark`
        of each pool to spare (a page at least, if any: a sequence joining an empty batch is admitted without);
        `pad`: slots past their need that the `running` ones' next pass writes (pads)."""
        members = [*running, *([seq] if seq is not None else [])]
        needs = [self.need(s) + pad * (i < len(running)) for i, s in enumerate(members)]
        in_rows = [s for s in members if s.row >= 0]
        for cache, margin in zip(self.caches, self.margins):
            pages = sum(max(cache.pages_for(n + margin), len(cache.pages[s.row]) if s.row >= 0 else 0)
                        for s, n in zip(members, needs))  # (a row may hold more: what a wide pass took)
            spare = max(1, int(watermark * cache.row_pages)) if watermark else 0
            if pages - sum(self.shared(cache, s) for s in in_rows) + self.pinned(cache) + spare > cache.row_pages:
                return False
        return True

    def _move(self, seq: Scheduled, row: int) -> None:
        """Move `seq` into the free `row` in every cache, and free the row it leaves."""
        for cache in self.caches:
            cache.move_row(seq.row, row)
        self._free(seq.row)
        seq.row = row

    def _free(self, row: int) -> None:
        for cache in self.caches:
            cache.clear(row)
