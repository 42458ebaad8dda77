"""Shuffle-quality statistics of one epoch's order (a list of the original sample ids).

* spearman: Spearman's rank correlation between a sample's original and shuffled positions
  (0 for any order unrelated to the original one; a window shuffle over permuted blocks also
  scores ~0, because blocks land anywhere);
* neighbour_spread: how far apart originally adjacent samples end up, mean |pos(i+1) - pos(i)|
  divided by N/3, its expectation under a uniform random permutation (1.0: as mixed as a
  uniform permutation; near 0: neighbours stay together, as within a window or a chunk).
"""

from __future__ import annotations

import numpy as np


def stats(order: list[int]) -> dict[str, float]:
    ids = np.asarray(order, dtype=np.int64)
    n = len(ids)
    pos = np.empty(n, dtype=np.int64)
    pos[ids] = np.arange(n)
    d = (np.arange(n) - pos).astype(np.float64)
    rho = 1 - 6 * float((d * d).sum()) / (n * (n * n - 1))
    spread = float(np.abs(np.diff(pos)).mean()) / (n / 3)
    return {"spearman": rho, "neighbour_spread": spread}
