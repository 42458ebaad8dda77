"""Staging for asynchronous saves: copy the state's arrays into one reusable arena so the caller
may change its tensors as soon as staging returns. The arena is kept and reused by the next
save when it is large enough (no page faults on the hot path after the first save)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np

from ..format.leaf import ArrayLeaf

ALIGN = 64
SPLIT_BYTES = 32 << 20  # copies larger than this are split across threads
#: arrays smaller than this are copied in the staging loop itself: a thread-pool task costs
#: more than copying a few KiB (20,000 small tensors: seconds of `submit` for 0.1 s of copies)
POOL_MIN_BYTES = 1 << 20

Copy = tuple[np.ndarray, np.ndarray]  # (destination, source)


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
        arena = self._arena
        native: dict[np.dtype, np.dtype] = {}
        staged: list[ArrayLeaf] = []
        large: list[Copy] = []
        for leaf, off in zip(leaves, offsets):
            src = leaf.array
            dt = native.get(src.dtype)
            if dt is None:
                dt = native[src.dtype] = src.dtype.newbyteorder("=")
            dst = np.ndarray(src.shape, dt, arena, off)  # C-contiguous view of the arena
            if src.nbytes >= POOL_MIN_BYTES:
                large.extend(_split(dst, src))
            elif src.size:
                np.copyto(dst, src)  # small: here and now, cheaper than any task
            staged.append(leaf.with_array(dst))
        self._copy_large(large)
        return staged

    def _copy_large(self, copies: list[Copy]) -> None:
        """Run the large copies, on a thread pool when there are several."""
        if len(copies) > 1 and self.workers > 1:
            with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="ckpt-stage") as pool:
                list(pool.map(lambda pair: np.copyto(pair[0], pair[1]), copies))
        else:
            for dst, src in copies:
                np.copyto(dst, src)


def _split(dst: np.ndarray, src: np.ndarray) -> list[Copy]:
    """One copy, or row blocks of about SPLIT_BYTES for copies larger than that."""
    if not src.ndim or src.nbytes <= SPLIT_BYTES:
        return [(dst, src)]
    step = max(1, src.shape[0] * SPLIT_BYTES // src.nbytes)
    return [(dst[a : a + step], src[a : a + step]) for a in range(0, src.shape[0], step)]
