"""Multi-rank saves over torch.distributed, without pickle.

Protocol of one collective save (every rank calls `save_collective` with its own state):
1. every rank describes its array leaves; the descriptions are all-gathered as JSON and
   checked for agreement (same keys, dtypes, global shapes);
2. every rank derives the same plan (`plan_collective`): each tensor's global chunk grid, its
   chunk boundaries aligned to every rank's shard boundaries on every dim (row blocks when
   only dim 0 is sharded, an N-D grid otherwise), so each chunk lies whole inside the region
   of every rank holding it; a chunk one rank holds is written by it, a chunk several ranks
   hold (replicated tensors or mesh dims) goes to the least-loaded holder, largest first.
   Every chunk is written exactly once in total;
3. every rank writes the chunks it owns and makes them durable (`store.sync()`), then the
   chunk references (or the rank's error) are gathered on rank 0;
4. rank 0 commits the one manifest only if no rank failed, and broadcasts the outcome; every
   rank raises the same error if anything failed. Nothing is committed otherwise.

Collectives run on a gloo group of their own (see `checkpoint_group`), so a background save
never interleaves with the trainer's own collectives.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..deps import missing

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CkptStoreError
from ..format.canonical import canonical_json
from ..format.codecs import Codec
from ..format.leaf import ArrayLeaf
from ..format.manifest import ChunkRef, Manifest, StorageRef, TensorEntry, chunk_region
from ..format.regions import Box, Runs, block_runs, boxes
from ..pipeline.commit import SaveRequest
from ..pipeline.writer import (
    CheckpointWriter,
    LeafPlan,
    SaveInfo,
    SaveOptions,
    rows_per_chunk,
    storage_refs,
)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checkpoint_group(timeout: timedelta = timedelta(minutes=10)) -> Any:
    """A new gloo group over all ranks for checkpoint collectives (collective call)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def all_gather_json(obj: Any, group: Any) -> list[Any]:
    """All-gather one JSON value per rank (uint8 tensors; no pickle)."""
    data = canonical_json(obj)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(s.item())].numpy())) for b, s in zip(bufs, sizes)]


def broadcast_json(obj: Any, group: Any, src: int = 0) -> Any:
    """Broadcast rank `src`'s JSON value to every rank (other ranks pass anything)."""
    data = canonical_json(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()))


def report_failure(group: Any, error: str) -> None:
    """Join a collective save only to report that this rank failed before it could start;
    the other ranks raise the same error after the first gather instead of waiting."""
    all_gather_json({"error": error}, group)


def _describe(leaf: ArrayLeaf) -> dict[str, Any]:
    shape = [int(s) for s in leaf.array.shape]
    return {"key": leaf.key, "kind": leaf.kind, "dtype": leaf.dtype.name, "shape": shape,
            "global": list(leaf.global_shape) if leaf.global_shape is not None else shape,
            "runs": [list(map(list, r)) for r in _leaf_runs(leaf)], "partial": leaf.is_partial}


def _first_error(items: list[Any]) -> str | None:
    for item in items:
        if isinstance(item, dict) and "error" in item:
            return str(item["error"])
    return None


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
        if self.chunk_shape is not None:
            return self.chunk_shape
        return (self.chunk_rows, *self.shape[1:]) if self.shape else ()

    def region(self, c: int) -> tuple[tuple[int, int], ...]:
        if self.packed:
            return tuple((0, n) for n in self.shape)
        return chunk_region(self.shape, self.block(), c)


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
    """(chunk_rows, chunk_shape or None for row blocks) such that every shard boundary of
    every dim falls on a chunk boundary: each chunk then lies whole inside, or wholly outside,
    each rank's region. Dims other than 0 are split only where some rank's region ends
    (chunks as wide as the narrowest aligned piece); dim 0 in blocks of about chunk_bytes.
    Then the chunks of a sharded tensor are cut finer on every dim (RESHARD_SPLIT,
    MIN_RESHARD_CHUNK) so that restoring with other placements reads only what it needs."""
    bounds: list[set[int]] = [set() for _ in gshape]
    for box in (b for rank_boxes in regions for b in rank_boxes):
        for d, (a, b) in enumerate(zip(box.start, box.stop)):
            bounds[d].update(x for x in (a, b) if 0 < x < gshape[d])
    pieces = []
    for d in range(len(gshape)):
        g = 0
        for b in bounds[d]:
            g = math.gcd(g, b)
        pieces.append(g if g else gshape[d])
    inner_bytes = math.prod(pieces[1:]) * itemsize
    target = max(1, min(gshape[0], options.chunk_bytes // inner_bytes if inner_bytes else 1))
    extents = [_aligned_chunk_rows(bounds[0], target, inner_bytes, options.chunk_bytes),
               *pieces[1:]]
    if any(bounds):  # a sharded tensor: any dim may be sharded differently on restore
        _refine(extents, pieces, itemsize, min(options.chunk_bytes, MIN_RESHARD_CHUNK))
    if not any(bounds[1:]) and extents[1:] == list(gshape[1:]):
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
    from ..format.dtypes import by_name

    return by_name(dtype_name).itemsize


def _check_agreement(descs: list[list[dict[str, Any]]]) -> None:
    base = descs[0]
    for rank, d in enumerate(descs[1:], start=1):
        if len(d) != len(base):
            raise CkptStoreError(f"rank {rank} saves {len(d)} tensors, rank 0 saves {len(base)}")
        for a, b in zip(base, d):
            for field in ("key", "kind", "dtype", "global"):
                if a[field] != b[field]:
                    raise CkptStoreError(f"ranks disagree on tensor {a['key']!r}: {field} "
                                         f"{a[field]} (rank 0) vs {b[field]} (rank {rank})")
            if not a["partial"] and not b["partial"] and a["shape"] != b["shape"]:
                raise CkptStoreError(f"replicated tensor {a['key']!r} differs in shape")


def save_collective(writer: CheckpointWriter | None, request: SaveRequest, group: Any,
                    prepare_error: str | None = None) -> Manifest | None:
    """Run the collective save (module docstring). Returns the manifest on rank 0, None on
    the others; raises the same CkptStoreError on every rank if any rank failed. With
    `prepare_error` this rank failed before it could write (`writer` may be None): every rank
    raises."""
    name, tree, leaves, metadata = request.name, request.tree, request.leaves, request.metadata
    parent, manifest_key = request.parent, request.manifest_key
    rank = dist.get_rank(group)
    descs = all_gather_json({"error": prepare_error} if prepare_error else
                            [_describe(leaf) for leaf in leaves], group)
    err = _first_error(descs)
    if err is None:
        assert writer is not None  # no rank reported a prepare error: this one has a writer
        try:
            _check_agreement(descs)
            layouts, _load = plan_collective(descs, writer.options)
        except CkptStoreError as exc:
            err = str(exc)
    if err is not None:
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: {err}")
    assert writer is not None  # only a rank that failed to prepare has none, and it raised

    try:
        refs = _write_owned(writer, leaves, layouts, rank)
        writer.store.sync()
        writer.confirm_sources()  # this rank's last check: rank 0 may commit once it reports
        status: Any = [[i, c, ref.to_json()] for (i, c), ref in sorted(refs.items())]
    except Exception as exc:  # reported to every rank below
        status = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    statuses = all_gather_json(status, group)

    manifest = None
    outcome: dict[str, Any] = {"ok": True}
    if rank == 0:
        err = _first_error(statuses)
        if err is None:
            try:
                all_refs = {(i, c): ChunkRef(**ref) for st in statuses for i, c, ref in st}
                entries = _entries(leaves, layouts, all_refs, writer.options.compression,
                                   _replicated_storage(leaves, descs))
                manifest = Manifest(name=name, created=writer.creation_time(), metadata=metadata,
                                    tree=tree, tensors=entries, parent=parent,
                                    hash=writer.options.hash.name)
                writer.commit(manifest, manifest_key)
            except Exception as exc:
                err = f"rank 0: {type(exc).__name__}: {exc}"
        if err is not None:
            outcome = {"error": err}
    outcome = broadcast_json(outcome, group)
    if "error" in outcome:
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: "
                             f"{outcome['error']}")
    return manifest


def _write_owned(writer: CheckpointWriter, leaves: list[ArrayLeaf],
                 layouts: list[TensorLayout], rank: int) -> dict[tuple[int, int], ChunkRef]:
    """Write the chunks `layouts` give this rank: {(leaf, global chunk): ref}. Each owned
    chunk of a row-block or grid tensor is handed to the writer as a leaf of its own (a view
    of the local tensor: no copy unless the block is strided), so the writer's jobs, budget
    and overlapped staging apply unchanged."""
    parts: list[ArrayLeaf] = []
    plans: list[LeafPlan] = []
    where: list[tuple[int, int]] = []  # parts[j] is chunk where[j][1] of leaf where[j][0]
    for i, (leaf, lay) in enumerate(zip(leaves, layouts)):
        mine = [c for c, k in enumerate(lay.owners) if k == rank]
        if not mine:
            continue
        if lay.packed or not lay.shape:
            parts.append(leaf)
            plans.append(LeafPlan(lay.chunk_rows, packed=lay.packed))
            where.append((i, 0))
            continue
        my_boxes = boxes(_leaf_runs(leaf))
        for c in mine:
            region = lay.region(c)
            box = next(b for b in my_boxes if b.contains(region))
            view = leaf.array[tuple(slice(lo - s + loc, hi - s + loc) for (lo, hi), s, loc
                                    in zip(region, box.start, box.local))]
            parts.append(leaf.with_array(view))
            # the chunks of small sharded tensors (FSDP-sharded norms, biases) share blobs
            plans.append(LeafPlan(max(1, region[0][1] - region[0][0]), packed=lay.small))
            where.append((i, c))
    overlap = writer.overlap
    if overlap is not None:
        writer.overlap = _RemappedOverlap(overlap, [i for i, _c in where])  # type: ignore[assignment]
    try:
        refs = writer.write_blobs(parts, plans)
    finally:
        writer.overlap = overlap
    return {where[j]: ref for (j, _zero), ref in refs.items()}


def _leaf_runs(leaf: ArrayLeaf) -> Runs:
    """Where the leaf's array lies in the global tensor."""
    if leaf.region_runs is not None:
        return leaf.region_runs
    offset = (leaf.row_offset,) + (0,) * (leaf.array.ndim - 1) if leaf.array.ndim else ()
    return block_runs(offset, tuple(int(n) for n in leaf.array.shape))


class _RemappedOverlap:
    """An Overlap seen through a map from the writer's part index to the state's leaf index
    (the writer numbers the per-chunk parts `_write_owned` hands it)."""

    def __init__(self, overlap: Any, leaf_of: list[int]) -> None:
        self._overlap = overlap
        self._leaf_of = leaf_of

    def expect(self, counts: dict[int, int]) -> None:
        total: dict[int, int] = {}
        for j, n in counts.items():
            total[self._leaf_of[j]] = total.get(self._leaf_of[j], 0) + n
        self._overlap.expect(total)

    def check(self, j: int) -> None:
        self._overlap.check(self._leaf_of[j])

    def copied(self, j: int) -> None:
        self._overlap.copied(self._leaf_of[j])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._overlap, name)


def _entries(leaves: list[ArrayLeaf], layouts: list[TensorLayout],
             refs: dict[tuple[int, int], ChunkRef], compression: Codec | None,
             storage: list[StorageRef | None]) -> tuple[TensorEntry, ...]:
    """The manifest's tensor entries: global shapes and chunking, every chunk's ref."""
    out = []
    for i, (leaf, lay) in enumerate(zip(leaves, layouts)):
        try:
            chunks = tuple(refs[(i, c)] for c in range(len(lay.owners)))
        except KeyError as exc:
            raise CkptStoreError(f"{leaf.key}: chunk {exc.args[0][1]} was written by no "
                                 "rank") from None
        out.append(TensorEntry(
            key=leaf.key, kind=leaf.kind, dtype=leaf.dtype, shape=lay.shape,
            chunk_rows=lay.chunk_rows, codec=None if lay.packed or lay.small else compression,
            chunks=chunks, requires_grad=leaf.requires_grad, parameter=leaf.parameter,
            storage=storage[i], chunk_shape=lay.chunk_shape))
    return tuple(out)


def _replicated_storage(leaves: list[ArrayLeaf], descs: list[list[dict[str, Any]]]
                        ) -> list[StorageRef | None]:
    """Shared-storage records (tied weights) of tensors no rank holds only part of."""
    refs = storage_refs(leaves)
    return [None if any(r[i]["partial"] for r in descs) else ref
            for i, ref in enumerate(refs)]


class CollectiveCommitter:
    """A save by every rank of `group`, committed once (pipeline/commit.py's protocol).
    `after_commit` runs on the rank that committed (rank 0). `joined` tells whether this rank
    entered the collective (if not, a failure must still be reported to the others)."""

    def __init__(self, group: Any, after_commit: Callable[[SaveInfo], None] | None = None
                 ) -> None:
        self.group = group
        self.after_commit = after_commit
        self.joined = False

    def prepare_failed(self, name: str, error: str) -> None:
        self.joined = True
        save_collective(None, SaveRequest(name, None, [], {}, None, ""), self.group,
                        prepare_error=error)

    def commit(self, writer: CheckpointWriter, request: SaveRequest) -> Manifest | None:
        self.joined = True
        return save_collective(writer, request, self.group)

    def committed(self, info: SaveInfo) -> None:
        if self.after_commit is not None:
            self.after_commit(info)
