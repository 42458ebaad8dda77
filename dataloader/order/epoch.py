"""Deterministic epoch order and the partition of items over ranks.

Order: blocks (row-chunks of R samples) are permuted with a generator seeded from
(seed, epoch); consecutive groups of `window_blocks` permuted blocks form *windows*; within each
window the items are permuted with a generator seeded from (seed, epoch, window). The result
(the epoch's *global order* of items) depends only on the seed, the epoch and the dataset, never
on worker count, rank count or timing. An item is a sample (or, in tokens mode, a packed
sequence cut from a window's shuffled documents).

Partition: the *remaining* items of an epoch (global order minus the `base` intervals already
consumed) are split into `world_size` contiguous, near-equal ranges, one per rank; each rank
reads about its own windows only. With balance 'drop' every rank gets floor(M/W) items, with
'pad' ceil(M/W) (short ranks repeat their first item), with 'none' the first M%W ranks get one
more.

Progress: ranks run in lockstep (each has consumed the same number `consumed` of items since
the base), so the state of every rank follows from one rank's (epoch, base, world_size,
balance, consumed). Resuming with the same world size and balance continues each rank exactly
where it was (same continuation as an uninterrupted run); with another topology the consumed
items of all old ranks are folded into `base` and the rest is split afresh: each remaining item
is still delivered exactly once. The interval arithmetic is vectorised: folding a state of W
ranks with B base intervals costs O(W + B log B), whatever their values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

BALANCE = ("none", "drop", "pad")
#: Largest number of ranks (data-parallel replicas) a dataset, loader or state may name.
MAX_WORLD_SIZE = 1 << 20
_TAG_BLOCKS = 0xB10C
_TAG_WINDOW = 0x3117


def rng_for(*keys: int) -> np.random.Generator:
    """A PCG64 generator seeded from non-negative ints (stable across numpy versions)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in keys])))


@dataclass(frozen=True)
class Piece:
    """Items [start, stop) (window-local item numbers) of window `window`."""

    window: int
    start: int
    stop: int


@dataclass
class EpochOrder:
    """The global order of one epoch: windows of permuted blocks, permuted items inside."""

    seed: int
    epoch: int
    shuffle: bool
    window_blocks: int
    block_rows: np.ndarray
    block_order: np.ndarray
    window_items: np.ndarray
    item_starts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.item_starts = np.concatenate([[0], np.cumsum(self.window_items)]).astype(np.int64)

    @classmethod
    def build(
        cls,
        block_rows: np.ndarray,
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        window_blocks: int,
        items_per_window: Callable[[list[np.ndarray]], np.ndarray] | None = None,
    ) -> EpochOrder:
        n = len(block_rows)
        order = rng_for(seed, epoch, _TAG_BLOCKS).permutation(n) if shuffle else np.arange(n)
        windows = [order[i : i + window_blocks] for i in range(0, n, window_blocks)]
        if items_per_window is None:
            items = np.array([int(block_rows[w].sum()) for w in windows], dtype=np.int64)
        else:
            items = np.asarray(items_per_window(windows), dtype=np.int64)
        return cls(seed, epoch, shuffle, window_blocks, block_rows, order.astype(np.int64), items)

    @property
    def num_windows(self) -> int:
        return len(self.window_items)

    @property
    def total(self) -> int:
        return int(self.item_starts[-1])

    def window_blocks_of(self, w: int) -> np.ndarray:
        k = self.window_blocks
        return self.block_order[w * k : (w + 1) * k]

    def sample_perm(self, w: int, n: int) -> np.ndarray:
        """Permutation of a window's n local items (identity without shuffle)."""
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return rng_for(self.seed, self.epoch, _TAG_WINDOW, w).permutation(n).astype(np.int64)

    def pieces(self, segments: list[tuple[int, int]]) -> list[Piece]:
        return split_pieces(self.item_starts, segments)


def split_pieces(starts: np.ndarray, segments: list[tuple[int, int]]) -> list[Piece]:
    """Split global item intervals into per-window pieces (window w holds items
    [starts[w], starts[w+1])), merging neighbours."""
    out: list[Piece] = []
    for a, b in segments:
        while a < b:
            w = int(np.searchsorted(starts, a, side="right")) - 1
            end = min(b, int(starts[w + 1]))
            p = Piece(w, a - int(starts[w]), end - int(starts[w]))
            if out and out[-1].window == w and out[-1].stop == p.start:
                out[-1] = Piece(w, out[-1].start, p.stop)
            else:
                out.append(p)
            a = end
    return out


# -- intervals ---------------------------------------------------------------------------
def as_intervals(value: object) -> np.ndarray:
    arr = np.asarray(value, dtype=np.int64).reshape(-1, 2)
    return arr


def merge_intervals(iv: np.ndarray) -> np.ndarray:
    """Sorted, disjoint, non-empty, with touching intervals joined."""
    iv = as_intervals(iv)
    iv = iv[iv[:, 1] > iv[:, 0]]
    if len(iv) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    reach = np.maximum.accumulate(iv[:, 1])  # furthest stop so far
    first = np.flatnonzero(np.concatenate([[True], iv[1:, 0] > reach[:-1]]))
    last = np.concatenate([first[1:] - 1, [len(iv) - 1]])
    return np.stack([iv[first, 0], reach[last]], axis=1).astype(np.int64)


def complement(iv: np.ndarray, total: int) -> np.ndarray:
    """The intervals of [0, total) not covered by `iv` (sorted, disjoint)."""
    iv = np.minimum(merge_intervals(iv), total)
    starts = np.maximum(np.concatenate([[0], iv[:, 1]]), 0)
    stops = np.concatenate([iv[:, 0], [total]])
    keep = stops > starts
    return np.stack([starts[keep], stops[keep]], axis=1).astype(np.int64).reshape(-1, 2)


def map_virtual(free: np.ndarray, lo: int, hi: int) -> list[tuple[int, int]]:
    """Real intervals of virtual positions [lo, hi) of the sequence formed by `free`."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in free:
        a, b = int(a), int(b)
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
        if pos >= hi:
            break
    return out


# -- partition ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPlan:
    """This rank's items for the epoch: real item intervals in order, then `pads` repeats."""

    segments: tuple[tuple[int, int], ...]
    real: int
    pads: int
    pad_item: int

    @property
    def total(self) -> int:
        return self.real + self.pads

    def after(self, consumed: int) -> list[tuple[int, int]]:
        """Item intervals still to deliver once `consumed` items were delivered."""
        out, skip = [], consumed
        for a, b in self.segments:
            n = b - a
            if skip >= n:
                skip -= n
                continue
            out.append((a + skip, b))
            skip = 0
        pads_left = self.pads - max(0, consumed - self.real)
        out += [(self.pad_item, self.pad_item + 1)] * max(0, pads_left)
        return out


def _split(m: int, world: int, rank: int) -> tuple[int, int]:
    q, rem = divmod(m, world)
    lo = rank * q + min(rank, rem)
    return lo, q + (1 if rank < rem else 0)


def rank_plan(total: int, base: np.ndarray, world: int, rank: int, balance: str) -> RankPlan:
    """The items of `rank` among `world` ranks, given consumed intervals `base`."""
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    free = complement(base, total)
    m = int((free[:, 1] - free[:, 0]).sum())
    lo, n = _split(m, world, rank)
    q, rem = divmod(m, world)
    real, pads = n, 0
    if balance == "drop":
        real = q
    elif balance == "pad" and rem and n == q:
        pads = 1
    segments = tuple(map_virtual(free, lo, lo + real))
    if pads:
        first = lo if real else (rank % m if m else 0)
        pad_item = map_virtual(free, first, first + 1)[0][0] if m else 0
    else:
        pad_item = 0
    return RankPlan(segments, real, pads, pad_item)


def advance(total: int, base: np.ndarray, world: int, balance: str, consumed: int) -> np.ndarray:
    """The consumed intervals after every rank delivered `consumed` items (lockstep)."""
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"world size {world} is not in [1, {MAX_WORLD_SIZE}]")
    free = complement(base, total)
    m = int((free[:, 1] - free[:, 0]).sum())
    q, rem = divmod(m, world)
    ranks = np.arange(world, dtype=np.int64)
    lo = ranks * q + np.minimum(ranks, rem)  # as _split, for every rank at once
    real = np.full(world, q, dtype=np.int64)
    if balance != "drop":
        real += ranks < rem
    take = np.minimum(real, consumed)
    virtual = np.stack([lo, lo + take], axis=1)[take > 0]
    done = _map_virtual_all(free, virtual)
    return merge_intervals(np.concatenate([as_intervals(base), done]))


def _map_virtual_all(free: np.ndarray, virtual: np.ndarray) -> np.ndarray:
    """Real intervals of sorted, disjoint, non-empty virtual intervals of the sequence
    formed by `free` (map_virtual for many intervals at once)."""
    if len(virtual) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(free[:, 1] - free[:, 0])])  # virtual starts
    a, b = virtual[:, 0], virtual[:, 1]
    s0 = np.searchsorted(starts, a, side="right") - 1  # free segment of each first item
    s1 = np.searchsorted(starts, b - 1, side="right") - 1  # ... and of each last item
    count = s1 - s0 + 1  # pieces per virtual interval
    which = np.repeat(np.arange(len(virtual)), count)
    seg = s0[which] + np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(a[which], starts[seg])
    hi = np.minimum(b[which], starts[seg + 1])
    shift = free[seg, 0] - starts[seg]
    return np.stack([lo + shift, hi + shift], axis=1).astype(np.int64)
