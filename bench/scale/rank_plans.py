"""Part 7b: the collective save planned by each rank (training/rank_save.py), simulated for
many ranks in one process, and checked against a real run on a few gloo ranks.

What is synthesized: the same FSDP2-style states as part 7 (scale/collective.py): every
parameter of a Llama-2-shaped model (and with `adam` its two moments) as `ckptstore.Shard`
rows of a zero-stride tensor, `torch.chunk`'s split over W ranks. The gcd every rank would
agree on (`agree_gcds`, one all_reduce of one integer per tensor per round) is computed here
over every rank's rows and handed to each simulated rank; the all_reduce itself is not run.

What is run, as each rank runs it, and timed (seconds of one call in this process):

1. local: for ranks 0, 1, W/2 and W-1: `boxes_of` of every leaf, the structure digest, the
   plan signature and the local gcds (what a rank computes before the first all_reduce),
   then `plan_rank` (grids, segments, replicated owners), then `outgoing` over this rank's
   chunk references (synthesized: one `ChunkRef` with a distinct fake digest per chunk it
   owns): the rows it sends to the segments' builders. Per-rank figure = their sum; the
   slowest sampled rank is reported.
2. build: for every builder rank, `build_segments` over every chunk row of its segments
   (synthesized as every writer would send them), which encodes the segments and writes
   them into a local folder: the busiest builder's seconds and received bytes.
3. commit: `commit_root` on rank 0 with the W records the gather would bring (its bytes =
   W x the longest record, as gather_json pads them), writing the tree blob and creating the
   root in the local folder. The committed root is parsed back and one tensor entry read.
4. restore: rank W/2's restore plan from the committed manifest, parsed again (its
   segments from the folder, in the page cache): every entry read, the chunks holding its
   rows found and their references built, as a load into its Shards does before it reads
   data (`_restore_refs`); with the index bytes it read (root, segment heads, the parts
   holding its chunks) against the whole index (`index_total_bytes`: every blob written,
   the tree's included).

Not simulated: the chunk writes (no tensor bytes), the network time of the collectives
(only their bytes are counted), the broadcast of the outcome.

`real` runs the same save on W gloo ranks of this machine (spawned processes, model "tiny",
real tensors) and reports each rank's `RankMemory.last` (its steps' seconds and bytes) for
comparison with `simulate` at the same W and model.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .collective import _params, _rank0_state, _rank_leaves
from .states import shard_rows


def _gcds(params: list[tuple[str, tuple[int, ...], bool]], world: int) -> list[list[int]]:
    """What agree_gcds returns on every rank, per tensor and dimension: the gcd of every
    rank's interior box ends."""
    from ckptstore.pipeline.rank_planning import Held, interior_gcds

    out = []
    for _key, shape, sharded in params:
        g = [0] * len(shape)
        if sharded:
            for rank in range(world):
                start, count = shard_rows(shape[0], world, rank)
                box = ((start, start + count), *((0, n) for n in shape[1:]))
                g = [math.gcd(a, b) for a, b in zip(g, interior_gcds(
                    Held((box,), ((0,) * len(shape),)), shape))]
        out.append(g)
    return out


def _fake(i: int, c: np.ndarray) -> np.ndarray:
    """16-byte fake digests, distinct per (tensor, chunk)."""
    raw = np.zeros((len(c), 2), dtype="<u8")
    raw[:, 0] = i
    raw[:, 1] = c
    return raw.view(np.uint8).reshape(-1, 16)


def _rows_of_segment(span: range, plan: Any, itemsize: list[int]) -> np.ndarray:
    """Every chunk row of the tensors of `span`, as the writers would send them."""
    from ckptstore.pipeline.rank_segments import ROW

    parts = []
    for i in span:
        g = plan.grids[i]
        if not g.chunks:
            continue
        c = np.arange(g.chunks, dtype=np.int64)
        if g.chunk_shape is None and g.shape:
            inner = math.prod(g.shape[1:]) * itemsize[i]
            rows = np.minimum(g.chunk_rows, g.shape[0] - c * g.chunk_rows)
            nbytes = rows * inner
        else:
            nbytes = np.array([g.chunk_bytes(int(k), itemsize[i]) for k in c], dtype=np.int64)
        out = np.zeros(g.chunks, dtype=ROW)
        out["tensor"], out["chunk"] = i, c
        out["size"] = out["nbytes"] = nbytes
        out["blob"] = out["digest"] = _fake(i, c)
        parts.append(out)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=ROW)


def _my_refs(plan: Any, boxes: list[Any], itemsize: list[int]
             ) -> dict[tuple[int, int], Any]:
    from ckptstore.format.manifest import ChunkRef

    out = {}
    for i, (b, g) in enumerate(zip(boxes, plan.grids)):
        mine = plan.mine.get(i, []) if b is None else [
            c for box in b.boxes for c in g.chunks_in_box(box)]
        for c in mine:
            digest = f"{i:016x}{c:016x}"
            n = g.chunk_bytes(c, itemsize[i])
            out[(i, c)] = ChunkRef(digest, 0, n, n, digest)
    return out


def _restore_refs(manifest: Any, world: int, rank: int, workers: int = 0) -> int:
    """What a load of rank `rank`'s rows of every tensor does before reading data: read the
    entries (every segment: each holds every rank's rows; of a parted one, its head and the
    parts holding this rank's chunks), find the chunks holding its rows and build their
    references. With `workers`, the segments and then the parts are fetched that many at a
    time first, as a load does (`SegmentedEntries.prefetch`, `prefetch_chunks`). Returns
    how many references it built."""
    if workers:
        from ckptstore.format.segments import prefetch_chunks

        manifest.tensors.prefetch(range(len(manifest.tensors)), workers)
    wanted = []
    for e in manifest.tensors:
        start, count = shard_rows(e.shape[0], world, rank) if e.shape else (0, 1)
        if count:
            first, last = start // e.chunk_rows, -(-(start + count) // e.chunk_rows)
            wanted += [(e, i) for i in range(first, min(last, len(e.chunks)))]
    if workers:
        prefetch_chunks(wanted, workers)
    return len([e.chunks[i] for e, i in wanted])


def simulate(folder: str, model: str, adam: bool, world: int) -> dict[str, Any]:
    """Worker: one simulated collective save by rank plans at `world` ranks."""
    from ckptstore.format.canonical import canonical_json
    from ckptstore.format.manifest_parse import parse_manifest
    from ckptstore.format.tree import TreeEncoder
    from ckptstore.layout import manifest_key, segments_in
    from ckptstore.pipeline.commit import SaveRequest
    from ckptstore.pipeline.options import SaveOptions
    from ckptstore.pipeline.rank_planning import boxes_of, builder_of, plan_rank
    from ckptstore.pipeline.rank_segments import build_segments, outgoing
    from ckptstore.pipeline.writer import CheckpointWriter, KnownChunks
    from ckptstore.stores import open_store
    from ckptstore.training import rank_save as rs

    params = _params(model, adam)
    encoder = TreeEncoder()
    tree = encoder.encode_state(_rank0_state(params, world))
    leaves0 = encoder.leaves
    store = open_store(folder)
    options = SaveOptions()
    writer = CheckpointWriter(store, options, KnownChunks())
    itemsize = [leaf.dtype.itemsize for leaf in leaves0]
    gcds = _gcds(params, world)
    out: dict[str, Any] = {"model": model, "adam": adam, "world": world,
                           "tensors": len(params)}

    # 1. each sampled rank's own steps
    ranks = []
    plan0 = None
    for rank in sorted({0, 1, world // 2, world - 1} & set(range(world))):
        leaves = _rank_leaves(leaves0, params, world, rank)
        t0 = time.perf_counter()
        boxes = [boxes_of(leaf) for leaf in leaves]
        structure = rs._structure(leaves)
        signature = rs._signature(structure, boxes, world, rank, writer)
        _local = rs.local_gcds(leaves, boxes)
        t1 = time.perf_counter()
        plan = plan_rank(leaves, boxes, gcds, signature, writer.options, rank, world)
        t2 = time.perf_counter()
        refs = _my_refs(plan, boxes, itemsize)
        t3 = time.perf_counter()
        sent = outgoing(refs, plan, world)
        t4 = time.perf_counter()
        ranks.append({"rank": rank, "describe_s": t1 - t0, "plan_s": t2 - t1,
                      "outgoing_s": t4 - t3, "chunks": len(refs),
                      "sent_bytes": sum(len(p) for p in sent),
                      "local_s": (t1 - t0) + (t2 - t1) + (t4 - t3)})
        if rank == 0:
            plan0 = plan
    assert plan0 is not None
    out["ranks"] = ranks
    out["per_rank_s"] = max(r["local_s"] for r in ranks)
    out["plan_s"] = max(r["describe_s"] + r["plan_s"] for r in ranks)
    out["chunks"] = sum(g.chunks for g in plan0.grids)
    out["segments"] = len(plan0.spans)
    out["allreduce_bytes_per_round"] = 8 * len(params)

    # 2. every builder's segments
    builders: dict[int, list[int]] = {}
    for s in range(len(plan0.spans)):
        builders.setdefault(builder_of(s, world), []).append(s)
    records: list[dict[str, Any]] = [{"build_error": None, "error": None, "segments": []}
                                     for _ in range(world)]
    build = []
    for b, segs in builders.items():
        rows_b = np.concatenate([_rows_of_segment(plan0.spans[s], plan0, itemsize)
                                 for s in segs])
        t0 = time.perf_counter()
        built = build_segments(writer, rows_b, plan0, leaves0, b, world)
        build.append({"rank": b, "segments": len(segs), "seconds": time.perf_counter() - t0,
                      "received_bytes": rows_b.nbytes})
        records[b]["segments"] = built
        del rows_b
    busiest = max(build, key=lambda u: u["seconds"])
    out["builders"] = len(build)
    out["build_s_max"] = busiest["seconds"]
    out["build_received_max"] = max(u["received_bytes"] for u in build)
    out["index_bytes"] = sum(seg[2] for rec in records for seg in rec["segments"])

    # 3. rank 0's commit
    out["gather_bytes"] = world * max(len(canonical_json(r)) for r in records)
    request = SaveRequest("sim", tree, leaves0, {}, None, manifest_key("sim"))
    t0 = time.perf_counter()
    try:
        rs.commit_root(writer, request, plan0, records)
        out["committed"] = True
    except Exception as exc:
        out["committed"] = False
        out["commit_error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["commit_s"] = time.perf_counter() - t0
    if out["committed"]:
        body = writer.committed or b""
        out["manifest_bytes"] = len(body)
        manifest = parse_manifest(body, "sim", options.hash, segments_in([store], options.hash))
        last = manifest.tensors[len(manifest.tensors) - 1]  # reads one segment
        out["read_back"] = last.key == leaves0[-1].key and len(last.chunks) == \
            plan0.grids[-1].chunks
        source = segments_in([store], options.hash)
        fetched: list[int] = []

        def counted(ref: Any) -> bytes:
            data = source(ref)
            fetched.append(len(data))
            return data

        t0 = time.perf_counter()
        out["restore_refs"] = _restore_refs(parse_manifest(body, "sim", options.hash, counted),
                                            world, world // 2)
        out["restore_plan_s"] = time.perf_counter() - t0
        out["restore_index_reads"] = len(fetched)
        out["restore_index_bytes"] = len(body) + sum(fetched)
        out["index_total_bytes"] = sum(info.size for info in store.list("blobs/"))
    out["per_rank_total_s"] = out["per_rank_s"] + out["build_s_max"]
    return out


def _real_rank(rank: int, world: int, init: str, folder: str, out_dir: str,
               model: str) -> None:
    """One rank of the real run: two saves of the same model (the second with the cached
    plan); writes its RankMemory.last of each."""
    import torch
    import torch.distributed as dist

    import ckptstore

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        params = _params(model, False)
        g = torch.Generator().manual_seed(rank)
        state = {}
        for key, shape, _sharded in params:
            start, count = shard_rows(shape[0], world, rank)
            local = torch.randn((count, *shape[1:]), generator=g)
            state[key] = ckptstore.Shard(local, start, shape)
        mgr = ckptstore.CheckpointManager(folder, keep_last=2)
        steps = []
        for step in (1, 2):
            t0 = time.perf_counter()
            mgr.save(step, state)
            steps.append({**mgr._rank_memory.last, "wall_s": time.perf_counter() - t0})
            for t in state.values():
                t.data.add_(1.0)
        mgr.close()
        Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(steps))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def real(folder: str, world: int, model: str) -> dict[str, Any]:
    """Worker: the save on `world` real gloo ranks; every rank's step figures."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(dir=folder)
    init = os.path.join(out_dir, "pg")
    mp.start_processes(_real_rank, args=(world, init, os.path.join(folder, "repo"), out_dir,
                                         model), nprocs=world, join=True, start_method="spawn")
    ranks = [json.loads(Path(out_dir, f"rank-{r}.json").read_text()) for r in range(world)]
    return {"world": world, "model": model, "ranks": ranks}
