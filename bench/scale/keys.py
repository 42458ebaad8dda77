"""Part 2: `load(keys=[K keys])` against K, on one checkpoint of the MoE-with-Adam state
(default 50,000 tensors, the issue's case). One worker saves it, then for each K (1, 10, 100,
1,000, 10,000 sampled keys, seeded) times `load(keys=...)` on a new store object (so the
manifest is read and parsed each time, as in a restarted process) and `plan_load(manifest,
keys=...)` alone on a parsed manifest (the part that was O(N x K)); `load()` of everything
is the reference. Best of the reps."""

from __future__ import annotations

import shutil
from functools import partial
from typing import Any

from .common import Ctx, best, run_worker, timed
from .states import build, sample_keys, tensors

NAME = "k"
COUNTS = (1, 10, 100, 1000, 10000)


def measure(folder: str, n: int, reps: int) -> dict[str, Any]:
    """Worker: save, then every K (module docstring)."""
    import ckptstore
    from ckptstore.pipeline.loading import plan_load

    state = build("moe", n)
    keys = list(tensors(state))
    save_s, _ = timed(partial(ckptstore.CheckpointStore(folder).save, NAME, state, parent=None))
    del state

    def load(ks: list[str] | None) -> Any:
        return ckptstore.CheckpointStore(folder, create=False).load(NAME, keys=ks)

    manifest = ckptstore.CheckpointStore(folder, create=False).manifest(NAME)
    parse = best(reps, lambda: ckptstore.CheckpointStore(folder, create=False).manifest(NAME))
    rows = []
    for k in COUNTS:
        if k > len(keys):
            break
        picked = sample_keys(keys, k)
        rows.append({"k": k, "load": best(reps, partial(load, picked)),
                     "plan": best(reps, partial(plan_load, manifest, keys=picked))})
    return {"tensors": len(keys), "save_s": save_s, "read_parse": parse,
            "load_all": best(reps, lambda: load(None)), "rows": rows}


def run(ctx: Ctx, n: int) -> dict[str, Any]:
    ctx.note(f"keys: load(keys=[K]) on one checkpoint of {n:,} tensors")
    folder = ctx.folder("keys")
    out = run_worker(ctx, "keys.measure", folder=str(folder), n=n, reps=ctx.reps)
    shutil.rmtree(folder, ignore_errors=True)
    return out
