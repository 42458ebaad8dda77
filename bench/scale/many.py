"""Part "many": a save's cost against the number of checkpoints already in the repository.

Two repositories hold `counts` checkpoints (10 and 500) of the same 1,000-tensor state
(small fp32 tensors, a ~650 KB manifest each). The first checkpoint is saved for real; the
others are its manifest committed again under other names and later `created` times
(`dataclasses.replace` of the parsed Manifest, `to_bytes`, a create-only `store.create`, as
the writer commits): real, valid manifests that reference the same blobs, written in seconds
instead of 500 saves. Then a fresh process opens the repository and saves the state with 1%
of its tensors changed (the timed `save`, parent: latest), counting the store calls it makes
(the store's methods wrapped from outside, in that process); the checkpoint is deleted again
so every repetition sees the same repository. The same process then saves a second time:
what a long-lived job pays (its listing cache warm)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from .common import Ctx, run_child, run_worker
from .states import build_small

TENSORS = 1000

#: argv: folder, tensors; prints {save_s, second_save_s, calls}
SAVE_CHILD = r"""
import json, os, sys, time
import ckptstore, torch
from ckptstore.stores import open_store
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from scale.states import build_small, change
folder, n = sys.argv[1], int(sys.argv[2])
state = build_small(n)
change(state, 1, 0.01)
store = open_store(folder, create=False)
calls = {}
for method in ("get", "get_range", "list", "stat", "exists", "put", "create"):
    real = getattr(store, method)
    def counted(*a, _real=real, _m=method, **k):
        calls[_m] = calls.get(_m, 0) + 1
        return _real(*a, **k)
    setattr(store, method, counted)
t0 = time.perf_counter()
repo = ckptstore.CheckpointStore(store, create=False)
t1 = time.perf_counter()
repo.save("new", state)
t2 = time.perf_counter()
first = dict(calls)
repo.delete("new")
change(state, 2, 0.01)
t3 = time.perf_counter()
repo.save("new2", state)
t4 = time.perf_counter()
repo.delete("new2")
print(json.dumps({"open_s": t1 - t0, "save_s": t2 - t1, "second_save_s": t4 - t3,
                  "calls": first}), flush=True)
os._exit(0)
"""


def fill(folder: str, count: int, n: int) -> dict[str, Any]:
    """Worker: a repository of `count` checkpoints (module docstring)."""
    import dataclasses

    import ckptstore
    from ckptstore.layout import manifest_key

    repo = ckptstore.CheckpointStore(folder)
    repo.save("c0000", build_small(n), parent=None)
    first = repo.manifest("c0000")
    for i in range(1, count):
        copy = dataclasses.replace(first, name=f"c{i:04d}", created=first.created + i,
                                   parent=f"c{i - 1:04d}")
        repo.store.create(manifest_key(copy.name), copy.to_bytes())
    listed = ckptstore.CheckpointStore(folder, create=False).history()
    return {"checkpoints": len(listed), "manifest_bytes": len(first.to_bytes())}


def _saves(ctx: Ctx, folder: Path) -> dict[str, Any]:
    runs = [run_child([sys.executable, "-c", SAVE_CHILD, str(folder), str(TENSORS)], ctx)
            .check("save child").last_json() for _ in range(max(2, ctx.reps))]
    top = min(runs, key=lambda r: r["save_s"])
    return {**top, "saves_s": [r["save_s"] for r in runs],
            "second_saves_s": [r["second_save_s"] for r in runs]}


def run(ctx: Ctx, counts: list[int]) -> dict[str, Any]:
    rows = []
    for count in counts:
        ctx.note(f"many: a save into a repository of {count} checkpoints")
        folder = ctx.folder(f"many-{count}")
        built = run_worker(ctx, "many.fill", folder=str(folder), count=count, n=TENSORS)
        rows.append({"count": count, **built, **_saves(ctx, folder)})
        shutil.rmtree(folder, ignore_errors=True)
    return {"tensors": TENSORS, "rows": rows,
            "ratio": rows[-1]["save_s"] / rows[0]["save_s"]}
