"""Who runs, and in which cache row: a waiting queue, a packed batch, one sequence joining at a time.

Requests wait in arrival order. Up to `max_batch_size` run, in cache rows 0..B-1 of every cache (the
target's, and a proposer's own); one sequence at a time joins through chunked prefill, in row B (the row
after the running ones). When a running sequence leaves, the last running one takes its row and the
joining one, if any, the row after them: rows stay packed, so a decoding pass covers rows 0..B-1.

Example: a, b, c running in rows 0, 1, 2 and d joining in row 3; b leaves -> c moves to row 1, d to row 2.

Rows share `row_tokens` slots (the memory plan's K/V for running sequences): `max_batch_size` rows of
`row_tokens // max_batch_size` slots, or, while a longer sequence runs, fewer rows as long as it needs
(rounded up to a power of two of the short length). A sequence joins when the rows its batch would need
fit: its length, prompt + max_tokens, is what it is admitted by. Example: row_tokens 32768, 8 rows of 4096;
a 30k-token prompt waits until the batch is empty, then runs alone in 1 row of 32768 slots; the requests
behind it wait for it, and the rows go back to 8 of 4096 when it leaves.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from specdec.models.kv_cache import KEY_BLOCK, KVCache


class Scheduled(Protocol):
    request_id: str
    row: int


class Scheduler:
    def __init__(self, max_batch_size: int, caches: list[KVCache], row_tokens: int | None = None,
                 need: Callable[[Scheduled], int] = lambda seq: 0) -> None:
        """`row_tokens`: slots all rows share (None: each cache's rows as given); `need(seq)`: the slots
        `seq` may take in a row."""
        self.max_batch_size = max_batch_size
        self.caches = caches  # every cache with a row per sequence: rows move and are freed in all of them
        self.short = caches[0].capacity  # the rows' length while only short sequences run
        self.row_tokens = row_tokens if row_tokens is not None else max_batch_size * self.short
        self.margins = [c.capacity - self.short for c in caches]  # what each cache adds to a row (drafts)
        self.need = need
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
        """Shape the rows for the running batch and `seq`; False (nothing changed) if they do not fit."""
        need, length = max(self.need(s) for s in [*self.running, seq]), self.short
        while length < need:
            length *= 2
        length = min(length, self.row_tokens // KEY_BLOCK * KEY_BLOCK)
        rows = min(self.max_batch_size, self.row_tokens // length)
        if need > length or rows < len(self.running) + 1:
            return False
        if self.caches[0].capacity != length or self.caches[0].batch_size != rows:
            for cache, margin in zip(self.caches, self.margins):
                cache.reshape(rows, length + margin)
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
