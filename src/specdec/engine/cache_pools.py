"""The engine's K/V caches: the target's and the proposer's own, a row per running sequence, paged from pools
sized for the rows (and for the prefix cache's blocks, where those are pages of the pools: *mapped*); and the
prefix cache's pages as the scheduler counts them (`PrefixPages`).

Example: max_batch_size 4, max_model_len 1024, the widest draft 5, no `row_tokens`: rows of 1029 slots, a
pool of 4096 slots' pages + 4 x (a page for the draft + a page of rounding).
"""

from __future__ import annotations

from specdec.config import CacheConfig, SchedulerConfig
from specdec.engine.prefix_cache import PrefixCache
from specdec.models.kv_cache import PAGE, KVCache
from specdec.speculative.proposers import Proposer


def mapped_caches(proposer: Proposer, config: CacheConfig) -> tuple[str, ...]:
    """The caches whose prefix-cache blocks are pages of their own pools (see `PrefixCache`): the target's
    and the proposer's that keep its tokens' K/V unshifted, where blocks are a page long."""
    if config.prefix_cache_blocks <= 0 or config.prefix_block_size != PAGE:
        return ()
    return ("target", *(name for name in proposer.kv_caches if proposer.kv_shift == 0))


def new_caches(target, proposer: Proposer, config: SchedulerConfig, widest: int, prefix_pages: int = 0,
               mapped: tuple[str, ...] = ()) -> KVCache:
    """The target's cache: `max_batch_size` rows of up to max_model_len + `widest` slots, paged, its pool
    `row_tokens` slots (+ each row's widest draft and a page of rounding); and the proposer's own caches
    alike, their rows as long as they need (+ what they keep beyond max_model_len + widest). A cache named
    in `mapped` has `prefix_pages` more pages, set aside for the prefix cache's blocks."""
    max_batch_size, max_model_len = config.max_batch_size, config.max_model_len
    row_tokens = max_batch_size * max_model_len if config.row_tokens is None else config.row_tokens
    if row_tokens < max_model_len:
        raise ValueError(f"row_tokens {row_tokens} cannot hold one sequence of max_model_len {max_model_len}")
    capacity = max_model_len + widest
    pages = KVCache.pages_for(row_tokens) + max_batch_size * (KVCache.pages_for(widest) + 1)
    extra = prefix_pages if "target" in mapped else 0
    cache = target.new_cache(max_batch_size, capacity, num_pages=pages + extra)
    cache.prefix_pages = extra
    for name, own in proposer.kv_caches.items():
        margin = max(0, own.capacity - max_model_len - widest)
        extra = prefix_pages if name in mapped else 0
        own.reshape(max_batch_size, cache.capacity + margin,
                    num_pages=pages + max_batch_size * (KVCache.pages_for(margin) + 1) + extra)
        own.prefix_pages = extra
    return cache


class PrefixPages:
    """The prefix cache's pages in the pools of `caches` (by name), as the `Scheduler` counts them."""

    def __init__(self, prefix_cache: PrefixCache | None, caches: dict[str, KVCache]) -> None:
        self.prefix_cache, self.caches = prefix_cache, caches

    def shared(self, cache: KVCache, seq) -> int:
        """Whole pages of `seq`'s row of `cache` that the prefix cache holds (`Scheduler`: its memory, not the
        row's; the row writes only past its length, so it never copies them)."""
        if self.prefix_cache is None or not self.prefix_cache.mapped:
            return 0
        return self.prefix_cache.shared(self._name(cache), cache.pages[seq.row][:cache.lengths[seq.row] // PAGE])

    def pinned(self, cache: KVCache) -> int:
        """The prefix cache's pages of `cache` that rows hold (`Scheduler`)."""
        if self.prefix_cache is None or not self.prefix_cache.mapped:
            return 0
        return self.prefix_cache.pinned(self._name(cache))

    def _name(self, cache: KVCache) -> str:
        return next(name for name, c in self.caches.items() if c is cache)
