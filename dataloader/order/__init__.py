"""The order items are delivered in: pure arithmetic over sample ids, no I/O, no state of its
own. Imports flow down this list only:

    epoch.py   the window order of an epoch (blocks permuted, windows of blocks, items permuted
               within a window), the rank split, and the interval arithmetic of resuming
    full.py    the full-permutation order (a keyed Feistel permutation of every sample)
    lanes.py   the delivery order under torch's DataLoader worker processes

Depends on nothing else of the dataloader (numpy only).
"""

from __future__ import annotations

from .epoch import (
    BALANCE,
    MAX_WORLD_SIZE,
    EpochOrder,
    Piece,
    RankPlan,
    advance,
    as_intervals,
    complement,
    merge_intervals,
    rank_plan,
    rng_for,
)
from .full import FeistelPermutation, FullOrder

__all__ = [
    "BALANCE", "MAX_WORLD_SIZE", "EpochOrder", "FeistelPermutation", "FullOrder", "Piece",
    "RankPlan", "advance", "as_intervals", "complement", "merge_intervals", "rank_plan",
    "rng_for",
]  # fmt: skip
