"""Part "small": 1 KiB tensors. ckptstore's save (into an empty repository, so every byte is
written) and restore (new tensors, and `into=` the caller's tensors) against the raw limit of
the same bytes on the same disk, in one worker process:

* raw write: the tensors' own buffers written with os.writev (1,024 buffers a call) into one
  file, fsync'd with its folder; and into files of 16 MiB (ckptstore's pack size), each
  fsync'd, then the folder. The faster of the two is the limit.
* raw read: the file read back with os.preadv straight into the tensors (the `into=` case),
  and into tensors allocated for it (the new-tensors case).

Every read comes from the page cache (the files were just written; caches are not dropped),
for ckptstore and raw alike. Ratios are raw seconds / ckptstore seconds (1 = the limit).

The raw figures take the tensors' buffers as given: their views are made before the clock
starts. What any store written in Python pays per tensor on top is measured apart, as the
per-tensor floor:

* views: `memoryview(t.numpy()).cast("B")` of every tensor, the least work that reaches a
  tensor's bytes from Python;
* views + digest: that and the xxh3-128 of each tensor's bytes (what a store that verifies
  every tensor, or finds unchanged ones by digest, cannot skip);
* walk: a visit of every (key, tensor) of the state dict, nothing else.

`floor_ratio_save` = raw write / (raw write + views + digest): the best save ratio a store
that touches each tensor once from Python can reach on this machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .common import Ctx, MiB, best, fsync_path, profiled, run_worker
from .states import build_small

BATCH = 1024  # buffers per writev/preadv (IOV_MAX)
FILE_BYTES = 16 * MiB


def _views(tensors: list[Any]) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B") for t in tensors]


def _write_all(fd: int, views: list[memoryview]) -> None:
    for i in range(0, len(views), BATCH):
        batch = views[i:i + BATCH]
        want = sum(len(v) for v in batch)
        if os.writev(fd, batch) != want:
            raise OSError("short writev")


def raw_write_one(folder: Path, views: list[memoryview]) -> None:
    fd = os.open(folder / "all.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, views)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(folder)


def raw_write_files(folder: Path, views: list[memoryview]) -> None:
    per = max(1, FILE_BYTES // max(1, len(views[0])))
    for k, i in enumerate(range(0, len(views), per)):
        fd = os.open(folder / f"part-{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, views[i:i + per])
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_path(folder)


def raw_read(folder: Path, views: list[memoryview]) -> None:
    fd = os.open(folder / "all.bin", os.O_RDONLY)
    try:
        pos = 0
        for i in range(0, len(views), BATCH):
            batch = views[i:i + BATCH]
            pos += os.preadv(fd, batch, pos)
    finally:
        os.close(fd)


def raw_read_new(folder: Path, count: int, elems: int) -> list[Any]:
    import torch

    fresh = [torch.empty(elems) for _ in range(count)]
    raw_read(folder, _views(fresh))
    return fresh


def measure(root: str, n: int, reps: int, profile: bool) -> dict[str, Any]:
    """Worker: every figure of the part (module docstring)."""
    state = build_small(n)
    tensors = list(state.values())
    views = _views(tensors)
    scratch = Path(tempfile.mkdtemp(dir=root))
    out: dict[str, Any] = {"tensors": n, "bytes": sum(len(v) for v in views)}
    out["raw_write_one_file"] = best(reps, lambda: raw_write_one(scratch, views))
    out["raw_write_16mib_files"] = best(reps, lambda: raw_write_files(scratch, views))
    out["raw_read_into"] = best(reps, lambda: raw_read(scratch, views))
    out["raw_read_new"] = best(reps, lambda: raw_read_new(scratch, n, tensors[0].numel()))
    shutil.rmtree(scratch)
    out.update(per_tensor_floor(state, reps))
    out.update(_ckptstore(root, state, reps, profile))
    return out


def per_tensor_floor(state: dict[str, Any], reps: int) -> dict[str, Any]:
    """The Python work per tensor that the raw figures leave out (module docstring)."""
    import xxhash

    def walk() -> int:
        return sum(1 for _k, _t in state.items())

    def views() -> list[memoryview]:
        return _views(list(state.values()))

    def digests() -> list[bytes]:
        return [xxhash.xxh3_128_digest(v) for v in _views(list(state.values()))]

    return {"floor_walk": best(reps, walk), "floor_views": best(reps, views),
            "floor_views_digest": best(reps, digests)}


def _ckptstore(root: str, state: dict[str, Any], reps: int, profile: bool) -> dict[str, Any]:
    import ckptstore

    folders: list[str] = []

    def save() -> Any:
        if folders:
            shutil.rmtree(folders.pop(), ignore_errors=True)
        folders.append(tempfile.mkdtemp(dir=root))
        return ckptstore.CheckpointStore(folders[-1]).save("s", state, parent=None)

    def load(into: Any = None) -> Any:
        return ckptstore.CheckpointStore(folders[-1], create=False).load("s", into=into)

    out = {"save": best(reps, save), "load_new": best(reps, load),
           "load_into": best(reps, lambda: load(state))}
    if profile:
        out["profiles"] = {"save": profiled(save), "load_into": profiled(lambda: load(state))}
    shutil.rmtree(folders[-1], ignore_errors=True)
    return out


def run(ctx: Ctx, n: int) -> dict[str, Any]:
    ctx.note(f"small: {n:,} tensors of 1 KiB, ckptstore and the raw limit")
    folder = ctx.folder("small")
    out = run_worker(ctx, "small.measure", root=str(folder), n=n, reps=ctx.reps,
                     profile=ctx.profile)
    shutil.rmtree(folder, ignore_errors=True)
    write_limit = min(out["raw_write_one_file"]["best_s"], out["raw_write_16mib_files"]["best_s"])
    out["ratio_save"] = write_limit / out["save"]["best_s"]
    out["ratio_load_new"] = out["raw_read_new"]["best_s"] / out["load_new"]["best_s"]
    out["ratio_load_into"] = out["raw_read_into"]["best_s"] / out["load_into"]["best_s"]
    out["floor_ratio_save"] = write_limit / (write_limit + out["floor_views_digest"]["best_s"])
    out["floor_ratio_load_into"] = out["raw_read_into"]["best_s"] / (
        out["raw_read_into"]["best_s"] + out["floor_views_digest"]["best_s"])
    return out
