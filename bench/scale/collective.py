"""Part 7: collective saves simulated for many ranks, in one process per world size, by calling
the steps of `training/distributed.save_collective` with synthesized per-rank inputs. No
process group, no tensor bytes and no blob writes: only the planning and the commit.

What is synthesized: the state of each of W ranks of an FSDP2-style job (every parameter of a
Llama-2-shaped model, and with `adam` its two Adam moments, `Shard(0)` over W ranks as
`torch.chunk` splits them: `ckptstore.Shard` of a zero-stride tensor of the local shape, so
no memory is touched; Adam's `step` a replicated 0-d tensor). Rank 0's state goes through the
real `TreeEncoder` (its leaves and tree); every other rank's leaves are rank 0's with the
local rows replaced (`dataclasses.replace`: what its encoder would produce).

What is run, as the real code does it, and timed (seconds of one call on this one process):

1. describe: `distributed._describe` of one rank's leaves + `canonical_json` (what that rank
   sends into the first `all_gather_json`; the rank with the most rows is timed);
2. receive: `json.loads` of every rank's payload (every rank decodes all W in
   `all_gather_json`); bytes received per rank = W x the longest payload (the gather pads
   every payload to the longest);
3. plan: `_check_agreement` + `plan_collective` on the W descriptions: what every rank runs;
4. status: every rank's chunk references for the chunks the plan gives it, synthesized
   (`ChunkRef` with a distinct fake digest per chunk, the chunk's true byte count) as
   `[[leaf, chunk, ref.to_json()], ...]` -> `canonical_json`, and every rank's `json.loads`
   of all W (the second `all_gather_json`, also padded to the longest);
5. commit (rank 0): the refs dict, `_entries`, `_replicated_storage`, `Manifest`, then
   `CheckpointWriter.commit` into a local folder (`to_bytes`, cap check, sync, create-only),
   then `committed_manifest` (what the store caches); total = the rank-0 commit path;
6. next save: `parse_manifest` of the committed bytes: what every rank other than 0 pays at
   its next save (it reads the parent to know its chunks).

Not simulated: the blob writes, the network time of the gathers (only their bytes), the
final 1-record broadcast of the outcome.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from .common import Ctx, MiB, index_blobs, run_worker
from .states import LLAMA, llama, shard_rows


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def _describe_all(encode: Any, describe: Any, leaves: list[Any]) -> Any:
    return encode([describe(leaf) for leaf in leaves])


def _decode_all(payloads: list[bytes]) -> list[Any]:
    return [json.loads(p) for p in payloads]


def _params(model: str, adam: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    """(key, global shape, sharded) of every tensor of the state, in state order."""
    params = llama(model)
    out = [(f"model.{k}", s, True) for k, s in params]
    if adam:
        for i, (_k, s) in enumerate(params):
            out += [(f"optim.state.{i}.exp_avg", s, True),
                    (f"optim.state.{i}.exp_avg_sq", s, True),
                    (f"optim.state.{i}.step", (), False)]
    return out


def _rank0_state(params: list[tuple[str, tuple[int, ...], bool]], world: int) -> dict[str, Any]:
    import torch

    import ckptstore

    state: dict[str, Any] = {}
    for key, shape, sharded in params:
        if not sharded:
            state[key] = torch.tensor(100.0)
            continue
        start, count = shard_rows(shape[0], world, 0)
        local = torch.zeros(1).expand(count, *shape[1:])
        state[key] = ckptstore.Shard(local, start, shape)
    return state


def _rank_leaves(leaves0: list[Any], params: list[tuple[str, tuple[int, ...], bool]],
                 world: int, rank: int) -> list[Any]:
    """Rank `rank`'s leaves: rank 0's with this rank's rows (zero-stride views)."""
    import numpy as np

    if rank == 0:
        return leaves0
    out = []
    for leaf, (_key, shape, sharded) in zip(leaves0, params):
        if not sharded:
            out.append(leaf)
            continue
        start, count = shard_rows(shape[0], world, rank)
        view = np.broadcast_to(np.zeros((), leaf.array.dtype), (count, *shape[1:]))
        out.append(dataclasses.replace(leaf, array=view, row_offset=start))
    return out


def estimated_chunks(model: str, adam: bool, world: int) -> int:
    """Chunks of the FSDP-style plan, by arithmetic: a sharded tensor whose shard is at most
    `chunk_bytes` (16 MiB) forms one chunk per non-empty shard; a bigger shard is cut in
    ceil(shard / 16 MiB) row blocks (and further by RESHARD_SPLIT as the planner does, which
    this estimate ignores: a lower bound there); a 0-d tensor one chunk. Checked against the
    real plan's count wherever the plan runs (`chunks` vs `chunks_estimated`)."""
    total = 0
    for _key, shape, sharded in _params(model, adam):
        if not sharded:
            total += 1
            continue
        inner = math.prod(shape[1:]) * 4
        for rank in range(world):
            _start, count = shard_rows(shape[0], world, rank)
            if count:
                total += max(1, -(-(count * inner) // (16 * MiB)))
    return total


def simulate(folder: str, model: str, adam: bool, world: int) -> dict[str, Any]:
    """Worker: one simulated collective save at `world` ranks (module docstring)."""
    from ckptstore.format.canonical import canonical_json
    from ckptstore.format.hashing import XXH3_128
    from ckptstore.format.manifest import ChunkRef, Manifest
    from ckptstore.format.manifest_parse import committed_manifest, parse_manifest
    from ckptstore.format.segments import version_for
    from ckptstore.format.tree import TreeEncoder
    from ckptstore.layout import manifest_key, segments_in
    from ckptstore.pipeline.options import SaveOptions
    from ckptstore.pipeline.planning import plan_collective as plan
    from ckptstore.pipeline.writer import CheckpointWriter, KnownChunks
    from ckptstore.stores import open_store
    from ckptstore.training.distributed import (
        _check_agreement,
        _describe,
        _entries,
        _replicated_storage,
    )

    params = _params(model, adam)
    encoder = TreeEncoder()
    tree = encoder.encode_state(_rank0_state(params, world))
    leaves0 = encoder.leaves
    out: dict[str, Any] = {"model": model, "adam": adam, "world": world,
                           "tensors": len(params)}

    # 1-2. describe on every rank, the first all_gather_json's bytes and its decode
    t_build = time.perf_counter()
    payloads = []
    describe_s = 0.0
    for rank in range(world):
        leaves = _rank_leaves(leaves0, params, world, rank)
        seconds, payload = _timed(partial(_describe_all, canonical_json, _describe, leaves))
        describe_s = max(describe_s, seconds)
        payloads.append(payload)
    out["synth_s"] = time.perf_counter() - t_build
    longest = max(len(p) for p in payloads)
    out["describe_s"] = describe_s
    out["describe_bytes_max"] = longest
    out["describe_gather_bytes_per_rank"] = world * longest
    out["describe_decode_s"], descs = _timed(partial(_decode_all, payloads))
    del payloads

    # 3. the plan every rank derives
    options = SaveOptions()
    out["agreement_s"], _ = _timed(partial(_check_agreement, descs))
    out["plan_s"], (layouts, _load) = _timed(partial(plan, descs, options))
    out["chunks"] = sum(len(lay.owners) for lay in layouts)
    out["chunks_estimated"] = estimated_chunks(model, adam, world)

    # 4. every rank's status (its chunk references), the second all_gather_json
    owned: list[list[Any]] = [[] for _ in range(world)]
    for i, lay in enumerate(layouts):
        itemsize = leaves0[i].dtype.itemsize
        for c, rank in enumerate(lay.owners):
            nbytes = math.prod(hi - lo for lo, hi in lay.region(c)) * itemsize
            digest = f"{i:016x}{c:016x}"
            owned[rank].append([i, c, ChunkRef(digest, 0, nbytes, nbytes, digest).to_json()])
    statuses_raw = [canonical_json(st) for st in owned]
    del owned
    longest = max(len(s) for s in statuses_raw)
    out["status_bytes_max"] = longest
    out["status_gather_bytes_per_rank"] = world * longest
    out["gather_bytes_per_rank"] = (out["describe_gather_bytes_per_rank"]
                                    + out["status_gather_bytes_per_rank"])
    out["status_decode_s"], statuses = _timed(partial(_decode_all, statuses_raw))
    del statuses_raw

    # 5. rank 0's commit
    store = open_store(folder)
    writer = CheckpointWriter(store, options, KnownChunks())
    t0 = time.perf_counter()
    all_refs = {(i, c): ChunkRef(**ref) for st in statuses for i, c, ref in st}
    t1 = time.perf_counter()
    entries = _entries(leaves0, layouts, all_refs, options.compression,
                       _replicated_storage(leaves0, descs))
    manifest = Manifest(name="sim", created=writer.creation_time(), metadata={}, tree=tree,
                        tensors=entries, parent=None, hash=options.hash.name,
                        version=version_for(entries))  # as save_collective does
    t2 = time.perf_counter()
    try:
        body = writer.commit(manifest, manifest_key("sim"))
        committed = True
    except Exception as exc:  # the 1 GiB cap: refused before anything is created
        out["commit_error"] = f"{type(exc).__name__}: {exc}"[:300]
        body = manifest.to_bytes()
        committed = False
    t3 = time.perf_counter()
    if committed:
        committed_manifest(manifest, body, expected_name="sim")
    t4 = time.perf_counter()
    out.update(committed=committed, commit_refs_s=t1 - t0, commit_entries_s=t2 - t1,
               commit_write_s=t3 - t2, commit_cache_s=t4 - t3, commit_s=t4 - t0,
               manifest_bytes=len(body),
               index_bytes=sum(b.size for b in index_blobs(manifest)))
    del manifest, entries, all_refs, statuses, descs
    # 6. the parent read of every rank at its next save: the root, its index segments and
    # every entry (an incremental save's known chunks)
    source = segments_in([store], XXH3_128)
    out["next_save_parse_s"], _ = _timed(
        lambda: len(list(parse_manifest(body, "sim", XXH3_128, source).tensors)))
    out["per_rank_s"] = (out["describe_s"] + out["describe_decode_s"] + out["agreement_s"]
                         + out["plan_s"] + out["status_decode_s"])
    return out


def run(ctx: Ctx, worlds: list[int], model: str = "7b", real_world: int = 4) -> dict[str, Any]:
    """The general protocol (this module's `simulate`: the plan over every rank's
    description) and the protocol planned by each rank (scale/rank_plans.py), at each world
    size in one run; then 70B with Adam at the largest, and a real gloo run beside its
    simulation."""
    rows, by_rank = [], []
    for world in worlds:
        for label, target, out in (("general", "collective.simulate", rows),
                                   ("rank plans", "rank_plans.simulate", by_rank)):
            ctx.note(f"collective ({label}): {model} FSDP-style, {world:,} simulated ranks")
            folder = Path(tempfile.mkdtemp(prefix=f"collective-{world}-", dir=ctx.root))
            out.append(run_worker(ctx, target, folder=str(folder), model=model,
                                  adam=False, world=world))
            shutil.rmtree(folder, ignore_errors=True)
    big = max(worlds)
    top = rows[-1]
    per_chunk = top["manifest_bytes"] / top["chunks"]
    index_per_chunk = top.get("index_bytes", 0) / top["chunks"]
    chunks_70b = estimated_chunks("70b", True, big)
    estimate = {"model": "70b", "adam": True, "world": big, "chunks_estimated": chunks_70b,
                "manifest_bytes_per_chunk_7b": per_chunk,
                "manifest_bytes_estimated": int(chunks_70b * per_chunk),
                "index_bytes_estimated": int(chunks_70b * index_per_chunk),
                "note": "general protocol, not run (about 8x the 7B run's chunks: minutes and "
                        "tens of GiB here); chunk count by the arithmetic of "
                        "estimated_chunks, bytes per chunk of the 7B manifest (root; index "
                        f"blobs apart) at {big} ranks"}
    ctx.note(f"collective (rank plans): 70B with Adam, {big:,} simulated ranks")
    folder = Path(tempfile.mkdtemp(prefix="collective-70b-", dir=ctx.root))
    big70 = run_worker(ctx, "rank_plans.simulate", folder=str(folder), model="70b", adam=True,
                       world=big)
    shutil.rmtree(folder, ignore_errors=True)
    ctx.note(f"collective: a real save on {real_world} gloo ranks (tiny model) and its "
             "simulation")
    folder = Path(tempfile.mkdtemp(prefix="collective-real-", dir=ctx.root))
    real = run_worker(ctx, "rank_plans.real", folder=str(folder), world=real_world,
                      model="tiny")
    shutil.rmtree(folder, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix="collective-realsim-", dir=ctx.root))
    real_sim = run_worker(ctx, "rank_plans.simulate", folder=str(folder), model="tiny",
                          adam=False, world=real_world)
    shutil.rmtree(folder, ignore_errors=True)
    return {"model": model, "shape": LLAMA[model], "rows": rows, "rank_plans": by_rank,
            "estimate_70b_adam": estimate, "rank_plans_70b_adam": big70, "real": real,
            "real_simulated": real_sim}
