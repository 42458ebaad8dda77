"""Planning a save: which chunks there are and which process writes each, before anything
is written. One seam for the single-process and the collective save, in the style of DCP's
planner: the call order is

1. describe: every process describes its array leaves (a single process: its ArrayLeafs; a
   collective save: `training/distributed._describe`, all-gathered as JSON);
2. plan: `plan_leaves` (one process holds every tensor whole: small ones packed, the rest
   in row blocks of about `chunk_bytes`) or `plan_collective` (the same plan derived on
   every rank from every rank's description: each tensor's global chunk grid aligned to the
   ranks' shard boundaries, and the rank that writes each chunk);
3. write: the writer runs the chunks the plan gives this process (pipeline/writer.py);
4. commit: the manifest is built from the plan and every chunk's reference, and committed
   once (pipeline/commit.py).

Pure arithmetic: no I/O, no torch, deterministic (every rank must derive the same plan).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import CkptStoreError
from ..format.dtypes import DType, by_name
from ..format.leaf import ArrayLeaf
from ..format.manifest import chunk_region
from ..format.regions import Box, boxes
from .options import SaveOptions


def rows_per_chunk(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> int:
    """Rows of dim 0 per chunk: about `chunk_bytes`, at least one row, at most all rows."""
    if not shape:
        return 1
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, chunk_bytes // row) if row else max(1, shape[0])
    return max(1, min(rows, shape[0]))


@dataclass(frozen=True)
class TensorSpec:
    """What the manifest needs of a leaf besides its chunks: the global geometry."""

    key: str
    kind: str
    dtype: DType
    shape: tuple[int, ...]  # global shape
    requires_grad: bool = False
    parameter: bool = False

    @staticmethod
    def of(leaf: ArrayLeaf, global_shape: tuple[int, ...] | None = None) -> TensorSpec:
        # (a numpy shape is a tuple of ints already; a device array's torch.Size becomes one)
        shape = tuple(leaf.array.shape) if global_shape is None else global_shape
        return TensorSpec(leaf.key, leaf.kind, leaf.dtype, shape, leaf.requires_grad,
                          leaf.parameter)


@dataclass(frozen=True)
class LeafPlan:
    """How one leaf is chunked and which of its chunks this process writes.

    `chunk_rows` is the global row-block size; this process holds global rows
    [row_offset, row_offset + local rows) and writes the global chunks in `owned` (None: every
    chunk it holds). Packed leaves form one chunk and are written whole."""

    chunk_rows: int
    packed: bool = False
    row_offset: int = 0
    owned: frozenset[int] | None = None

    @property
    def writes_any(self) -> bool:
        return self.owned is None or bool(self.owned)

    def local_chunks(self, leaf: ArrayLeaf) -> Iterator[tuple[int, int, int]]:
        """(global chunk index, local start row, local stop row) of the chunks to write."""
        if leaf.nbytes == 0:
            return
        if leaf.array.ndim == 0:
            if self.owned is None or 0 in self.owned:
                yield (0, 0, 1)
            return
        n_local = leaf.array.shape[0]
        if self.row_offset % self.chunk_rows:
            raise ValueError(f"{leaf.key}: shard offset {self.row_offset} is not a multiple of "
                             f"the chunk rows {self.chunk_rows}")
        first = self.row_offset // self.chunk_rows
        for k, start in enumerate(range(0, n_local, self.chunk_rows)):
            c = first + k
            if self.owned is None or c in self.owned:
                yield (c, start, min(n_local, start + self.chunk_rows))


def plan_leaves(leaves: list[ArrayLeaf], options: SaveOptions) -> list[LeafPlan]:
    """Single-process plan: small leaves packed, the rest in row blocks of ~chunk_bytes."""
    plans = []
    packed: dict[int, LeafPlan] = {}  # one (frozen) plan per row count, shared
    for leaf in leaves:
        if 0 < leaf.nbytes <= options.pack_threshold:
            rows = max(1, leaf.array.shape[0]) if leaf.array.ndim else 1
            plan = packed.get(rows)
            if plan is None:
                plan = packed[rows] = LeafPlan(rows, packed=True)
            plans.append(plan)
        else:
            plans.append(LeafPlan(rows_per_chunk(tuple(leaf.array.shape), leaf.dtype.itemsize,
                                                 options.chunk_bytes)))
    return plans


def pack_groups(indices: list[int], leaves: list[ArrayLeaf], limit: int) -> Iterator[list[int]]:
    group: list[int] = []
    size = 0
    for i in indices:
        n = leaves[i].nbytes
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(i)
        size += n
    if group:
        yield group


def _divisors_up_to(n: int, limit: int) -> int:
    """The largest divisor of `n` that is at most `limit` (n >= 1)."""
    best = 1
    d = 1
    while d * d <= n:
        if n % d == 0:
            for cand in (d, n // d):
                if cand <= limit and cand > best:
                    best = cand
        d += 1
    return best


def _aligned_chunk_rows(bounds: set[int], target: int, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk such that every shard boundary falls on a chunk boundary."""
    g = 0
    for b in bounds:
        g = math.gcd(g, b)
    if g == 0:
        return target
    best = _divisors_up_to(g, target)
    if best * row_bytes * 8 < chunk_bytes and g * row_bytes <= 8 * chunk_bytes:
        return g  # one larger chunk per boundary beats many tiny ones
    return best


@dataclass(frozen=True)
class TensorLayout:
    """The global chunking of one tensor (what the manifest records) and the rank that
    writes each chunk. `chunk_shape` is None for row blocks of `chunk_rows` rows."""

    shape: tuple[int, ...]
    chunk_rows: int
    chunk_shape: tuple[int, ...] | None
    packed: bool
    owners: tuple[int, ...]  # owners[c]: the rank writing chunk c
    small: bool = False  # a sharded tensor of at most pack_threshold bytes: chunks packed

    def block(self) -> tuple[int, ...]:
        return grid_block(self.shape, self.chunk_rows, self.chunk_shape)

    def region(self, c: int) -> tuple[tuple[int, int], ...]:
        return grid_region(self.shape, self.chunk_rows, self.chunk_shape, self.packed, c)


def grid_block(shape: tuple[int, ...], chunk_rows: int, chunk_shape: tuple[int, ...] | None
               ) -> tuple[int, ...]:
    """The extent of one chunk of a grid: `chunk_shape`, or `chunk_rows` whole rows."""
    if chunk_shape is not None:
        return chunk_shape
    return (chunk_rows, *shape[1:]) if shape else ()


def grid_region(shape: tuple[int, ...], chunk_rows: int, chunk_shape: tuple[int, ...] | None,
                packed: bool, c: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dim of chunk `c` of a grid (a packed tensor is one chunk)."""
    if packed:
        return tuple((0, n) for n in shape)
    return chunk_region(shape, grid_block(shape, chunk_rows, chunk_shape), c)


def _regions(descs: list[list[dict[str, Any]]], i: int) -> list[list[Box]]:
    """Every rank's boxes of leaf i (none: it holds no element)."""
    return [boxes(tuple(tuple(tuple(run) for run in dim) for dim in r[i]["runs"]))
            for r in descs]


#: the chunks of a tensor the saving ranks shard are cut at most 1/RESHARD_SPLIT of a shard
#: wide on each dim (of the whole dim where no rank splits it), so that a job sharding any
#: dim up to that many times finer reads no more than it needs...
RESHARD_SPLIT = 4
#: ...as long as chunks stay at least this big (or chunk_bytes, if smaller)
MIN_RESHARD_CHUNK = 4 << 20


def _chunk_grid(key: str, gshape: tuple[int, ...], itemsize: int,
                regions: list[list[Box]], options: SaveOptions
                ) -> tuple[int, tuple[int, ...] | None]:
    """`grid_of` for the ranks' `regions` of one tensor: the gcd, per dim, of the interior
    boundaries of every rank's boxes."""
    gcds = [0] * len(gshape)
    for box in (b for rank_boxes in regions for b in rank_boxes):
        for d, (a, b) in enumerate(zip(box.start, box.stop)):
            for x in (a, b):
                if 0 < x < gshape[d]:
                    gcds[d] = math.gcd(gcds[d], x)
    return grid_of(gshape, itemsize, gcds, options)


def grid_of(gshape: tuple[int, ...], itemsize: int, gcds: list[int], options: SaveOptions
            ) -> tuple[int, tuple[int, ...] | None]:
    """(chunk_rows, chunk_shape or None for row blocks) of a tensor whose shard boundaries on
    dim d are all multiples of `gcds[d]` (0: no rank's region ends inside dim d), such that
    every boundary falls on a chunk boundary: each chunk then lies whole inside, or wholly
    outside, each rank's region. Dims other than 0 are split only where some rank's region
    ends (chunks as wide as the narrowest aligned piece); dim 0 in blocks of about
    chunk_bytes. Then the chunks of a sharded tensor are cut finer on every dim
    (RESHARD_SPLIT, MIN_RESHARD_CHUNK) so that restoring with other placements reads only
    what it needs. Depends on the gcds only: every rank derives the same grid from them."""
    pieces = [g if g else n for g, n in zip(gcds, gshape)]
    inner_bytes = math.prod(pieces[1:]) * itemsize
    target = max(1, min(gshape[0], options.chunk_bytes // inner_bytes if inner_bytes else 1))
    extents = [_aligned_chunk_rows({gcds[0]} if gcds[0] else set(), target, inner_bytes,
                                   options.chunk_bytes), *pieces[1:]]
    if any(gcds):  # a sharded tensor: any dim may be sharded differently on restore
        _refine(extents, pieces, itemsize, min(options.chunk_bytes, MIN_RESHARD_CHUNK))
    if not any(gcds[1:]) and extents[1:] == list(gshape[1:]):
        return extents[0], None
    return extents[0], tuple(extents)


def _refine(extents: list[int], pieces: list[int], itemsize: int, min_bytes: int) -> None:
    """Halve (by divisors, keeping alignment) the chunk extent of the dim that is widest
    relative to its pieces (a saving shard's extent; the whole dim where none splits it),
    while it is wider than 1/RESHARD_SPLIT of a piece and the chunk stays at least
    `min_bytes`."""
    live = list(range(len(extents)))
    while live:
        d = max(live, key=lambda k: (extents[k] * RESHARD_SPLIT / pieces[k], -k))
        smaller = _divisors_up_to(extents[d], extents[d] // 2) if extents[d] > 1 else 0
        trial = math.prod(extents) // extents[d] * smaller * itemsize
        if (smaller == 0 or extents[d] * RESHARD_SPLIT <= pieces[d] or trial < min_bytes):
            live.remove(d)
            continue
        extents[d] = smaller


def _layout(key: str, gshape: tuple[int, ...], itemsize: int, regions: list[list[Box]],
            options: SaveOptions, load: list[int],
            shared: list[tuple[int, int, int, tuple[int, ...]]], index: int) -> TensorLayout:
    """The layout of one tensor. Chunks only one rank holds are assigned at once (counted in
    `load`); chunks several ranks hold go to `shared` as (bytes, leaf, chunk, holders) for the
    balancing pass. Owners of shared chunks are filled in later (-1 here)."""
    nbytes = math.prod(gshape) * itemsize
    whole = [Box((0,) * len(gshape), (0,) * len(gshape), gshape)]
    sharded = any(reg != whole for reg in regions)
    if not sharded and 0 < nbytes <= options.pack_threshold:
        shared.append((nbytes, index, 0, tuple(range(len(regions)))))
        return TensorLayout(gshape, max(1, gshape[0]) if gshape else 1, None, True, (-1,))
    if not gshape:
        holders = tuple(k for k, reg in enumerate(regions) if reg)
        shared.append((nbytes, index, 0, holders))
        return TensorLayout(gshape, 1, None, False, (-1,))
    if nbytes == 0:
        return TensorLayout(gshape, rows_per_chunk(gshape, itemsize, options.chunk_bytes),
                            None, False, ())
    rows, grid = _chunk_grid(key, gshape, itemsize, regions, options)
    layout = TensorLayout(gshape, rows, grid, False, ())
    n_chunks = math.prod(-(-n // c) for n, c in zip(gshape, layout.block()))
    owners = [-1] * n_chunks
    everyone, partial_holders = _holders(layout, regions, whole, n_chunks)
    for c in range(n_chunks):
        holders = everyone + tuple(partial_holders[c]) if partial_holders[c] else everyone
        if not holders:
            region = layout.region(c)
            raise CkptStoreError(f"{key}: no rank holds the elements {list(region)} of the "
                                 f"global shape {list(gshape)}: the ranks' shards do not "
                                 "cover the tensor")
        size = math.prod(hi - lo for lo, hi in layout.region(c)) * itemsize
        if len(holders) == 1:
            owners[c] = holders[0]
            load[holders[0]] += size
        else:
            shared.append((size, index, c, holders))
    return TensorLayout(gshape, rows, grid, False, tuple(owners),
                        small=nbytes <= options.pack_threshold)


def _holders(layout: TensorLayout, regions: list[list[Box]], whole: list[Box], n_chunks: int
             ) -> tuple[tuple[int, ...], list[list[int]]]:
    """(ranks holding the whole tensor, per chunk the other ranks holding it). Chunk
    boundaries fall on every box boundary, so each box covers whole chunks: they are listed
    from the boxes (work in proportion to the chunks held, not chunks x ranks)."""
    block = layout.block()
    grid = [-(-n // c) for n, c in zip(layout.shape, block)]
    everyone = tuple(k for k, reg in enumerate(regions) if reg == whole)
    others: list[list[int]] = [[] for _ in range(n_chunks)]
    for k, reg in enumerate(regions):
        if reg == whole:
            continue
        for box in reg:
            spans = [range(s // c, -(-(s + n) // c)) for s, n, c in
                     zip(box.start, box.shape, block)]
            for pos in itertools.product(*spans):
                index = 0
                for p, g in zip(pos, grid):
                    index = index * g + p
                if box.contains(layout.region(index)):
                    others[index].append(k)
    return everyone, others


def plan_collective(descs: list[list[dict[str, Any]]], options: SaveOptions
                    ) -> tuple[list[TensorLayout], list[int]]:
    """The same plan on every rank: every leaf's layout and the bytes each rank writes.

    A chunk held by one rank only is written by it; a chunk several ranks hold (replicated
    tensors, replicated mesh dims, whole small tensors packed together) goes, largest first,
    to the holder with the fewest bytes so far. Every chunk is written exactly once."""
    world = len(descs)
    load = [0] * world
    shared: list[tuple[int, int, int, tuple[int, ...]]] = []
    layouts: list[TensorLayout] = []
    for i, d in enumerate(descs[0]):
        gshape = tuple(d["global"])
        layouts.append(_layout(d["key"], gshape, _itemsize(d["dtype"]), _regions(descs, i),
                               options, load, shared, i))
    owners = [list(layout.owners) for layout in layouts]
    for nb, i, c, holders in sorted(shared, key=lambda u: (-u[0], u[1], u[2])):
        k = min(holders, key=lambda r: (load[r], r))
        load[k] += nb
        owners[i][c] = k
    out = [TensorLayout(lay.shape, lay.chunk_rows, lay.chunk_shape, lay.packed, tuple(o),
                        lay.small) for lay, o in zip(layouts, owners)]
    return out, load


def _itemsize(dtype_name: str) -> int:
    return by_name(dtype_name).itemsize


