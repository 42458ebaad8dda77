"""The collective save planned by each rank from its own placements: what a rank computes,
sends and receives does not grow with the world size (docs/design-notes.md, "Collective
saves in O(ranks)").

Every rank of `group` calls `save_by_rank_plans` with its own state; the steps, in order:

1. agree: one all_reduce(MAX) of nine integers: a rank failed to prepare; a rank holds a
   leaf this plan cannot describe (a 0-d tensor in part; then every rank runs
   `distributed.save_collective`, the plan over every rank's description);
   a 62-bit digest of the state's structure (keys, kinds, dtypes, global shapes, which
   leaves are sharded and in how many copies) and its negation (the ranks agree iff
   max == -max(-digest)); "my placements differ from my cached plan's"; and, the same way,
   a digest of the values of the tensors every rank holds whole (`whole_values`: each is
   written by one rank, so copies that differ would be committed as a mix of ranks; they
   fail the save, naming the first such tensor); and a digest of the keys of the values
   that are not tensors (the checkpoint takes them from rank 0's state: a key other ranks
   lack, or hold alone, fails the save).
2. plan: unless no rank's placements changed (the cached plan is used again, as DCP's plan
   caching), the gcd of the interior ends of the ranks' boxes is agreed, per dimension of
   every tensor, by rounds of all_reduce(MIN) over one integer per dimension (`agree_gcds`);
   every rank derives the same grids, index segments and owners of replicated chunks
   (pipeline/rank_planning.py).
3. write: each rank writes the chunks it owns, makes them durable, checks its overlapped
   sources and that the blobs it reuses still exist.
4. exchange: each rank sends each segment's builder the references of its chunks there:
   one all_to_all of fixed-size binary rows (pipeline/rank_segments.py), sizes first.
5. build: each builder assembles its segments' entries (every chunk exactly once; copies of
   a chunk from several ranks must be the same bytes), encodes and writes them, durable
   (pipeline/rank_segments.py).
6. report: one gather to rank 0 of a small JSON record per rank: its error, or the refs of
   the segments it built. Rank 0 receives O(ranks) small records, never chunk references.
7. commit: rank 0 creates the root (tree blob, segment refs) if no rank failed and
   broadcasts the outcome; every rank raises the same error otherwise, nothing committed.

Then every rank remembers its own part of the committed checkpoint (`RankMemory`): its next
save reuses those chunks without reading the checkpoint back.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..deps import missing

try:
    import torch.distributed as dist
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CkptStoreError
from ..format.canonical import canonical_json
from ..format.codecs import Codec
from ..format.hashing import hash_algorithm
from ..format.leaf import ArrayLeaf
from ..format.manifest import SEGMENTED_VERSION, ChunkRef, Manifest
from ..format.segment_encoding import SegmentRef
from ..format.segments import SegmentedEntries
from ..format.tree import CONTAINERS, children, node_kind
from ..layout import missing_blobs, segments_in
from ..pipeline.commit import SaveRequest
from ..pipeline.options import METADATA_THREADS
from ..pipeline.planning import LeafPlan
from ..pipeline.rank_planning import (
    Held,
    RankPlan,
    Unplannable,
    boxes_of,
    copy_writes,
    interior_gcds,
    plan_rank,
)
from ..pipeline.rank_segments import ROW, build_segments, outgoing
from ..pipeline.writer import CheckpointWriter, KnownChunks
from ..stores.base import Store
from .collectives import (
    all_gather_json,
    all_reduce_ints,
    all_to_all_bytes,
    broadcast_json,
    gather_json,
)

#: `agree_gcds`: a tensor no rank's shard ends inside
_NONE = 1 << 62
#: of a tensor every rank holds whole, the bytes the ranks compare before a collective save:
#: all of them up to this size, else this many from evenly spaced places (a copy differing
#: elsewhere only is not seen)
COMPARED_BYTES = 64 << 10
_SAMPLES = 16
#: An error text a rank reports is cut to this many characters (rank 0 gathers them all).
MAX_ERROR_CHARS = 2000

#: `save_by_rank_plans` found a leaf its plan cannot describe: run the general protocol
FALLBACK = object()


class StepClock:
    """Seconds of each step of one save on this rank, and the bytes it sent and received
    (`RankMemory.last`: what bench/scale_bench.py compares with its simulation)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def lap(self, step: str, **counts: int) -> None:
        now = time.perf_counter()
        self.seconds[step] = now - self.t
        self.t = now
        self.counts.update(counts)

    def done(self) -> dict[str, Any]:
        return {"seconds": dict(self.seconds), **self.counts}


@dataclass
class RankMemory:
    """What one rank keeps between the collective saves of one job (the CheckpointManager
    holds it): the last plan (plan caching), and its own part of the checkpoint it last
    committed, so that the next save reuses those chunks without reading that checkpoint."""

    plan: RankPlan | None = None
    #: the steps of the last save this rank took part in (StepClock.done)
    last: dict[str, Any] = field(default_factory=dict)
    committed: str | None = None
    chunks: list[tuple[ChunkRef, Codec | None]] = field(default_factory=list)
    index_blobs: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def known_chunks(self, parent: str) -> KnownChunks | None:
        """The chunks of `parent` this rank wrote or reused, if `parent` is the checkpoint
        it last committed; None otherwise (the parent must then be read)."""
        with self.lock:
            if parent != self.committed:
                return None
            known = KnownChunks()
            for ref, codec in self.chunks:
                known.add(ref, codec)
            known.index_blobs.update(self.index_blobs)
            return known

    def remember(self, name: str, chunks: list[tuple[ChunkRef, Codec | None]],
                 index_blobs: set[str]) -> None:
        with self.lock:
            self.committed, self.chunks, self.index_blobs = name, chunks, index_blobs


def report_failure(group: Any, error: str) -> None:
    """Take part in a collective save only to report that this rank failed before it could
    start: every rank raises this error (step 1, then the errors are all-gathered)."""
    all_reduce_ints([1, 0, 0, 0, 0, 0, 0, 0, 0], group)
    all_gather_json(error[:MAX_ERROR_CHARS], group)


def _structure(leaves: list[ArrayLeaf]) -> int:
    """62 bits of a digest of what every rank must agree on."""
    h = xxhash.xxh64()
    for leaf in leaves:
        shape = tuple(leaf.global_shape or leaf.array.shape)
        h.update(f"{leaf.key}\0{leaf.kind}\0{leaf.dtype.name}\0{shape}\0"
                 f"{int(leaf.is_partial)}\0{leaf.replica[1]}\n".encode("utf-8",
                                                                     "surrogatepass"))
    return h.intdigest() >> 2


def value_keys(tree: Any) -> int:
    """62 bits of a digest of the dotted keys, in order, of the state's values that are not
    tensors or bytes (numbers, strings, None under their containers; `tree`: the encoded
    state tree)."""
    h = xxhash.xxh64()

    def walk(node: Any, key: str) -> None:
        kind, value = node_kind(node)
        if kind in CONTAINERS:
            for name, child in children(kind, value):
                walk(child, f"{key}.{name}" if key else str(name))
        elif kind not in ("tensor", "bytes"):
            h.update(f"{key}\n".encode("utf-8", "surrogatepass"))

    walk(tree, "")
    return h.intdigest() >> 2


def whole_values(leaves: list[ArrayLeaf], boxes: list[Held | None]) -> list[int]:
    """For each leaf every rank holds whole (no box) in host memory: 62 bits of a digest of
    its bytes (up to COMPARED_BYTES of them: the leading dimension's evenly spaced slices);
    0 for the others (sharded, on a device)."""
    out = []
    for leaf, held in zip(leaves, boxes):
        a = leaf.array
        if held is not None or not isinstance(a, np.ndarray) or leaf.is_partial:
            out.append(0)
            continue
        flat = a.reshape(-1) if a.ndim > 1 and a.flags.c_contiguous else a
        if flat.ndim and flat.nbytes > COMPARED_BYTES:
            n = len(flat)
            width = max(1, n * COMPARED_BYTES // (_SAMPLES * flat.nbytes))
            starts = np.linspace(0, n - width, _SAMPLES).astype(np.int64)
            flat = np.concatenate([flat[s:s + width] for s in starts])
        out.append(xxhash.xxh64_intdigest(np.ascontiguousarray(flat).view(np.uint8).data) >> 2)
    return out


def _first_different(values: list[int], group: Any) -> int | None:
    """The index of the first entry of `values` (the same length on every rank) that is not
    the same on every rank, or None."""
    reduced = all_reduce_ints([*values, *(-v for v in values)], group)
    n = len(values)
    return next((i for i in range(n) if reduced[i] != -reduced[n + i]), None)


def _signature(structure: int, boxes: list[Held | None], world: int, rank: int,
               writer: CheckpointWriter) -> int:
    o = writer.options
    return xxhash.xxh64_intdigest(canonical_json(
        [structure, [None if b is None else b.to_json() for b in boxes], world, rank,
         o.chunk_bytes, o.pack_threshold]))


def local_gcds(leaves: list[ArrayLeaf], boxes: list[Held | None]) -> list[int]:
    """`interior_gcds` of every leaf's boxes, flattened (one per dimension of each tensor):
    what `agree_gcds` reduces."""
    return [g for leaf, b in zip(leaves, boxes)
            for g in interior_gcds(b, tuple(leaf.global_shape or leaf.array.shape))]


def per_tensor(leaves: list[ArrayLeaf], flat: list[int]) -> list[list[int]]:
    """`flat` (as `local_gcds` lays it out) cut back into one list per tensor."""
    out, at = [], 0
    for leaf in leaves:
        n = len(leaf.global_shape or leaf.array.shape)
        out.append(flat[at:at + n])
        at += n
    return out


def agree_gcds(local: list[int], group: Any) -> list[int]:
    """The gcd over every rank of each element of `local` (0: none anywhere), by rounds of
    all_reduce(MIN): each rank replaces its value by its gcd with the minimum until the
    minimum stops changing, which it does where every rank's value equals it (usually two
    rounds). The decision to stop is the same on every rank: it reads reduced values only."""
    values = [v if v else _NONE for v in local]
    low = all_reduce_ints(values, group, op="min")
    while True:
        values = [v if v == _NONE or m == _NONE else math.gcd(v, m)
                  for v, m in zip(values, low)]
        again = all_reduce_ints(values, group, op="min")
        if again == low:
            return [0 if m == _NONE else m for m in low]
        low = again


class ChunkParts:
    """The chunks one rank writes in a collective save, each handed to the writer as a leaf
    of its own (a view of the local array: no copy unless strided), so that the writer's
    jobs, budget and overlapped staging apply unchanged. `write` returns
    {(tensor, global chunk): ref}."""

    def __init__(self) -> None:
        self.parts: list[ArrayLeaf] = []
        self.plans: list[LeafPlan] = []
        #: parts[j] is chunk where[j][1] of tensor where[j][0]
        self.where: list[tuple[int, int]] = []

    def whole(self, i: int, leaf: ArrayLeaf, chunk_rows: int, packed: bool) -> None:
        """Tensor `i` as its one chunk (packed small tensors, 0-d tensors)."""
        self.parts.append(leaf)
        self.plans.append(LeafPlan(chunk_rows, packed=packed))
        self.where.append((i, 0))

    def chunk(self, i: int, c: int, leaf: ArrayLeaf, region: tuple[tuple[int, int], ...],
              start: tuple[int, ...], local: tuple[int, ...], small: bool) -> None:
        """Chunk `c` of tensor `i`: the global `region` of a local array holding global
        indexes `start`... at local indexes `local`...; the chunks of small sharded tensors
        (FSDP-sharded norms, biases) are packed together."""
        view = leaf.array[tuple(slice(lo - s + loc, hi - s + loc) for (lo, hi), s, loc
                                in zip(region, start, local))]
        self.parts.append(leaf.with_array(view))
        self.plans.append(LeafPlan(max(1, region[0][1] - region[0][0]), packed=small))
        self.where.append((i, c))

    def write(self, writer: CheckpointWriter) -> dict[tuple[int, int], ChunkRef]:
        refs = writer.write_blobs(self.parts, self.plans, leaf_of=[i for i, _c in self.where])
        return {self.where[j]: ref for (j, _zero), ref in refs.items()}


def _write_mine(writer: CheckpointWriter, leaves: list[ArrayLeaf],
                boxes: list[Held | None], plan: RankPlan) -> dict[tuple[int, int], ChunkRef]:
    """Write the chunks the plan gives this rank: {(tensor, chunk): ref}."""
    out = ChunkParts()
    for i, (leaf, held, g) in enumerate(zip(leaves, boxes, plan.grids)):
        if held is None:
            owned = plan.mine.get(i, [])
            if owned and (g.packed or not g.shape):
                out.whole(i, leaf, g.chunk_rows, g.packed)
                continue
            zero: tuple[int, ...] = (0,) * len(g.shape)
            for c in owned:
                out.chunk(i, c, leaf, g.region(c), zero, zero, g.small)
            continue
        for box, local in zip(held.boxes, held.local):  # strided shards: several
            start = tuple(lo for lo, _hi in box)
            for c in g.chunks_in_box(box):
                if copy_writes(i, c, leaf.replica):
                    out.chunk(i, c, leaf, g.region(c), start, local, g.small)
    return out.write(writer)


def _error(rank: int, exc: BaseException) -> str:
    return f"rank {rank}: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def save_by_rank_plans(writer: CheckpointWriter, request: SaveRequest, group: Any,
                       memory: RankMemory) -> Manifest | None | object:
    """Run the collective save (module docstring). Returns the manifest on rank 0, None on
    the others, or FALLBACK on every rank when the state needs `save_collective`; raises the
    same CkptStoreError on every rank if any rank failed (nothing committed)."""
    name, leaves = request.name, request.leaves
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    clock = StepClock()
    try:
        boxes = [boxes_of(leaf) for leaf in leaves]
        describable = True
    except Unplannable:
        boxes, describable = [], False
    structure = _structure(leaves)
    signature = _signature(structure, boxes, world, rank, writer) if describable else 0
    cached = memory.plan if memory.plan is not None and memory.plan.signature == signature \
        else None
    values = whole_values(leaves, boxes) if describable else []
    held = xxhash.xxh64_intdigest(canonical_json(values)) >> 2
    keys = value_keys(request.tree)
    (failed, odd, high, neg_low, changed, same_high, same_neg_low, keys_high,
     keys_neg_low) = all_reduce_ints([0, int(not describable), structure, -structure,
                                      int(cached is None), held, -held, keys, -keys], group)
    if failed:
        errors = [e for e in all_gather_json(None, group) if e is not None]
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: "
                             f"{errors[0]}")
    if keys_high != -keys_neg_low:
        raise CkptStoreError(
            f"collective save of {name!r} failed, nothing committed: the ranks' states hold "
            "values that are not tensors under different keys; the checkpoint takes them from "
            "rank 0's state, so a key only other ranks hold would be lost (every rank must "
            "save the same keys; per-rank values belong in a Shard of rows)")
    if odd or high != -neg_low:  # the general protocol (which names any disagreement)
        return FALLBACK
    if same_high != -same_neg_low:
        i = _first_different(values, group)
        key = leaves[i].key if i is not None else "?"
        raise CkptStoreError(
            f"collective save of {name!r} failed, nothing committed: the ranks hold different "
            f"values in {key!r}, a tensor every rank holds whole (each chunk is written by one "
            "rank: they must be the same; keep per-rank values in a Shard of rows, or "
            "RNGState for generator states)")

    # 2. plan (or the cached plan, if no rank's placements changed). From here on every rank
    # takes part in every collective whatever fails on it, and reports its error at step 6
    clock.lap("agree")
    error = None
    plan: RankPlan | None = None
    if changed or cached is None:
        dims = sum(len(leaf.global_shape or leaf.array.shape) for leaf in leaves)
        try:
            local = local_gcds(leaves, boxes)
        except Exception as exc:  # reported to rank 0 below
            error, local = _error(rank, exc), [0] * dims
        agreed = agree_gcds(local, group)  # every rank takes part, failed or not
        if error is None:
            try:
                plan = plan_rank(leaves, boxes, per_tensor(leaves, agreed), signature,
                                 writer.options, rank, world)
            except Exception as exc:  # reported to rank 0 below
                error = _error(rank, exc)
    else:
        plan = cached
    memory.plan = plan
    clock.lap("plan", cached=int(plan is not None and plan is cached))

    # 3. write
    refs: dict[tuple[int, int], ChunkRef] = {}
    if plan is not None:
        try:
            refs = _write_mine(writer, leaves, boxes, plan)
            writer.store.sync()
            writer.confirm_sources()  # this rank's last check of overlapped sources
            if writer.confirm_reused is not None:
                writer.confirm_reused(writer.reused_blobs(ref.blob for ref in refs.values()))
        except Exception as exc:  # reported to rank 0 below
            error, refs = _error(rank, exc), {}

    # 4-5. exchange, build
    clock.lap("write")
    sent = outgoing(refs, plan, world) if plan is not None else [b""] * world
    received = np.frombuffer(b"".join(all_to_all_bytes(sent, group)), dtype=ROW)
    clock.lap("exchange", sent=sum(len(p) for p in sent), received=received.nbytes)
    built: list[list[Any]] = []
    build_error = None
    if error is None and plan is not None:
        try:
            built = build_segments(writer, received, plan, leaves, rank, world)
        except Exception as exc:
            build_error = _error(rank, exc)
    clock.lap("build")

    # 6. report
    records = gather_json({"error": error, "build_error": build_error, "segments": built},
                          group)
    clock.lap("report")

    # 7. commit
    manifest = None
    outcome: dict[str, Any] = {"ok": True}
    if records is not None:
        # what gather_json received: every record padded to the longest
        clock.counts["gathered"] = len(records) * max(len(canonical_json(r)) for r in records)
        try:
            if plan is None:
                raise _RankFailed(str(error))
            manifest = commit_root(writer, request, plan, records)
        except Exception as exc:
            outcome = {"error": str(exc) if isinstance(exc, _RankFailed) else _error(0, exc)}
    outcome = broadcast_json(outcome, group)
    clock.lap("commit")
    memory.last = clock.done()
    if "error" in outcome or plan is None:
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: "
                             f"{outcome.get('error', error)}")
    codecs = {i: None if g.packed or g.small else writer.options.compression
              for i, g in enumerate(plan.grids)}
    index_blobs = {str(b[1]) for b in built}
    if manifest is not None:  # rank 0: the tree's blobs too
        index_blobs.update(r.digest for r in manifest.index_blobs())
    memory.remember(name, [(ref, codecs[i]) for (i, _c), ref in refs.items()], index_blobs)
    return manifest


class _RankFailed(Exception):
    """A rank's reported error (its text is already prefixed by the rank)."""


def _check_shared(store: Store, built_by: dict[str, int]) -> None:
    """Rank 0, before its commit: the index segments other ranks built ({digest: rank}) are
    in its store. They are not where the ranks do not share tier 0 (a node-local folder on
    every node): committing then would name blobs rank 0's store lacks."""
    lost = missing_blobs(store, built_by, METADATA_THREADS)
    if lost:
        raise _RankFailed(
            f"rank 0: the index segment rank {built_by[lost[0]]} built ({lost[0]}) is not in "
            f"{store.uri} ({len(lost)} in all): every rank must save to the same tier 0 (one "
            "folder or bucket all ranks reach)")


def commit_root(writer: CheckpointWriter, request: SaveRequest, plan: RankPlan,
                records: list[Any]) -> Manifest:
    """Rank 0: the root of every rank's segments, committed, if no rank failed."""
    for field_name in ("error", "build_error"):  # a rank's own failure before its consequences
        for rec in records:
            if rec[field_name] is not None:
                raise _RankFailed(rec[field_name])
    found: dict[int, SegmentRef] = {}
    for rec in records:
        for s, digest, size, tensors, nbytes in rec["segments"]:
            found[int(s)] = SegmentRef(str(digest), int(size), int(tensors), int(nbytes))
    if sorted(found) != list(range(len(plan.spans))):
        raise _RankFailed(f"rank 0: {len(plan.spans) - len(found)} index segment(s) were "
                          "built by no rank")
    _check_shared(writer.store, {str(seg[1]): r for r, rec in enumerate(records) if r
                                 for seg in rec["segments"]})
    refs = [found[s] for s in range(len(plan.spans))]
    algorithm = hash_algorithm(writer.options.hash.name)
    tensors = SegmentedEntries(refs, segments_in([writer.store], algorithm),
                               f"checkpoint {request.name!r}")
    manifest = Manifest(name=request.name, created=writer.creation_time(),
                        metadata=request.metadata, tree=request.tree, tensors=tensors,
                        parent=request.parent, hash=algorithm.name, version=SEGMENTED_VERSION)
    # each rank confirmed the chunk blobs it reused; the index blobs (segments the builders
    # found in the store, the tree's) are confirmed here, after every builder reported
    reused = writer.reused_blobs(r.digest for r in manifest.index_blobs())
    writer.commit(manifest, request.manifest_key, reused=reused)
    return manifest
