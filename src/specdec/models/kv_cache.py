"""A preallocated KV cache with O(1) rollback and gather-commit for tree drafts.

Layout per layer: keys and values of shape [batch, num_kv_heads, capacity, head_dim]. Row b holds one
sequence; `lengths[b]` is how many slots of row b are committed. A forward pass writes the K/V of its
new tokens into slots `[lengths[b], lengths[b] + T)` without committing them; lengths move only through
this class's methods (`advance`, `truncate`, `clear`, `commit` gathering kept slots into place, `move_row`).

Rollback is free: truncate moves a length; rejected slots are simply overwritten by the next pass and
hidden by the attention mask until then.

Example (one sequence): lengths = [10]; a verification pass writes 6 slots 10..15; the first 3 are
accepted -> `advance(0, 3)`, lengths = [13]; slots 13..15 are dead and will be overwritten.
Tree example: a pass wrote 7 tree nodes into slots 10..16 and the accepted path is nodes 0, 2, 5 ->
`commit(0, [0, 2, 5])` copies slots 10, 12, 15 to 10, 11, 12 and sets lengths = [13].
"""

from __future__ import annotations

import torch

from specdec.config import ModelConfig

KEY_BLOCK = 64  # attention key length granularity (see models.llama): cache capacities are multiples of it


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK  # whole attention key blocks
        shape = (batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.capacity = capacity
        self.batch_size = batch_size
        self.lengths = [0] * batch_size  # committed slots per row

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """Memory one token takes in the cache of a model (keys and values, all layers)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def truncate(self, row: int, length: int) -> None:
        """Forget everything after `length` committed slots of `row` (O(1))."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def clear(self, row: int) -> None:
        """Free `row`: nothing in it is committed."""
        self.lengths[row] = 0

    def advance(self, row: int, n: int) -> None:
        """Commit the first `n` slots written after the committed prefix of `row`."""
        if self.lengths[row] + n > self.capacity:
            raise ValueError(f"KV cache row {row} would exceed its capacity of {self.capacity} tokens")
        self.lengths[row] += n

    def commit(self, row: int, indices: list[int]) -> None:
        """Keep the pending slots `indices` (offsets past the committed prefix, increasing) in that order.

        Offsets that are already in place (a chain, or a tree path that starts on the main branch) are
        not copied.
        """
        start = self.lengths[row]
        first_moved = next((i for i, idx in enumerate(indices) if idx != i), len(indices))
        if first_moved < len(indices):
            src = torch.tensor(indices[first_moved:], device=self.keys[0].device) + start
            dst = slice(start + first_moved, start + len(indices))
            for k, v in zip(self.keys, self.values):
                k[row, :, dst] = k[row, :, src]
                v[row, :, dst] = v[row, :, src]
        self.advance(row, len(indices))

    def reshape(self, batch_size: int, capacity: int) -> None:
        """Reallocate as `batch_size` rows of `capacity` slots (whole key blocks), keeping what the rows
        that remain hold: how the engine trades rows for length (a long sequence runs in fewer, longer rows).
        Rows dropped and slots cut must hold nothing committed.
        Example: 8 rows of 4096 -> reshape(1, 32768): row 0 keeps its slots, rows 1..7 (empty) are gone."""
        capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        if any(self.lengths[batch_size:]) or max(self.lengths[:batch_size], default=0) > capacity:
            raise ValueError(f"cannot reshape a KV cache holding rows of lengths {self.lengths} to "
                             f"{batch_size} rows of {capacity} slots")
        rows, keep = min(batch_size, self.batch_size), min(capacity, self.capacity)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = old.new_zeros((batch_size, old.shape[1], capacity, old.shape[3]))
                new[:rows, :, :keep] = old[:rows, :, :keep]
                tensors[i] = new
        self.lengths = self.lengths[:rows] + [0] * (batch_size - rows)
        self.capacity, self.batch_size = capacity, batch_size

    def row_view(self, row: int) -> "KVCache":
        """A one-row cache sharing this cache's storage for `row` (its lengths are its own: the caller
        copies the length back)."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[row:row + 1] for k in self.keys]
        view.values = [v[row:row + 1] for v in self.values]
        view.capacity, view.batch_size, view.lengths = self.capacity, 1, [self.lengths[row]]
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy row `src` onto row `dst` (used to keep running sequences packed in rows 0..B-1)."""
        n = self.lengths[src]
        for k, v in zip(self.keys, self.values):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n
