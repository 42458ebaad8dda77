"""The order a rank's items arrive in under torch's DataLoader with worker processes.

torch asks its `nw` workers for batches in turn (worker 0, 1, ..., nw-1, 0, ...), skipping
workers whose iterator has ended. Each worker reads only the windows it serves: the rank's
windows, in order, are dealt to *lanes* (window group g -> lane g % nw), and lane l is served
by one worker, `run` items (torch's batch size) at a time. The rank's delivery order is then
the *schedule*: one run from each lane still holding items, lane after lane, round after round.

The schedule depends only on the rank's pieces, nw and run, so a count of delivered items
(what the main process sees) names exactly which items were delivered. To resume after
`consumed` items, the schedule's remaining runs are dealt again: the lane of the next run goes
to worker 0, the following lanes that still hold items (in cyclic order) to workers 1, 2, ...,
so torch's turn-taking continues the same schedule. Exact at run (batch) boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .epoch import Piece

Run = tuple[int, list[Piece]]  # (lane, the pieces of one run)


def _lanes(pieces: Sequence[Piece], nw: int) -> list[list[Piece]]:
    lanes: list[list[Piece]] = [[] for _ in range(nw)]
    g, last = -1, None
    for p in pieces:
        if p.window != last:
            g, last = g + 1, p.window
        lanes[g % nw].append(p)
    return lanes


def _cut(lane: list[Piece], at: int, n: int) -> tuple[list[Piece], int]:
    """The first n items of `lane` from piece `at` on, and the next piece index (pieces
    are consumed from the front of `lane` in place when cut)."""
    out: list[Piece] = []
    while n and at < len(lane):
        p = lane[at]
        take = min(n, p.stop - p.start)
        out.append(Piece(p.window, p.start, p.start + take))
        n -= take
        if p.start + take == p.stop:
            at += 1
        else:
            lane[at] = Piece(p.window, p.start + take, p.stop)
    return out, at


def schedule(pieces: Sequence[Piece], nw: int, run: int) -> list[Run]:
    """The runs in delivery order (see the module docstring)."""
    lanes = _lanes(pieces, nw)
    at = [0] * nw
    out: list[Run] = []
    alive = [i for i in range(nw) if lanes[i]]
    while alive:
        still = []
        for lane in alive:
            got, at[lane] = _cut(lanes[lane], at[lane], run)
            out.append((lane, got))
            if at[lane] < len(lanes[lane]):
                still.append(lane)
        alive = still
    return out


def remaining(runs: list[Run], consumed: int) -> list[Run]:
    """The runs after the first `consumed` items (a run cut in the middle keeps its rest)."""
    out: list[Run] = []
    skip = consumed
    for lane, ps in runs:
        kept: list[Piece] = []
        for p in ps:
            n = p.stop - p.start
            if skip >= n:
                skip -= n
                continue
            kept.append(Piece(p.window, p.start + skip, p.stop))
            skip = 0
        if kept:
            out.append((lane, kept))
    return out


def worker_pieces(runs: list[Run], wid: int, nw: int) -> list[Piece]:
    """Worker `wid`'s pieces, in order, for the remaining runs `runs`."""
    order: list[int] = []
    for lane, _ in runs:  # lanes in the cyclic order of their next run
        if lane not in order:
            order.append(lane)
        if len(order) == nw:
            break
    if wid >= len(order):
        return []
    mine = order[wid]
    out: list[Piece] = []
    for lane, ps in runs:
        if lane != mine:
            continue
        for p in ps:
            if out and out[-1].window == p.window and out[-1].stop == p.start:
                out[-1] = Piece(p.window, out[-1].start, p.stop)
            else:
                out.append(p)
    return out


def delivered(runs: list[Run], consumed: int, item_starts: np.ndarray) -> np.ndarray:
    """The global item intervals of the first `consumed` items of `runs`."""
    out: list[tuple[int, int]] = []
    left = consumed
    for _, ps in runs:
        for p in ps:
            if left <= 0:
                break
            n = min(left, p.stop - p.start)
            a = int(item_starts[p.window]) + p.start
            out.append((a, a + n))
            left -= n
        if left <= 0:
            break
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)
