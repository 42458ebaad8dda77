"""Part 1: what a manifest costs as the tensor count grows (1k to 200k tensors; the MoE-with-
Adam state by default, `small` too on request). One worker per (shape, count) saves the state,
then measures on its manifest: bytes, parse time (`parse_manifest` on the bytes in memory),
parsed memory (tracemalloc: what the parsed Manifest keeps, and the peak while parsing), the
read + plan of a partial restore (`CheckpointStore.manifest` from a new store object, then
`plan_load(keys=[one])`) and `load(keys=[one])` on a new store object (so each reads and
parses the manifest, as a restarted process would). Then the parent times `load(keys=[one])`
in fresh processes: wall time from process start, import time apart. `load(keys=[K])` for
many K is part 2 (keys.py)."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

from .common import Ctx, best, index_blobs, profiled, run_child, run_worker, timed, traced
from .states import build, tensors

NAME = "m"

#: load(keys=[one]) in a fresh process: argv folder, name, keys (JSON); prints its timings
LOAD_CHILD = r"""
import time
t0 = time.perf_counter()
import json, os, sys
import ckptstore, torch
t1 = time.perf_counter()
repo = ckptstore.CheckpointStore(sys.argv[1], create=False)
t2 = time.perf_counter()
out = repo.load(sys.argv[2], keys=json.loads(sys.argv[3]))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "load_s": t3 - t2}), flush=True)
os._exit(0)
"""


def measure(folder: str, shape: str, n: int, reps: int, profile: bool) -> dict[str, Any]:
    """Worker: save the state into `folder`, then measure its manifest (module docstring)."""
    import ckptstore

    state = build(shape, n)
    flat = tensors(state)
    keys = list(flat)
    one = typical_key({k: t.numel() for k, t in flat.items()})
    del flat
    save_s, _info = timed(partial(ckptstore.CheckpointStore(folder).save, NAME, state,
                                  parent=None))
    del state
    raw = (Path(folder) / "checkpoints" / f"{NAME}.json").read_bytes()
    index = index_blobs(_parse(raw))  # version 3: segments and tree, apart from the root
    whole = len(raw) + sum(b.size for b in index)
    out: dict[str, Any] = {"shape": shape, "tensors": len(keys), "save_s": save_s,
                           "manifest_bytes": len(raw), "index_bytes": whole - len(raw),
                           "index_blobs": len(index), "bytes_per_tensor": whole / len(keys),
                           "one_key": one}
    out.update(_parse_figures(raw, reps))
    out.update(_load_figures(folder, one, reps))
    if profile:
        out["profiles"] = _profiles(folder, raw, one)
    return out


def typical_key(sizes: dict[str, int]) -> str:
    """The middle key among the tensors of the most common size (a 4 KiB expert weight or
    Adam moment of the MoE state, a 1 KiB tensor of the small one)."""
    counts = Counter(sizes.values())
    common = max(counts, key=lambda size: (counts[size], size))
    candidates = [k for k, size in sizes.items() if size == common]
    return candidates[len(candidates) // 2]


def _parse(raw: bytes) -> Any:
    from ckptstore.format.hashing import XXH3_128
    from ckptstore.format.manifest_parse import parse_manifest

    return parse_manifest(raw, NAME, XXH3_128)


def _parse_figures(raw: bytes, reps: int) -> dict[str, Any]:
    mem = traced(lambda: _parse(raw))
    return {"parse": best(reps, lambda: _parse(raw)), "parsed_bytes": mem["current_bytes"],
            "parse_peak_bytes": mem["peak_bytes"]}


def _read_and_plan(folder: str, one: str) -> Any:
    import ckptstore
    from ckptstore.pipeline.loading import plan_load

    repo = ckptstore.CheckpointStore(folder, create=False)
    return plan_load(repo.manifest(NAME), keys=[one])


def _load(folder: str, keys: list[str] | None) -> Any:
    import ckptstore

    return ckptstore.CheckpointStore(folder, create=False).load(NAME, keys=keys)


def _load_figures(folder: str, one: str, reps: int) -> dict[str, Any]:
    return {"read_plan_one": best(reps, lambda: _read_and_plan(folder, one)),
            "load_one": best(reps, lambda: _load(folder, [one]))}


def _profiles(folder: str, raw: bytes, one: str) -> dict[str, Any]:
    return {"parse": profiled(lambda: _parse(raw)),
            "load_one": profiled(lambda: _load(folder, [one]))}


# ----------------------------------------------------------------------------- parent
def fresh_load(ctx: Ctx, folder: Path, keys: list[str]) -> dict[str, Any]:
    """load(keys=) in a fresh process, `ctx.reps` times: the child's own timings of the
    best run (by wall time) and every wall time."""
    import json
    import sys

    runs = []
    for _ in range(ctx.reps):
        child = run_child([sys.executable, "-c", LOAD_CHILD, str(folder), NAME,
                           json.dumps(keys)], ctx).check("fresh-process load")
        runs.append({**child.last_json(), "wall_s": child.wall_s, "maxrss": child.maxrss})
    top = min(runs, key=lambda r: r["wall_s"])
    return {**top, "wall_minus_import_s": top["wall_s"] - top["import_s"],
            "walls_s": [r["wall_s"] for r in runs]}


def startup(ctx: Ctx) -> float:
    """Wall seconds of `python -c pass` here (best of the reps): the interpreter's start."""
    import sys

    return min(run_child([sys.executable, "-c", "pass"], ctx).wall_s
               for _ in range(max(2, ctx.reps)))


def run(ctx: Ctx, sizes: list[int], shapes: list[str]) -> dict[str, Any]:
    rows = []
    for shape in shapes:
        for n in sizes:
            ctx.note(f"manifest: {shape} {n:,} tensors")
            folder = ctx.folder(f"manifest-{shape}-{n}")
            row = run_worker(ctx, "manifest.measure", folder=str(folder), shape=shape, n=n,
                             reps=ctx.reps, profile=ctx.profile and n == max(sizes))
            row["fresh_load_one"] = fresh_load(ctx, folder, [row["one_key"]])
            rows.append(row)
            _remove(folder)
    return {"python_startup_s": startup(ctx), "rows": rows}


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
