"""Where a process's local part of a tensor lies in the global tensor.

`Runs` says it per dimension: a tuple of runs (local start, global start, length), each a
stretch of consecutive indexes in both the local and the global tensor, in local order. A
Shard or a DTensor with Shard(d)/Replicate placements has one run per dim; strided shards
(FSDP2 over tensor parallelism: `_StridedShard`) have several on their dim. The product of
one run per dim is a `Box`: a block the local array holds contiguously in index space.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

Run = tuple[int, int, int]  # (local start, global start, length)
Runs = tuple[tuple[Run, ...], ...]  # per dim


@dataclass(frozen=True)
class Box:
    """Local indexes [local, local + shape) hold global indexes [start, start + shape)."""

    local: tuple[int, ...]
    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start, self.shape))

    def contains(self, region: tuple[tuple[int, int], ...]) -> bool:
        """True if the global region ([start, stop) per dim) lies inside this box."""
        return all(s <= lo and hi <= s + n
                   for s, n, (lo, hi) in zip(self.start, self.shape, region))


def block_runs(offset: tuple[int, ...], shape: tuple[int, ...]) -> Runs:
    """The runs of one contiguous block at global `offset`."""
    return tuple(((0, o, n),) if n else () for o, n in zip(offset, shape))


def index_runs(indexes: list[int]) -> tuple[Run, ...]:
    """The runs of a list of global indexes (in local order)."""
    runs: list[Run] = []
    for pos, g in enumerate(indexes):
        if runs and runs[-1][1] + runs[-1][2] == g:
            local, start, n = runs[-1]
            runs[-1] = (local, start, n + 1)
        else:
            runs.append((pos, g, 1))
    return tuple(runs)


def boxes(runs: Runs) -> list[Box]:
    """Every box of the runs (none if some dim has no run: an empty local part)."""
    return [Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo),
                tuple(r[2] for r in combo)) for combo in itertools.product(*runs)]


def single_offset(runs: Runs) -> tuple[int, ...] | None:
    """The global offset of the local part if it is one block, else None."""
    if any(len(r) != 1 for r in runs):
        return None
    return tuple(r[0][1] for r in runs)
