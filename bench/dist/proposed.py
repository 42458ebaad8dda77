"""Proposed fixes to ckptstore's collective save, applied by monkeypatching inside the
benchmark's ranks with `--proposed-fixes` (the library's files are not changed). They measure
what the fixes proposed in docs/performance-distributed.md would gain:

1. `plan_collective`: spread the chunks of replicated tensors over the ranks by bytes
   (largest first, to the least-loaded rank, counting each rank's shard rows too) instead of
   by `(chunk index + leaf index) % world`, which sends every single-chunk tensor at an even
   leaf index to the even ranks: in a model whose leaves alternate weight, bias, ... the odd
   ranks get only the biases.
2. `LocalStore.sync`: fsync the dirty folders in parallel (one depth level at a time, deepest
   first, as before). Every blob lives in its own `blobs/xx/` folder, so a rank's sync is one
   folder fsync (one journal commit) per chunk, one after another; concurrent fsyncs share
   journal commits.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections import defaultdict
from typing import Any


def plan_collective(descs: list[list[dict[str, Any]]], rank: int, options: Any) -> Any:
    from ckptstore.training.distributed import _aligned_chunk_rows, _itemsize
    from ckptstore.errors import CkptStoreError
    from ckptstore.pipeline.writer import LeafPlan, rows_per_chunk

    world = len(descs)
    mine = descs[rank]
    plans: list[Any] = []
    shapes: list[tuple[int, ...]] = []
    load = [0] * world  # bytes each rank writes so far
    units: list[tuple[int, int, int]] = []  # (bytes, leaf index, chunk index), replicated
    replicated: dict[int, tuple[int, bool, int]] = {}  # leaf -> (chunk rows, packed, chunks)
    for i, d in enumerate(mine):
        gshape = tuple(d["global"])
        itemsize = _itemsize(d["dtype"])
        nbytes = math.prod(gshape) * itemsize
        target = rows_per_chunk(gshape, itemsize, options.chunk_bytes)
        shapes.append(gshape)
        if any(r[i]["partial"] for r in descs):  # unchanged, but counted in `load`
            holders = sorted(
                (r[i]["offset"], r[i]["offset"] + r[i]["shape"][0], k)
                for k, r in enumerate(descs)
                if r[i]["shape"][0] > 0
            )
            bounds = {a for a, _b, _k in holders if a} | {
                b for _a, b, _k in holders if b != gshape[0]
            }
            row_bytes = math.prod(gshape[1:]) * itemsize
            rows = _aligned_chunk_rows(bounds, target, row_bytes, options.chunk_bytes)
            n_chunks = -(-gshape[0] // rows)
            owner: dict[int, int] = {}
            for a, b, k in holders:
                for c in range(a // rows, -(-b // rows)):
                    owner.setdefault(c, k)
            if len(owner) != n_chunks:
                raise CkptStoreError(
                    f"{d['key']}: the ranks' shards do not cover all {gshape[0]} rows"
                )
            for c, k in owner.items():
                load[k] += (min(gshape[0], (c + 1) * rows) - c * rows) * row_bytes
            owned = frozenset(c for c, k in owner.items() if k == rank)
            plans.append(LeafPlan(rows, row_offset=d["offset"], owned=owned))
            continue
        plans.append(None)
        if 0 < nbytes <= options.pack_threshold:
            replicated[i] = (max(1, gshape[0]) if gshape else 1, True, 1)
            units.append((nbytes, i, 0))
        else:
            n_chunks = -(-gshape[0] // target) if gshape else 1
            row_bytes = nbytes // gshape[0] if gshape and gshape[0] else nbytes
            for c in range(n_chunks):
                rows_c = min(target, gshape[0] - c * target) if gshape else 1
                units.append((rows_c * row_bytes, i, c))
            replicated[i] = (target, False, n_chunks)
    owners: dict[tuple[int, int], int] = {}
    for nb, i, c in sorted(units, key=lambda u: (-u[0], u[1], u[2])):
        k = min(range(world), key=lambda r: (load[r], r))
        owners[(i, c)] = k
        load[k] += nb
    for i, (rows, packed, n) in replicated.items():
        plans[i] = LeafPlan(
            rows, packed=packed, owned=frozenset(c for c in range(n) if owners[(i, c)] == rank)
        )
    return plans, shapes


def parallel_sync(self: Any) -> None:
    from ckptstore.stores.local import fsync_dir

    with self._lock:
        dirty, self._dirty = self._dirty, set()
    by_depth: dict[int, list[Any]] = defaultdict(list)
    for folder in dirty:
        by_depth[len(folder.parts)].append(folder)
    if not by_depth:
        return
    with cf.ThreadPoolExecutor(min(16, len(dirty))) as pool:
        for depth in sorted(by_depth, reverse=True):  # a new folder's entry after its contents
            list(pool.map(lambda f: fsync_dir(f) if f.is_dir() else None, by_depth[depth]))


def apply() -> None:
    import ckptstore.training.distributed as cdist
    from ckptstore.stores.local import LocalStore

    cdist.plan_collective = plan_collective
    LocalStore.sync = parallel_sync  # type: ignore[method-assign]
