"""Route rows stored per KV-cache slot, so prefix-cached tokens keep the routes that computed them.

Why per slot: a prompt token served from the prefix cache was computed by an earlier forward,
whose routes are the only true ones for it (recomputing would give different routes under a
tie or a different batch). vLLM's native capture keys finished blocks by block hash in a side
store. Here the rows live next to the KV they belong to: row `slot = block_id * block_size +
offset` is written by the same forward that writes that slot's K/V, and is overwritten only
when the block is reallocated, i.e. exactly when the KV cache stops holding it. A cache hit
therefore finds the routes of the forward that produced the cached KV, with no hashing and no
eviction policy of its own. Memory: `layers * topk * itemsize` bytes per KV slot (4 B for the
tiny model, 384 B for 48 layers x top-8), small next to the KV itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RouteStoreError(RuntimeError):
    """A read or write outside what the store can hold (names the request position)."""


class RouteSlotStore:
    """`[num_blocks * block_size, num_layers, topk]` expert ids, addressed by KV slot."""

    def __init__(
        self, num_blocks: int, block_size: int, num_layers: int, topk: int, dtype: np.dtype
    ) -> None:
        if num_blocks <= 0 or block_size <= 0 or num_layers <= 0 or topk <= 0:
            raise ValueError(
                f"route store needs positive sizes, got blocks={num_blocks} "
                f"block_size={block_size} layers={num_layers} topk={topk}"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rows = np.zeros((num_blocks * block_size, num_layers, topk), dtype=dtype)

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        """KV slots of token positions `[start, end)` of a request with these block ids."""
        if not 0 <= start <= end or end > len(block_ids) * self.block_size:
            raise RouteStoreError(
                f"positions [{start}, {end}) outside the request's "
                f"{len(block_ids)} blocks of {self.block_size}"
            )
        positions = np.arange(start, end)
        blocks = np.asarray(block_ids, dtype=np.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, block_ids: Sequence[int], start: int, rows: np.ndarray) -> None:
        """Store the rows a forward computed for positions `[start, start + len(rows))`."""
        self.rows[self.slots(block_ids, start, start + len(rows))] = rows

    def read(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        """A copy of the rows of positions `[start, end)` (cached prefix included)."""
        return self.rows[self.slots(block_ids, start, end)]
