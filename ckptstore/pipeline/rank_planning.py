"""Planning a collective save on each rank from its own placements (the scalable protocol of
`training/rank_save.py`). Pure arithmetic: no I/O, no torch, deterministic.

The plan of `planning.plan_collective` needs every rank's description of every tensor, so
each rank receives and plans over ranks x tensors. This plan needs, per tensor, only the
global geometry every rank already shares and one number per dimension agreed by a
reduction over the ranks: the gcd of the interior ends of every rank's box on that
dimension. From them each rank derives the same chunk grid (`planning.grid_of`, the grid
`plan_collective` would choose for the same shards) and knows the chunks it writes without
knowing who writes the rest:

- a tensor that every rank holds whole (replicated: DDP weights, Adam's `step`): its chunks
  go, largest first, to the rank with the fewest bytes so far (`replicated_owners`, the same
  on every rank: the inputs are the shared geometry only);
- a tensor that ranks hold in boxes (a `Shard`'s rows, a DTensor with Shard(d) on any mesh
  dims: FSDP, tensor parallelism, HSDP): each rank writes the chunks inside its box; where R
  ranks hold the same box as copies of one another (`ArrayLeaf.replica`: a DTensor's
  Replicate mesh dims), copy k writes the chunks c with (tensor + c) % R == k
  (`copy_writes`). Ranks holding the same elements without saying so (overlapping `Shard`s)
  all write them; the segment builder keeps one copy and refuses copies that differ.

Which states qualify (`boxes_of`): every array leaf whole, or held in boxes: one per rank
(row shards, DTensor Shard(d)), or several (FSDP2's strided shards over tensor parallelism:
a rank holds rows far apart), each with where its start lies in the rank's local tensor.

The entries are built per index segment (`segment_spans`: the same cut a single-process
save makes) by one rank each (`builder_of`), from the chunk references the writers send it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..format.dtypes import DType
from ..format.leaf import ArrayLeaf
from ..format.manifest import chunks_meeting, expected_chunk_count
from ..format.segment_encoding import cut_counts
from .options import SaveOptions
from .planning import grid_block, grid_of, grid_region, rows_per_chunk

#: [start, stop) per dimension of the part of a tensor one rank holds
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Held:
    """What one rank holds of a tensor it shards: global boxes ([start, stop) per dimension),
    and where each box's start lies in the rank's local tensor."""

    boxes: tuple[Box, ...]
    local: tuple[tuple[int, ...], ...]  # the local index of each box's first element

    def to_json(self) -> list[list[list[int]]]:
        return [[[lo, hi, at] for (lo, hi), at in zip(box, local)]
                for box, local in zip(self.boxes, self.local)]


#: `boxes_of` of a leaf held whole
WHOLE = None


class Unplannable(Exception):
    """A leaf this plan cannot describe (a 0-d tensor held in part)."""


def boxes_of(leaf: ArrayLeaf) -> Held | None:
    """What this rank holds of `leaf` (Held), or WHOLE: one box for row shards and a
    DTensor's Shard(d) placements, one per combination of runs for strided shards (FSDP2
    over tensor parallelism: rows far apart). Raises Unplannable for a 0-d leaf in part."""
    if not leaf.is_partial:
        return WHOLE
    shape = tuple(int(n) for n in leaf.array.shape)
    gshape = leaf.global_shape or shape
    if not shape:
        raise Unplannable(leaf.key)
    if leaf.region_runs is None:
        start = leaf.row_offset
        return Held((((start, start + shape[0]), *((0, n) for n in gshape[1:])),),
                    ((0,) * len(shape),))
    runs = leaf.region_runs
    if any(len(dim) == 0 for dim in runs):  # holds no element
        return Held((tuple((0, 0) for _n in gshape),), ((0,) * len(gshape),))
    combos = list(itertools.product(*runs))
    return Held(tuple(tuple((start, start + n) for _local, start, n in combo)
                      for combo in combos),
                tuple(tuple(local for local, _start, _n in combo) for combo in combos))


def interior_gcds(held: Held | None, shape: tuple[int, ...]) -> list[int]:
    """Per dimension, the gcd of the ends of the boxes held strictly inside [0, n) (0:
    none)."""
    out = []
    for d, n in enumerate(shape):
        g = 0
        for box in held.boxes if held is not None else ():
            for x in box[d]:
                if 0 < x < n:
                    g = math.gcd(g, x)
        out.append(g)
    return out


@dataclass(frozen=True)
class TensorGeometry:
    """What every rank knows of one tensor: its global shape and dtype, and whether any rank
    holds only some of its rows."""

    key: str
    dtype: DType
    shape: tuple[int, ...]
    sharded: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Grid:
    """The global chunking of one tensor, as the manifest records it."""

    shape: tuple[int, ...]
    chunk_rows: int
    chunk_shape: tuple[int, ...] | None
    packed: bool  # one chunk, packed with other small ones (replicated small tensors)
    small: bool  # a sharded tensor of at most pack_threshold bytes: its chunks packed
    chunks: int

    def block(self) -> tuple[int, ...]:
        return grid_block(self.shape, self.chunk_rows, self.chunk_shape)

    def region(self, c: int) -> tuple[tuple[int, int], ...]:
        return grid_region(self.shape, self.chunk_rows, self.chunk_shape, self.packed, c)

    def chunk_bytes(self, c: int, itemsize: int) -> int:
        return math.prod(hi - lo for lo, hi in self.region(c)) * itemsize

    def chunks_in_box(self, box: Box) -> Iterator[int]:
        """The chunks lying inside the global `box` (whose ends fall on chunk boundaries of
        every dimension), in C order."""
        if any(stop <= start for start, stop in box) or not self.chunks:
            return
        if not self.shape:
            yield 0
            return
        yield from chunks_meeting(self.shape, self.block(), box)


def copy_writes(tensor: int, chunk: int, replica: tuple[int, int]) -> bool:
    """True if copy `replica[0]` of `replica[1]` ranks holding a chunk writes it."""
    index, count = replica
    return (tensor + chunk) % count == index


def grid(geo: TensorGeometry, gcds: list[int], options: SaveOptions) -> Grid:
    """The grid of one tensor from its geometry and the gcd over the ranks of the interior
    ends of their boxes on each dimension (as `planning._layout` chooses it for the same
    shards)."""
    shape, itemsize = geo.shape, geo.dtype.itemsize
    nbytes = geo.nbytes
    if not geo.sharded and 0 < nbytes <= options.pack_threshold:
        return Grid(shape, max(1, shape[0]) if shape else 1, None, True, False, 1)
    if not shape:
        return Grid(shape, 1, None, False, False, 1)
    if nbytes == 0:
        return Grid(shape, rows_per_chunk(shape, itemsize, options.chunk_bytes), None, False,
                    False, 0)
    rows, chunk_shape = grid_of(shape, itemsize, gcds, options)
    return Grid(shape, rows, chunk_shape, False,
                geo.sharded and nbytes <= options.pack_threshold,
                expected_chunk_count(shape, rows, itemsize, chunk_shape))


def replicated_owners(geos: Sequence[TensorGeometry], grids: Sequence[Grid], world: int
                      ) -> dict[tuple[int, int], int]:
    """{(tensor, chunk): rank} for every chunk of the tensors no rank shards: largest first,
    to the rank with the fewest bytes so far (ties: lowest rank). The same on every rank."""
    items = [(g.chunk_bytes(c, geo.dtype.itemsize), i, c)
             for i, (geo, g) in enumerate(zip(geos, grids)) if not geo.sharded
             for c in range(g.chunks)]
    items.sort(key=lambda u: (-u[0], u[1], u[2]))
    loads = [(0, r) for r in range(world)]
    out: dict[tuple[int, int], int] = {}
    for nbytes, i, c in items:
        load, r = heapq.heappop(loads)
        out[(i, c)] = r
        heapq.heappush(loads, (load + nbytes, r))
    return out


def segment_spans(geos: Sequence[TensorGeometry], grids: Sequence[Grid]) -> list[range]:
    """The tensor ranges of the index segments (the cut of a single-process save)."""
    return cut_counts([geo.key for geo in geos], [g.chunks for g in grids])


def builder_of(segment: int, world: int) -> int:
    """The rank that builds index segment `segment`: ranks other than 0 first, so that
    rank 0, which commits, receives only the ranks' small records."""
    return segment % world if world == 1 else 1 + segment % (world - 1)


@dataclass(frozen=True)
class RankPlan:
    """One rank's plan of a collective save (the same grids and spans on every rank)."""

    signature: int  # of the inputs it was derived from (training/rank_save.py: `_signature`)
    geometry: tuple[TensorGeometry, ...]
    grids: tuple[Grid, ...]
    spans: tuple[range, ...]  # tensors of each index segment
    mine: dict[int, list[int]]  # replicated tensor -> the chunks this rank writes

    def segment_of(self) -> np.ndarray:
        """The segment of each tensor."""
        return np.repeat(np.arange(len(self.spans), dtype=np.int64),
                         [len(s) for s in self.spans])


def plan_rank(leaves: list[ArrayLeaf], boxes: list[Held | None], gcds: list[list[int]],
              signature: int, options: SaveOptions, rank: int, world: int) -> RankPlan:
    """This rank's plan from its leaves, what it holds of them (`boxes_of`) and the agreed
    gcds per
    tensor and dimension: every tensor's grid, the index segments, and the replicated chunks
    this rank writes (the same grids and segments on every rank)."""
    geos = tuple(TensorGeometry(leaf.key, leaf.dtype,
                                tuple(leaf.global_shape or leaf.array.shape),
                                b is not None) for leaf, b in zip(leaves, boxes))
    grids = tuple(grid(geo, g, options) for geo, g in zip(geos, gcds))
    mine: dict[int, list[int]] = {}
    for (i, c), owner in replicated_owners(geos, grids, world).items():
        if owner == rank:
            mine.setdefault(i, []).append(c)
    return RankPlan(signature, geos, grids, tuple(segment_spans(geos, grids)), mine)
