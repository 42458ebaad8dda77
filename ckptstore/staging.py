"""Staging for asynchronous saves: copy the state's arrays into one reusable arena so the caller
may change its tensors as soon as staging returns. The arena is kept and reused by the next
save when it is large enough (no page faults on the hot path after the first save)."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import replace

import numpy as np

from .tree import ArrayLeaf

ALIGN = 64
SPLIT_BYTES = 32 << 20  # copies larger than this are split across threads


class StagingArena:
    """Owns one byte arena. Not thread-safe: one staging at a time (the repository ensures the
    previous save finished before staging the next)."""

    def __init__(self, workers: int = 4) -> None:
        self._arena = np.empty(0, np.uint8)
        self.workers = workers

    @property
    def capacity(self) -> int:
        return self._arena.nbytes

    def stage(self, leaves: list[ArrayLeaf]) -> list[ArrayLeaf]:
        """Return leaves whose arrays are copies in the arena (valid until the next stage)."""
        offsets = []
        total = 0
        for leaf in leaves:
            offsets.append(total)
            total += -(-leaf.nbytes // ALIGN) * ALIGN
        if total > self._arena.nbytes:
            self._arena = np.empty(total, np.uint8)
        staged: list[ArrayLeaf] = []
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        for leaf, off in zip(leaves, offsets):
            src = leaf.array
            dst = self._arena[off : off + leaf.nbytes].view(src.dtype.newbyteorder("="))
            dst = dst.reshape(src.shape)
            if src.ndim and src.nbytes > SPLIT_BYTES:
                step = max(1, src.shape[0] * SPLIT_BYTES // src.nbytes)
                copies.extend((dst[a : a + step], src[a : a + step])
                              for a in range(0, src.shape[0], step))
            elif src.size:
                copies.append((dst, src))
            staged.append(replace(leaf, array=dst))
        if len(copies) > 1 and self.workers > 1:
            with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="ckpt-stage") as pool:
                list(pool.map(lambda pair: np.copyto(pair[0], pair[1]), copies))
        else:
            for dst, src in copies:
                np.copyto(dst, src)
        return staged
