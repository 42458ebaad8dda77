"""The full-permutation order: every sample of the epoch at a pseudo-random position.

Positions are sample ids passed through a keyed pseudo-random permutation of [0, N): a
6-round balanced Feistel network over the smallest even number of bits that holds N, with
cycle walking (a value >= N is permuted again until it falls below N; fewer than 4 steps on
average). Its key comes from (seed, epoch); nothing of size N is ever held in memory, so the
order of any position is computed on demand, in O(1), the same on every rank and worker.

Windows are runs of `window_items` consecutive positions. Window w's samples are spread over
many blocks (for a dataset much larger than a window, about one block per sample): the reader
loads those blocks a few at a time and keeps only the window's samples (see
StreamingDataset.load_window), so memory stays bounded while reads are amplified (see
docs/dataloader.md, "Order").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .epoch import Piece, rng_for, split_pieces

_TAG_FULL = 0xF011
_ROUNDS = 6
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values (a bijective, well-mixing hash)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


@dataclass(frozen=True)
class FeistelPermutation:
    """A keyed bijection of [0, n) computed elementwise on numpy arrays."""

    n: int
    keys: tuple[int, ...]

    @classmethod
    def make(cls, n: int, seed: int, epoch: int) -> FeistelPermutation:
        keys = rng_for(seed, epoch, _TAG_FULL).integers(0, 2**63, size=_ROUNDS)
        return cls(int(n), tuple(int(k) for k in keys))

    @property
    def half_bits(self) -> int:
        bits = max(2, int(self.n - 1).bit_length())
        return (bits + 1) // 2

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = x >> h, x & mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ np.uint64(k)) & mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        y = self._encrypt(x)
        out_of_range = y >= np.uint64(self.n)
        while out_of_range.any():  # cycle walking: stays a bijection of [0, n)
            y[out_of_range] = self._encrypt(y[out_of_range])
            out_of_range = y >= np.uint64(self.n)
        return y.astype(np.int64)


@dataclass
class FullOrder:
    """An epoch in full-permutation order, cut into windows of `window_items` positions.
    Offers what StreamingDataset needs of EpochOrder (total, item_starts, pieces)."""

    seed: int
    epoch: int
    num_samples: int
    window_items_each: int
    perm: FeistelPermutation = field(init=False)
    item_starts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.perm = FeistelPermutation.make(self.num_samples, self.seed, self.epoch)
        n, m = self.num_samples, max(1, self.window_items_each)
        self.item_starts = np.concatenate([np.arange(0, n, m), [n]]).astype(np.int64)

    @property
    def total(self) -> int:
        return self.num_samples

    @property
    def num_windows(self) -> int:
        return len(self.item_starts) - 1

    @property
    def window_items(self) -> np.ndarray:
        return np.diff(self.item_starts)

    def window_samples(self, w: int) -> np.ndarray:
        """The sample ids at the positions of window w, in order."""
        a, b = int(self.item_starts[w]), int(self.item_starts[w + 1])
        return self.perm(np.arange(a, b, dtype=np.int64))

    def pieces(self, segments: list[tuple[int, int]]) -> list[Piece]:
        return split_pieces(self.item_starts, segments)
