"""Multi-rank saves over torch.distributed, without pickle.

A collective save starts with `rank_save.save_by_rank_plans`, whose per-rank costs do not grow
with the world size; for states it cannot plan (a leaf held in several boxes per rank:
FSDP2's strided shards over tensor parallelism) every rank then runs `save_collective`, the
general protocol below, planned over every rank's description.

Protocol of `save_collective` (every rank calls it with its own state):
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

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..deps import missing

try:
    import torch.distributed as dist
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CkptStoreError
from ..format.codecs import Codec
from ..format.leaf import ArrayLeaf
from ..format.manifest import ChunkRef, Manifest, StorageRef, TensorEntry
from ..format.regions import Runs, block_runs, boxes
from ..format.segments import version_for
from ..pipeline.commit import SaveRequest
from ..pipeline.options import SaveInfo
from ..pipeline.planning import TensorLayout, plan_collective
from ..pipeline.writer import CheckpointWriter, KnownChunks, storage_refs
from . import rank_save
from .collectives import all_gather_json as all_gather_json
from .collectives import broadcast_json as broadcast_json


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checkpoint_group(timeout: timedelta = timedelta(minutes=10)) -> Any:
    """A new gloo group over all ranks for checkpoint collectives (collective call)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def report_failure(group: Any, error: str) -> None:
    """Join a collective save only to report that this rank failed before it could start;
    the other ranks raise the same error after the save's first collective."""
    rank_save.report_failure(group, error)


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


def save_collective(writer: CheckpointWriter, request: SaveRequest, group: Any
                    ) -> Manifest | None:
    """Run the general collective save (module docstring), after the first step of
    `rank_save.save_by_rank_plans` sent every rank here. Returns the manifest on rank 0, None
    on the others; raises the same CkptStoreError on every rank if any rank failed."""
    name, tree, leaves, metadata = request.name, request.tree, request.leaves, request.metadata
    parent, manifest_key = request.parent, request.manifest_key
    rank = dist.get_rank(group)
    descs = all_gather_json([_describe(leaf) for leaf in leaves], group)
    err = None
    try:
        _check_agreement(descs)
        layouts, _load = plan_collective(descs, writer.options)
    except CkptStoreError as exc:
        err = str(exc)
    if err is not None:
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: {err}")

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
                                    hash=writer.options.hash.name,
                                    version=version_for(entries))
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
    """Write the chunks `layouts` give this rank: {(leaf, global chunk): ref}."""
    out = rank_save.ChunkParts()
    for i, (leaf, lay) in enumerate(zip(leaves, layouts)):
        mine = [c for c, k in enumerate(lay.owners) if k == rank]
        if not mine:
            continue
        if lay.packed or not lay.shape:
            out.whole(i, leaf, lay.chunk_rows, lay.packed)
            continue
        my_boxes = boxes(_leaf_runs(leaf))
        for c in mine:
            region = lay.region(c)
            box = next(b for b in my_boxes if b.contains(region))
            out.chunk(i, c, leaf, region, box.start, box.local, lay.small)
    return out.write(writer)


def _leaf_runs(leaf: ArrayLeaf) -> Runs:
    """Where the leaf's array lies in the global tensor."""
    if leaf.region_runs is not None:
        return leaf.region_runs
    offset = (leaf.row_offset,) + (0,) * (leaf.array.ndim - 1) if leaf.array.ndim else ()
    return block_runs(offset, tuple(int(n) for n in leaf.array.shape))


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

    def __init__(self, group: Any, after_commit: Callable[[SaveInfo], None] | None = None,
                 memory: rank_save.RankMemory | None = None) -> None:
        self.group = group
        self.after_commit = after_commit
        self.joined = False
        #: this rank's plan and part of the last checkpoint it committed (kept by the caller
        #: across saves: CheckpointManager)
        self.memory = memory if memory is not None else rank_save.RankMemory()

    def prepare_failed(self, name: str, error: str) -> None:
        self.joined = True
        rank_save.report_failure(self.group, error)
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: {error}")

    def known_chunks(self, parent: str) -> KnownChunks | None:
        return self.memory.known_chunks(parent)

    def commit(self, writer: CheckpointWriter, request: SaveRequest) -> Manifest | None:
        self.joined = True
        result = rank_save.save_by_rank_plans(writer, request, self.group, self.memory)
        if result is rank_save.FALLBACK:
            return save_collective(writer, request, self.group)
        assert result is None or isinstance(result, Manifest)
        return result

    def committed(self, info: SaveInfo) -> None:
        if self.after_commit is not None:
            self.after_commit(info)
