"""Multi-rank saves over torch.distributed, without pickle.

Protocol of one collective save (every rank calls `save_collective` with its own state):
1. every rank describes its array leaves; the descriptions are all-gathered as JSON and
   checked for agreement (same keys, dtypes, global shapes);
2. every rank derives the same plan: a replicated tensor's chunks are spread over the ranks
   (each written once in total), a sharded tensor's chunks are written by the rank holding
   their rows (chunk boundaries aligned to shard boundaries);
3. every rank writes the chunks it owns and makes them durable (`store.sync()`), then the
   chunk references (or the rank's error) are gathered on rank 0;
4. rank 0 commits the one manifest only if no rank failed, and broadcasts the outcome; every
   rank raises the same error if anything failed. Nothing is committed otherwise.

Collectives run on a gloo group of their own (see `checkpoint_group`), so a background save
never interleaves with the trainer's own collectives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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
from ..format.leaf import ArrayLeaf
from ..format.manifest import ChunkRef, Manifest
from ..pipeline.commit import SaveRequest
from ..pipeline.writer import (
    CheckpointWriter,
    LeafPlan,
    SaveInfo,
    SaveOptions,
    TensorSpec,
    build_entries,
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
            "offset": leaf.row_offset, "partial": leaf.is_partial}


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


def plan_collective(descs: list[list[dict[str, Any]]], rank: int,
                    options: SaveOptions) -> tuple[list[LeafPlan], list[tuple[int, ...]]]:
    """The same plan on every rank: this rank's LeafPlans and every leaf's global shape.

    Sharded rows are written by their holder. Replicated work (chunks of big tensors, whole
    small tensors) is then handed out largest first to the rank with the fewest bytes so far,
    so every rank writes about 1/world of the bytes."""
    world = len(descs)
    mine = descs[rank]
    plans: list[LeafPlan | None] = []
    shapes: list[tuple[int, ...]] = []
    load = [0] * world
    units: list[tuple[int, int, int]] = []  # (bytes, leaf, chunk) of replicated work
    for i, d in enumerate(mine):
        gshape = tuple(d["global"])
        itemsize = _itemsize(d["dtype"])
        nbytes = math.prod(gshape) * itemsize
        target = rows_per_chunk(gshape, itemsize, options.chunk_bytes)
        row_bytes = math.prod(gshape[1:]) * itemsize
        shapes.append(gshape)
        if any(r[i]["partial"] for r in descs):
            holders = sorted((r[i]["offset"], r[i]["offset"] + r[i]["shape"][0], k)
                             for k, r in enumerate(descs) if r[i]["shape"][0] > 0)
            bounds = {a for a, _b, _k in holders if a} | {b for _a, b, _k in holders
                                                          if b != gshape[0]}
            rows = _aligned_chunk_rows(bounds, target, row_bytes, options.chunk_bytes)
            n_chunks = -(-gshape[0] // rows)
            owner: dict[int, int] = {}
            for a, b, k in holders:  # first holder of a row block writes it
                for c in range(a // rows, -(-b // rows)):
                    owner.setdefault(c, k)
            if len(owner) != n_chunks:
                raise CkptStoreError(f"{d['key']}: the ranks' shards do not cover all "
                                     f"{gshape[0]} rows")
            for c, k in owner.items():
                load[k] += (min(gshape[0], (c + 1) * rows) - c * rows) * row_bytes
            plans.append(LeafPlan(rows, row_offset=d["offset"],
                                  owned=frozenset(c for c, k in owner.items() if k == rank)))
        elif 0 < nbytes <= options.pack_threshold:
            plans.append(LeafPlan(max(1, gshape[0]) if gshape else 1, packed=True))
            units.append((nbytes, i, 0))
        else:
            plans.append(LeafPlan(target))
            if nbytes:
                n_chunks = -(-gshape[0] // target) if gshape else 1
                for c in range(n_chunks):
                    rows_c = min(target, gshape[0] - c * target) if gshape else 1
                    units.append((rows_c * row_bytes if gshape else nbytes, i, c))
    owned: dict[int, set[int]] = {}
    for nb, i, c in sorted(units, key=lambda u: (-u[0], u[1], u[2])):
        k = min(range(world), key=lambda r: (load[r], r))
        load[k] += nb
        if k == rank:
            owned.setdefault(i, set()).add(c)
    out: list[LeafPlan] = []
    for i, plan in enumerate(plans):
        assert plan is not None
        if plan.owned is None:  # replicated: keep only what this rank was handed
            plan = LeafPlan(plan.chunk_rows, packed=plan.packed,
                            owned=frozenset(owned.get(i, ())))
        out.append(plan)
    return out, shapes


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
            plans, shapes = plan_collective(descs, rank, writer.options)
        except CkptStoreError as exc:
            err = str(exc)
    if err is not None:
        raise CkptStoreError(f"collective save of {name!r} failed, nothing committed: {err}")
    assert writer is not None  # only a rank that failed to prepare has none, and it raised

    try:
        refs = writer.write_blobs(leaves, plans)
        writer.store.sync()
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
                specs = [TensorSpec.of(leaf, shapes[i]) for i, leaf in enumerate(leaves)]
                entries = build_entries(specs, _global_plans(plans), all_refs,
                                        writer.options.compression, _replicated_storage(leaves))
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


def _global_plans(plans: list[LeafPlan]) -> list[LeafPlan]:
    return [LeafPlan(p.chunk_rows, packed=p.packed) for p in plans]


def _replicated_storage(leaves: list[ArrayLeaf]) -> list[Any]:
    refs = storage_refs(leaves)
    return [None if leaf.is_partial else ref for leaf, ref in zip(leaves, refs)]


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
