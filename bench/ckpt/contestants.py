# ruff: noqa: B023  (lambdas and closures here run inside the loop iteration that made them)
"""Every contestant of the checkpoint benchmark. Each runs inside its own worker subprocess
(bench/ckpt/worker.py) on a freshly built state, so RSS numbers are clean and memory is
returned between contestants. Each returns a JSON-able dict of raw numbers.

Conventions: every timing is wall time with `time.perf_counter`; `summary()` keeps all runs
and the best; reads marked `cold` drop the page cache first (when the run may: root), `warm`
reads follow a read of the same files. Every save to local disk is durable when its timer
stops: peers that do not fsync get an explicit fsync inside the timed region.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from . import states as S
from .common import (
    _CPU_LOG,
    MiB,
    byte_view,
    drop_caches,
    fresh_dir,
    fsync_dir,
    fsync_file,
    peak_meter,
    read_all,
    rmtree,
    summary,
    timed,
    write_all,
)


class Ctx:
    """What a contestant gets: the state, its spec, a scratch folder and the run options."""

    def __init__(self, spec: S.StateSpec, state: dict, workdir: Path, opts: dict[str, Any]):
        self.spec = spec
        self.state = state
        self.workdir = workdir
        self.opts = opts
        self.nbytes = S.nbytes(state)
        self.reps: int = opts["reps"]
        self.cold_ok: bool = opts["cold"]
        self.chunk_bytes: int = opts.get("chunk_bytes", 16 * MiB)

    def cold(self) -> None:
        """Drop the page cache before a cold read (no-op when not permitted)."""
        if self.cold_ok:
            drop_caches()

    def zeros_like_state(self) -> dict:
        import torch

        return {k: torch.zeros_like(t) for k, t in self.state.items()}


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def touch_pages(state: dict) -> dict:
    """Read one element per 4 KiB page of every tensor. Loaders that return lazily mapped
    tensors (safetensors' load_file maps the file) only pay for the read here, so every
    new-object restore is timed up to the point where its bytes are really in memory."""
    for t in state.values():
        if t.numel():
            t.view(-1)[:: max(1, 4096 // t.element_size())].sum()
    return state


def _reads(
    ctx: Ctx,
    fn: Callable[[], Any],
    *,
    cold: bool,
    check: Callable[[Any], None] | None = None,
    reps: int | None = None,
) -> dict[str, Any]:
    """Time a read `reps` times (cold: page cache dropped before each), metering peak RSS of
    the first run; `check` validates the first result outside the timed region. Warm reads
    are cheap and noisy on a shared machine: they get one repetition more by default."""
    if reps is None:
        reps = ctx.reps if cold else ctx.reps + 1
    secs = []
    peak = None
    for r in range(reps):
        if cold:
            ctx.cold()
        with peak_meter() as m:
            dt, out = timed(fn)
        if r == 0:
            peak = m.extra
            if check is not None:
                check(out)
        del out
        secs.append(dt)
    res = summary(secs, ctx.nbytes)
    res["peak_extra_bytes"] = peak
    res["cold"] = cold and ctx.cold_ok
    return res


# ============================================================================ limits
def _file_plan(state: dict, chunk_bytes: int) -> list[list[tuple[str, int, int]]]:
    """The state's bytes, in order, cut into files of `chunk_bytes`: [(key, lo, hi), ...]."""
    files: list[list[tuple[str, int, int]]] = [[]]
    room = chunk_bytes
    for k, t in state.items():
        n = t.numel() * t.element_size()
        pos = 0
        while pos < n:
            take = min(room, n - pos)
            files[-1].append((k, pos, pos + take))
            pos += take
            room -= take
            if room == 0:
                files.append([])
                room = chunk_bytes
    return [f for f in files if f]


def limits(ctx: Ctx) -> dict[str, Any]:
    """Memory copy of the state, raw parallel write+fsync of its bytes in chunk-size files, and
    raw parallel reads of those files straight into preallocated tensors."""
    import torch

    state = ctx.state
    out: dict[str, Any] = {}
    # -- memory copy
    dst = {k: torch.empty_like(t) for k, t in state.items()}
    first, _ = timed(lambda: [d.copy_(state[k]) for k, d in dst.items()])
    secs = [
        timed(lambda: [d.copy_(state[k]) for k, d in dst.items()])[0] for _ in range(ctx.reps + 1)
    ]
    out["memcpy_prealloc"] = summary(secs, ctx.nbytes)
    out["memcpy_prealloc"]["first_touch_s"] = first
    views_src = {k: byte_view(t) for k, t in state.items()}
    views_dst = {k: byte_view(t) for k, t in dst.items()}
    np_secs = [
        timed(lambda: [np.copyto(views_dst[k], v) for k, v in views_src.items()])[0]
        for _ in range(ctx.reps)
    ]
    out["memcpy_numpy_1thread"] = summary(np_secs, ctx.nbytes)

    def clone_all() -> None:
        c = {k: t.clone() for k, t in state.items()}
        del c

    out["clone_fresh_alloc"] = summary([timed(clone_all)[0] for _ in range(ctx.reps)], ctx.nbytes)

    # -- raw write + fsync
    plan = _file_plan(state, ctx.chunk_bytes)
    out["files"] = len(plan)
    out["file_bytes"] = ctx.chunk_bytes

    def write_files(folder: Path, threads: int) -> None:
        def one(i: int) -> None:
            fd = os.open(folder / f"{i:06d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_all(fd, [memoryview(views_src[k][lo:hi]) for k, lo, hi in plan[i]])
                os.fsync(fd)
            finally:
                os.close(fd)

        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(plan))))
        fsync_dir(folder)

    writes: dict[str, Any] = {}
    folder = ctx.workdir / "raw"
    for n in ctx.opts["raw_threads"]:
        secs = []
        for _ in range(ctx.reps):
            folder = fresh_dir(ctx.workdir, "raw")
            os.sync()
            secs.append(timed(lambda: write_files(folder, n))[0])
        writes[str(n)] = summary(secs, ctx.nbytes)
    out["raw_write_fsync"] = writes
    best_w = min(writes.values(), key=lambda r: r["best_s"])
    out["raw_write_fsync_best"] = {
        **best_w,
        "threads": int(min(writes, key=lambda n: writes[n]["best_s"])),
    }

    # -- raw read into the preallocated destination
    def read_into(views: dict[str, Any], threads: int) -> None:
        def one(i: int) -> None:
            fd = os.open(folder / f"{i:06d}", os.O_RDONLY)
            try:
                read_all(fd, [memoryview(views[k][lo:hi]) for k, lo, hi in plan[i]])
            finally:
                os.close(fd)

        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(plan))))

    def read_files(threads: int) -> None:
        read_into(views_dst, threads)

    for mode in ("cold", "warm"):
        reads: dict[str, Any] = {}
        for n in ctx.opts["raw_threads"]:
            if mode == "warm":
                read_files(n)
            reads[str(n)] = _reads(ctx, lambda n=n: read_files(n), cold=mode == "cold")
        out[f"raw_read_{mode}"] = reads
        best_n = min(reads, key=lambda n: reads[n]["best_s"])
        out[f"raw_read_{mode}_best"] = {**reads[best_n], "threads": int(best_n)}
    # sanity: the files hold the state
    assert _equal(dst, state), "raw read returned other bytes than written"

    # -- raw read into freshly allocated tensors: what a restore into new objects can reach
    # (first-touch page faults of new memory are part of it), at the best preallocated count
    def read_files_new(threads: int) -> dict[str, Any]:
        fresh = {k: torch.empty_like(t) for k, t in state.items()}
        read_into({k: byte_view(t) for k, t in fresh.items()}, threads)
        return fresh

    def check_new(fresh: dict[str, Any]) -> None:
        assert _equal(fresh, state), "raw read into new tensors returned other bytes"

    for mode in ("cold", "warm"):
        n = out[f"raw_read_{mode}_best"]["threads"]
        if mode == "warm":
            read_files_new(n)
        out[f"raw_read_new_{mode}"] = {
            **_reads(ctx, lambda n=n: read_files_new(n), cold=mode == "cold", check=check_new),
            "threads": n,
        }
    rmtree(folder)
    return out


# ============================================================================ torch.save
def torch_save(ctx: Ctx) -> dict[str, Any]:
    import torch

    state = ctx.state
    path = ctx.workdir / "state.pt"
    out: dict[str, Any] = {}

    def save_fsync() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(ctx.workdir)

    for label, fn in (
        ("save_fsync", save_fsync),
        ("save_no_fsync", lambda: torch.save(state, path)),
    ):
        secs, peak = [], None
        for r in range(ctx.reps):
            path.unlink(missing_ok=True)
            os.sync()
            with peak_meter() as m:
                secs.append(timed(fn)[0])
            peak = m.extra if r == 0 else peak
        os.sync()
        out[label] = {**summary(secs, ctx.nbytes), "peak_extra_bytes": peak}

    def load() -> dict:
        return touch_pages(torch.load(path, weights_only=True))

    def check(got: dict) -> None:
        assert _equal(got, state), "torch.load mismatch"

    out["load_cold"] = _reads(ctx, load, cold=True, check=check)
    load()
    out["load_warm"] = _reads(ctx, load, cold=False)
    out["file_bytes"] = path.stat().st_size
    path.unlink()
    return out


# ============================================================================ safetensors
def safetensors_(ctx: Ctx) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    state = ctx.state
    path = ctx.workdir / "state.safetensors"
    out: dict[str, Any] = {}

    def save() -> None:
        save_file(state, str(path))
        fsync_file(path)
        fsync_dir(ctx.workdir)

    secs, peak = [], None
    for r in range(ctx.reps):
        path.unlink(missing_ok=True)
        os.sync()
        with peak_meter() as m:
            secs.append(timed(save)[0])
        peak = m.extra if r == 0 else peak
    out["save_fsync"] = {**summary(secs, ctx.nbytes), "peak_extra_bytes": peak}

    def check(got: dict) -> None:
        assert _equal(got, state), "safetensors load mismatch"

    def load() -> dict:
        return touch_pages(load_file(str(path)))

    out["load_cold"] = _reads(ctx, load, cold=True, check=check)
    out["load_cold"]["note"] = "load_file maps the file lazily: pages are touched inside the timer"
    load()
    out["load_warm"] = _reads(ctx, load, cold=False)
    path.unlink()
    return out


# ============================================================================ DCP
def dcp(ctx: Ctx) -> dict[str, Any]:
    """torch.distributed.checkpoint save with FileSystemWriter(thread_count=N, sync_files=True)
    for each N, and load (in place into preallocated tensors: DCP always loads in place)."""
    import torch.distributed.checkpoint as dcp_mod
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    state = ctx.state
    out: dict[str, Any] = {"save": {}}
    for n in ctx.opts["dcp_threads"]:
        secs, peak = [], None
        for r in range(ctx.reps):
            d = fresh_dir(ctx.workdir, f"dcp{n}")
            os.sync()
            w = FileSystemWriter(str(d), thread_count=n, sync_files=True)
            with peak_meter() as m:
                secs.append(timed(lambda: dcp_mod.save(state, storage_writer=w, no_dist=True))[0])
            peak = m.extra if r == 0 else peak
        out["save"][str(n)] = {**summary(secs, ctx.nbytes), "peak_extra_bytes": peak}
        if n != ctx.opts["dcp_threads"][-1]:
            rmtree(d)
    best_n = min(out["save"], key=lambda n: out["save"][n]["best_s"])
    out["save_best"] = {**out["save"][best_n], "threads": int(best_n)}
    folder = ctx.workdir / f"dcp{ctx.opts['dcp_threads'][-1]}"
    dest = ctx.zeros_like_state()

    def load() -> dict:
        dcp_mod.load(dest, storage_reader=FileSystemReader(str(folder)), no_dist=True)
        return dest

    def check(got: dict) -> None:
        assert _equal(got, state), "DCP load mismatch"

    # DCP's reader is slow (one torch.load per item, files read one after another): the cold
    # load is timed once and the warm one twice, to keep the run short
    out["load_cold"] = _reads(ctx, load, cold=True, check=check, reps=1)
    out["load_cold"]["from_thread_count"] = ctx.opts["dcp_threads"][-1]
    load()
    out["load_warm"] = _reads(ctx, load, cold=False, reps=2)
    out["files"] = len(os.listdir(folder))
    for n in ctx.opts["dcp_threads"]:
        rmtree(ctx.workdir / f"dcp{n}")
    return out


def dcp_async(ctx: Ctx) -> dict[str, Any]:
    """DCP async_save on a gloo process group of world size 1: time blocked (until async_save
    returns) and total (until its future resolves). Each config saves `calls` times (state
    changed in between, like training): the first call and the steady state are reported.

    Configs: ``default`` (the FileSystemWriter stages: a fresh CPU copy per save) and
    ``cached_stager`` (DefaultStager with synchronous, unpinned staging: its StateDictStager
    keeps the staging copy between saves, like ckptstore's reusable arena).
    FileSystemWriter(cache_staged_state_dict=True) pins memory and fails without an
    accelerator, so it is not used."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp_mod
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    store_file = ctx.workdir / "pg-filestore"
    store_file.unlink(missing_ok=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(store_file), 1), rank=0, world_size=1)
    threads = ctx.opts.get("dcp_async_threads", 4)
    calls = ctx.opts.get("async_calls", 3)
    out: dict[str, Any] = {"threads": threads, "calls": calls}
    try:
        for config in ("default", "cached_stager"):
            stager = None
            if config == "cached_stager":
                stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=False,
                        use_shared_memory=False,
                        use_async_staging=False,
                        use_non_blocking_copy=False,
                    )
                )
            runs = []
            try:
                for i in range(calls):
                    S.touch(ctx.state)
                    d = fresh_dir(ctx.workdir, f"dcpa-{i}")
                    writer = FileSystemWriter(str(d), thread_count=threads, sync_files=True)
                    os.sync()
                    with peak_meter() as m:
                        t0 = time.perf_counter()
                        fut = dcp_mod.async_save(
                            ctx.state, storage_writer=writer, async_stager=stager
                        )
                        if hasattr(fut, "staging_completion"):
                            fut.staging_completion.result()
                        blocked = time.perf_counter() - t0
                        if hasattr(fut, "upload_completion"):
                            fut.upload_completion.result()
                        else:
                            fut.result()
                        total = time.perf_counter() - t0
                    runs.append(
                        {"blocked_s": blocked, "total_s": total, "peak_extra_bytes": m.extra}
                    )
                    rmtree(d)
            except Exception as exc:  # noqa: BLE001  (recorded, the other config still runs)
                out[config] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            finally:
                if stager is not None:
                    stager.close()
            steady = runs[1:] or runs
            out[config] = {
                "runs": runs,
                "first_blocked_s": runs[0]["blocked_s"],
                "steady_blocked_s": min(r["blocked_s"] for r in steady),
                "steady_total_s": min(r["total_s"] for r in steady),
                "bytes": ctx.nbytes,
            }
    finally:
        dist.destroy_process_group()
    ok = [c for c in ("default", "cached_stager") if "steady_blocked_s" in out.get(c, {})]
    if not ok:
        raise RuntimeError(f"every DCP async config failed: {out}")
    best = min(ok, key=lambda c: out[c]["steady_blocked_s"])
    out["best"] = {**out[best], "config": best}
    return out


# ============================================================================ ckptstore
def _info(info: Any) -> dict[str, Any]:
    d = asdict(info)
    d["throughput_gbps"] = info.logical_bytes / info.seconds / 1e9 if info.seconds else None
    return d


def _store_kwargs(ctx: Ctx) -> dict[str, Any]:
    kw = dict(ctx.opts.get("ckpt_options") or {})
    if ctx.opts.get("endpoint"):
        kw["endpoint_url"] = ctx.opts["endpoint"]
    return kw


def _repo(ctx: Ctx, uri: str, **extra: Any):  # -> CheckpointStore
    import ckptstore

    return ckptstore.CheckpointStore(uri, **{**_store_kwargs(ctx), **extra})


def _ckpt_core(
    ctx: Ctx,
    uri_for: Callable[[str], str],
    cleanup: Callable[[str], None],
    *,
    with_async: bool,
    reps: int,
) -> dict[str, Any]:
    """Full save (fresh repository per rep), restores (new objects, and `into=`), incremental
    saves with ~10% of the bytes changed, and (optionally) async saves."""
    state = ctx.state
    out: dict[str, Any] = {}
    # -- full save
    secs, infos, peak = [], [], None
    uri = ""
    for r in range(reps):
        if uri:
            cleanup(uri)
        uri = uri_for(f"full{r}")
        os.sync()
        repo = _repo(ctx, uri)
        with peak_meter() as m:
            dt, info = timed(lambda: repo.save("full", state))
        peak = m.extra if r == 0 else peak
        secs.append(dt)
        infos.append(_info(info))
        if r < reps - 1:
            repo.close()
    best = min(range(reps), key=lambda i: secs[i])
    out["save"] = {
        **summary(secs, ctx.nbytes),
        "info": infos[best],
        "infos": infos,
        "peak_extra_bytes_rss": peak,
    }
    out["first_save_reused_chunks"] = infos[0]["chunks_reused"]  # must be 0: no accidental dedup

    # -- restores (a fresh CheckpointStore per read: manifest not cached, like a restarted job)
    def load_new() -> dict:
        return touch_pages(_repo(ctx, uri).load("full"))

    dest = ctx.zeros_like_state()

    def load_into() -> dict:
        return _repo(ctx, uri).load("full", into=dest)

    def check(got: dict) -> None:
        assert _equal(got, state), "ckptstore restore mismatch"

    cold = ctx.opts.get("local", True)
    out["load_new_cold" if cold else "load_new"] = _reads(ctx, load_new, cold=cold, check=check)
    out["load_into_cold" if cold else "load_into"] = _reads(ctx, load_into, cold=cold, check=check)
    if cold:
        load_into()
        out["load_new_warm"] = _reads(ctx, load_new, cold=False)
        out["load_into_warm"] = _reads(ctx, load_into, cold=False)
    dest.clear()

    # -- incremental: the same CheckpointStore (knows its own chunks) and a fresh one
    #    (knows only the parent manifest, like a restarted job)
    inc = {}
    for label, seed, fresh in (("same_object", 1, False), ("fresh_object", 2, True)):
        keys = S.changed_subset(state, 0.10, seed=seed)
        S.touch(state, keys)
        if fresh:
            repo.close()
            repo = _repo(ctx, uri)
        os.sync()
        dt, info = timed(lambda: repo.save(f"inc-{label}", state))
        changed = sum(state[k].numel() * state[k].element_size() for k in keys)
        inc[label] = {
            "seconds": dt,
            "cpu_s": _CPU_LOG[-1],
            "info": _info(info),
            "changed_tensors": len(keys),
            "changed_tensor_fraction": len(keys) / len(state),
            "changed_bytes_fraction": changed / ctx.nbytes,
            "written_fraction": info.written_bytes / info.logical_bytes,
            "time_vs_full_save": dt / out["save"]["best_s"],
        }
    out["incremental"] = inc
    repo.close()
    cleanup(uri)

    # -- async
    if with_async:
        calls = ctx.opts.get("async_calls", 3)
        uri = uri_for("async")
        repo = _repo(ctx, uri)
        runs = []
        for i in range(calls):
            S.touch(state)
            os.sync()
            with peak_meter() as m:
                t0 = time.perf_counter()
                h = repo.save_async(f"a{i}", state)
                blocked = time.perf_counter() - t0
                info = h.wait()
                total = time.perf_counter() - t0
            runs.append(
                {
                    "blocked_s": blocked,
                    "total_s": total,
                    "peak_extra_bytes": m.extra,
                    "info": _info(info),
                }
            )
        repo.close()
        cleanup(uri)
        steady = runs[1:] or runs
        out["async"] = {
            "runs": runs,
            "first_blocked_s": runs[0]["blocked_s"],
            "steady_blocked_s": min(r["blocked_s"] for r in steady),
            "steady_total_s": min(r["total_s"] for r in steady),
            "bytes": ctx.nbytes,
        }
    return out


def ckptstore_local(ctx: Ctx) -> dict[str, Any]:
    return _ckpt_core(
        ctx, lambda name: str(fresh_dir(ctx.workdir, name)), rmtree, with_async=True, reps=ctx.reps
    )


# -- memory: one measurement per fresh subprocess ---------------------------------------
def ckptstore_mem_save(ctx: Ctx) -> dict[str, Any]:
    """Peak extra RSS of one synchronous save; leaves the checkpoint for the load meters."""
    folder = Path(ctx.opts["mem_dir"])
    rmtree(folder)
    repo = _repo(ctx, str(folder))
    with peak_meter() as m:
        info = repo.save("full", ctx.state)
    repo.close()
    return {
        "peak_extra_bytes": m.extra,
        "method": m.method,
        "info": _info(info),
        "max_inflight_bytes": repo.save_options.max_inflight_bytes,
        "state_bytes": ctx.nbytes,
    }


def ckptstore_mem_async(ctx: Ctx) -> dict[str, Any]:
    """Peak extra RSS of one async save (staging arena = a full copy, by design)."""
    folder = fresh_dir(ctx.workdir, "mem-async")
    repo = _repo(ctx, str(folder))
    with peak_meter() as m:
        info = repo.save_async("a", ctx.state).wait()
    repo.close()
    rmtree(folder)
    return {
        "peak_extra_bytes": m.extra,
        "method": m.method,
        "info": _info(info),
        "state_bytes": ctx.nbytes,
    }


def ckptstore_mem_load_new(ctx: Ctx) -> dict[str, Any]:
    """Peak extra RSS of a restore into new tensors (the state itself is not built here); the
    new state is necessarily `state_bytes`, so `overhead` is what restore adds beyond it."""
    repo = _repo(ctx, ctx.opts["mem_dir"])
    with peak_meter() as m:
        got = repo.load("full")
    n = S.nbytes(got)
    return {
        "peak_extra_bytes": m.extra,
        "overhead_bytes": m.extra - n,
        "state_bytes": n,
        "method": m.method,
    }


def ckptstore_mem_load_into(ctx: Ctx) -> dict[str, Any]:
    """Peak extra RSS of a restore into existing (resident) tensors."""
    repo = _repo(ctx, ctx.opts["mem_dir"])
    with peak_meter() as m:
        repo.load("full", into=ctx.state)
    return {"peak_extra_bytes": m.extra, "state_bytes": ctx.nbytes, "method": m.method}


# ============================================================================ S3 (moto)
def _s3_client(endpoint: str, pool: int):  # -> botocore client
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(
            max_pool_connections=pool,
            retries={"mode": "standard", "total_max_attempts": 5},
            s3={"addressing_style": "path"},
        ),
    )


def _make_bucket(endpoint: str, bucket: str) -> None:
    c = _s3_client(endpoint, 4)
    try:
        c.create_bucket(Bucket=bucket)
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass


def _empty_prefix(endpoint: str, bucket: str, prefix: str) -> None:
    c = _s3_client(endpoint, 4)
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def s3_raw(ctx: Ctx) -> dict[str, Any]:
    """Raw parallel boto3 put/get of the state's bytes as chunk-size objects (same client
    settings a store would use: path style, standard retries, boto3's default checksums)."""
    endpoint = ctx.opts["endpoint"]
    bucket = ctx.opts["bucket"]
    _make_bucket(endpoint, bucket)
    plan = _file_plan(ctx.state, ctx.chunk_bytes)
    src = {k: byte_view(t) for k, t in ctx.state.items()}
    dest = ctx.zeros_like_state()
    dst = {k: byte_view(t) for k, t in dest.items()}
    out: dict[str, Any] = {
        "objects": len(plan),
        "object_bytes": ctx.chunk_bytes,
        "put": {},
        "get": {},
    }
    for n in ctx.opts["s3_threads"]:
        client = _s3_client(endpoint, max(10, n + 2))

        def put_one(i: int, prefix: str) -> None:
            body = b"".join(memoryview(src[k][lo:hi]) for k, lo, hi in plan[i])
            client.put_object(Bucket=bucket, Key=f"{prefix}/{i:06d}", Body=body)

        def get_one(i: int, prefix: str) -> None:
            body = client.get_object(Bucket=bucket, Key=f"{prefix}/{i:06d}")["Body"].read()
            pos = 0
            for k, lo, hi in plan[i]:
                dst[k][lo:hi] = np.frombuffer(body, np.uint8, hi - lo, pos)
                pos += hi - lo

        psecs, gsecs = [], []
        for r in range(ctx.opts.get("s3_reps", 1)):
            prefix = f"raw{n}-{r}"
            with cf.ThreadPoolExecutor(n) as pool:
                psecs.append(
                    timed(lambda: list(pool.map(lambda i: put_one(i, prefix), range(len(plan)))))[0]
                )
            with cf.ThreadPoolExecutor(n) as pool:
                gsecs.append(
                    timed(lambda: list(pool.map(lambda i: get_one(i, prefix), range(len(plan)))))[0]
                )
            _empty_prefix(endpoint, bucket, prefix)
        out["put"][str(n)] = summary(psecs, ctx.nbytes, cpu=False)
        out["get"][str(n)] = summary(gsecs, ctx.nbytes, cpu=False)
    assert _equal(dest, ctx.state), "raw S3 get returned other bytes"
    for op in ("put", "get"):
        best_n = min(out[op], key=lambda n: out[op][n]["best_s"])
        out[f"{op}_best"] = {**out[op][best_n], "threads": int(best_n)}
    return out


def ckptstore_s3(ctx: Ctx) -> dict[str, Any]:
    endpoint = ctx.opts["endpoint"]
    bucket = ctx.opts["bucket"]
    _make_bucket(endpoint, bucket)
    ctx.opts["local"] = False
    return _ckpt_core(
        ctx,
        lambda name: f"s3://{bucket}/{name}",
        lambda uri: _empty_prefix(endpoint, bucket, uri.split("/", 3)[3]),
        with_async=False,
        reps=ctx.opts.get("s3_reps", 1),
    )


# ============================================================================ extras
def ckptstore_codecs(ctx: Ctx) -> dict[str, Any]:
    """Compression per save: stored/raw ratio, save and warm restore throughput."""
    out: dict[str, Any] = {}
    for codec in (None, "lz4", "zstd", "blosc"):
        folder = fresh_dir(ctx.workdir, f"codec-{codec}")
        os.sync()
        repo = _repo(ctx, str(folder))
        dt, info = timed(lambda: repo.save("c", ctx.state, compression=codec))
        repo.load("c")
        lt, _ = timed(lambda: repo.load("c"))
        out[str(codec)] = {
            "save_s": dt,
            "save_gbps": ctx.nbytes / dt / 1e9,
            "ratio": info.written_bytes / info.logical_bytes,
            "load_warm_s": lt,
            "load_warm_gbps": ctx.nbytes / lt / 1e9,
            "stage_seconds": info.stage_seconds,
        }
        repo.close()
        rmtree(folder)
    return out


def ckptstore_sweep(ctx: Ctx) -> dict[str, Any]:
    """Save and warm into= restore over chunk_bytes x workers, for tuning the defaults."""
    out: dict[str, Any] = {}
    dest = ctx.zeros_like_state()
    for chunk in ctx.opts.get("sweep_chunks", (4 * MiB, 16 * MiB, 64 * MiB)):
        for workers in ctx.opts.get("sweep_workers", (2, 4, 8)):
            folder = fresh_dir(ctx.workdir, "sweep")
            os.sync()
            repo = _repo(ctx, str(folder), chunk_bytes=chunk, workers=workers)
            dt, info = timed(lambda: repo.save("s", ctx.state))
            repo.load("s", into=dest)
            lt, _ = timed(lambda: repo.load("s", into=dest))
            out[f"{chunk // MiB}MiB/w{workers}"] = {
                "chunk_bytes": chunk,
                "workers": workers,
                "save_s": dt,
                "save_gbps": ctx.nbytes / dt / 1e9,
                "load_into_warm_s": lt,
                "load_into_warm_gbps": ctx.nbytes / lt / 1e9,
                "stage_seconds": info.stage_seconds,
            }
            repo.close()
            rmtree(folder)
    return out


CONTESTANTS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "limits": limits,
    "torch_save": torch_save,
    "safetensors": safetensors_,
    "dcp": dcp,
    "dcp_async": dcp_async,
    "ckptstore": ckptstore_local,
    "ckptstore_mem_save": ckptstore_mem_save,
    "ckptstore_mem_async": ckptstore_mem_async,
    "ckptstore_mem_load_new": ckptstore_mem_load_new,
    "ckptstore_mem_load_into": ckptstore_mem_load_into,
    "s3_raw": s3_raw,
    "ckptstore_s3": ckptstore_s3,
    # the same two on SeaweedFS, a real object store (the endpoint comes in ctx.opts)
    "s3_raw_seaweedfs": s3_raw,
    "ckptstore_s3_seaweedfs": ckptstore_s3,
    "ckptstore_codecs": ckptstore_codecs,
    "ckptstore_sweep": ckptstore_sweep,
}

#: contestants that need no state of their own (they build an empty one or none)
NO_STATE = {"ckptstore_mem_load_new"}
EMPTY_STATE = {"ckptstore_mem_load_into"}
