"""Who runs, and in which cache row: a waiting queue, a packed batch, one sequence joining at a time.

Requests wait in arrival order. Up to `max_batch_size` run, in cache rows 0..B-1 of every cache (the
target's, and a proposer's own); one sequence at a time joins through chunked prefill, in row B (the row
after the running ones). When a running sequence leaves, the last running one takes its row and the
joining one, if any, the row after them: rows stay packed, so a decoding pass covers rows 0..B-1.

Example: a, b, c running in rows 0, 1, 2 and d joining in row 3; b leaves -> c moves to row 1, d to row 2.

Rows are paged (`KVCache`): a row takes pages of its cache's pool as its sequence grows and gives them back when
it leaves, so sequences of any lengths run side by side while their pages fit the pool. A sequence joins when
the pages its batch may come to hold fit every cache's pool: its length, prompt + max_tokens (+ the widest
draft), is what it is admitted by, and the requests behind it wait (first come, first served). Example: a pool
of 32768 slots, 8 rows; a 30k-token prompt joins beside two short requests if their lengths and its own add
up to at most 32768, and waits for them otherwise; the requests behind it wait until it fits.

A running sequence's whole pages that the prefix cache holds (a prompt it found cached, mapped into its row,
or its own prompt's blocks, kept for later requests) count as the prefix cache's memory, not its own (`shared`):
sequences sharing a long prompt hold it once. Example: pages of 16, a 4,096-slot pool and a 2,048-token system
prompt: four requests of it with 256 tokens each to write fit together, where alone each would count 2,304.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from specdec.models.kv_cache import KVCache


class Scheduled(Protocol):
    request_id: str
    row: int


class Scheduler:
    def __init__(self, max_batch_size: int, caches: list[KVCache],
                 need: Callable[[Scheduled], int] = lambda seq: 0,
                 shared: Callable[[KVCache, Scheduled], int] = lambda cache, seq: 0,
                 pinned: Callable[[KVCache], int] = lambda cache: 0) -> None:
        """`need(seq)`: the slots `seq` may take in a row of the first cache (the target's); the others add
        what their rows hold beyond the target's (`capacity` - the first's: a proposer's own drafts).
        `shared(cache, seq)`: pages of the running `seq`'s row of `cache` that the prefix cache holds, and that
        it will never write again (counted as the prefix cache's); `pinned(cache)`: the prefix cache's pages of
        `cache` that rows hold (where rows may evict the rest of its blocks: `KVCache.row_pages`)."""
        self.max_batch_size = max_batch_size
        self.caches = caches  # every cache with a row per sequence: rows move and are freed in all of them
        self.margins = [c.capacity - caches[0].capacity for c in caches]
        self.need = need
        self.shared, self.pinned = shared, pinned
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
            if not self.waiting or len(self.running) >= self.max_batch_size or not self._fit(self.waiting[0]):
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

    def _fit(self, seq: Scheduled) -> bool:
        """Whether the pages the running batch and `seq` may come to hold, less those the prefix cache holds
        for them, fit every cache's pool (the rows' part of it), beside the prefix cache's pages that rows
        hold (which no eviction frees)."""
        needs = [self.need(s) for s in [*self.running, seq]]
        return all(sum(cache.pages_for(n + margin) for n in needs) - sum(self.shared(cache, s) for s in self.running)
                   + self.pinned(cache) <= cache.row_pages for cache, margin in zip(self.caches, self.margins))

    def _move(self, seq: Scheduled, row: int) -> None:
        """Move `seq` into the free `row` in every cache, and free the row it leaves."""
        for cache in self.caches:
            cache.move_row(seq.row, row)
        self._free(seq.row)
        seq.row = row

    def _free(self, row: int) -> None:
        for cache in self.caches:
            cache.clear(row)
