"""Decoded blocks kept in memory across windows, least recently used evicted past a byte limit
(the full-permutation order reads a window's samples from many blocks, and neighbouring
windows share blocks: see docs/dataloader.md, "Order")."""

from __future__ import annotations

import threading
from typing import Any


class BlockLRU:
    """Decoded blocks kept across windows of the full-permutation order, least recently used
    evicted past `limit_bytes` (0: none kept). Thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit, self.nbytes = limit_bytes, 0
        self._blocks: dict[int, tuple[Any, int]] = {}
        self._lock = threading.Lock()

    def load(self, blocks: list[int], fetch: Any) -> list[Any]:
        with self._lock:
            hits = {b: self._blocks.pop(b) for b in blocks if b in self._blocks}
            for b, v in hits.items():
                self._blocks[b] = v  # most recently used last
        missing = [b for b in blocks if b not in hits]
        fetched = dict(zip(missing, fetch(missing), strict=True)) if missing else {}
        with self._lock:
            for b, blk in fetched.items():
                size = block_size(blk)
                if size <= self.limit and b not in self._blocks:
                    self._blocks[b] = (blk, size)
                    self.nbytes += size
            while self.nbytes > self.limit and self._blocks:
                _, size = self._blocks.pop(next(iter(self._blocks)))
                self.nbytes -= size
        return [hits[b][0] if b in hits else fetched[b] for b in blocks]


def block_size(block: Any) -> int:
    total = 0
    for col in block.values():
        for arr in col if isinstance(col, tuple) else (col,):
            total += int(arr.nbytes) if arr is not None else 0
    return total
