"""The spawned rank of bench/dist_bench.py: one gloo process group, every measurement.

Phases (one process group each):
* ``full``: for each case (replicated only; replicated + sharded) on this world size: raw
  write+fsync and raw read limits, ckptstore collective save (CheckpointManager, sync),
  restore in place, DCP save (FileSystemWriter thread_count 1/2/4, sync_files=True) and load
  in place, then ckptstore async save and DCP async_save (first call and steady state). The
  last sync save of each contestant is kept for the resharding phase.
* resharding: restore in place the checkpoints other world sizes kept (ckptstore and DCP);
  at the end of a ``full`` phase for the world sizes that ran before, or in a ``reshard``
  phase of its own for those that run after.

Every measurement: barrier, time the call on every rank, gather the per-rank times; the
reported time is the max over ranks. Restores start from zeroed tensors and are checked
against digests of the original bytes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import state as S

CASES = ("replicated", "sharded")


class Rank:
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        import torch.distributed.checkpoint  # noqa: F401  (slow first imports, seconds
        import torch.distributed.tensor  # noqa: F401   under load: done before any timing)
        from torch.distributed.device_mesh import init_device_mesh

        import ckptstore.training.manager

        from . import trace

        if cfg.get("proposed_fixes"):
            from . import proposed

            proposed.apply()  # before tracing, so the traces time the patched functions

        self.rank, self.world, self.cfg = rank, world, cfg
        self.tracer = trace.install()
        self.mesh = init_device_mesh("cpu", (world,))
        self.spec = S.Spec(cfg["size_mib"], cfg["shard_mib"], cfg["layers"], tuple(cfg["worlds"]))
        self.work = Path(cfg["work"]) / f"w{world}"
        self.keep = Path(cfg["keep"])
        t0 = time.perf_counter()
        self.rep, self.shards = S.build(self.spec, rank, world)
        self.build_s = time.perf_counter() - t0
        self.dcp_async_group = None
        # torch + DCP + DTensor imports leave ~260k objects: a full collection takes about
        # 0.5 s on this loaded machine and, landing inside a measurement on one rank, stalls
        # every rank at the next collective. Freeze them, and keep the collector off while a
        # measurement runs (as timeit does), for both contestants alike.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str) -> None:
        if self.rank == 0 and self.cfg.get("verbose", True):
            print(f"  [w{self.world} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def gather_f(self, x: float) -> list[float]:
        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([x], dtype=torch.float64))
        return [float(o.item()) for o in out]

    def gather_obj(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def fresh(self, name: str) -> Path:
        d = self.work / name
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        dist.barrier()
        return d

    def remove(self, d: Path) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        dist.barrier()

    @contextlib.contextmanager
    def no_gc(self) -> Any:
        gc.collect()
        gc.disable()
        try:
            yield
        finally:
            gc.enable()

    def timed(self, fn: Any, trace: bool = False) -> tuple[dict[str, Any], Any]:
        """Barrier, run fn on every rank, return ({max_s, per_rank_s[, trace]}, result)."""
        with self.no_gc():
            self.tracer.reset()
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
        per = self.gather_f(dt)
        rec: dict[str, Any] = {"s": max(per), "per_rank_s": per}
        if trace:
            rec["trace"] = self.gather_obj(self.tracer.summary())
        return rec, out

    def tensors(self, case: str) -> list[torch.Tensor]:
        ts = list(self.rep.values())
        if case == "sharded":
            ts += [local for local, _a in self.shards.values()]
        return ts

    def verify(self, case: str, expected: list[str], what: str) -> None:
        ok = S.fingerprint(self.tensors(case)) == expected
        flags = self.gather_f(1.0 if ok else 0.0)
        if min(flags) < 1:
            raise AssertionError(
                f"{what}: restored bytes differ on ranks "
                f"{[i for i, f in enumerate(flags) if f < 1]}"
            )

    def logical_bytes(self, case: str) -> int:
        n = self.spec.replicated_bytes()
        return n + (self.spec.shard_global_bytes() if case == "sharded" else 0)

    def ckpt_state(self, case: str) -> dict[str, Any]:
        import ckptstore

        st: dict[str, Any] = {"model": dict(self.rep)}
        if case == "sharded":
            rows = self.spec.shard_rows
            if self.cfg["shard_kind"] == "dtensor":
                st["optim"] = self._dtensors()
            else:
                st["optim"] = {
                    k: ckptstore.Shard(local, a, (rows, S.SHARD_COLS))
                    for k, (local, a) in self.shards.items()
                }
        return st

    def _dtensors(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Shard

        rows = self.spec.shard_rows
        return {
            k: DTensor.from_local(
                local,
                self.mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size((rows, S.SHARD_COLS)),
                stride=(S.SHARD_COLS, 1),
            )
            for k, (local, _a) in self.shards.items()
        }

    def dcp_state(self, case: str) -> dict[str, Any]:
        st: dict[str, Any] = {"model": dict(self.rep)}
        if case == "sharded":
            st["optim"] = self._dtensors()
        return st

    def manager(self, root: Path, async_save: bool = False) -> Any:
        import ckptstore

        return ckptstore.CheckpointManager(
            str(root), async_save=async_save, workers=self.cfg["ckpt_workers"]
        )

    # ------------------------------------------------------------------ measurements
    def raw(self, case: str) -> dict[str, Any]:
        """Each rank writes its 1/world share of the logical bytes (its share of the
        replicated bytes, then its own shard) with write+fsync, in parallel, split over
        1 or --raw-threads files written by as many threads (best kept); then each rank reads
        back what a restore needs (every share of the replicated bytes and its own shard)
        into its tensors (the same bytes, so nothing changes), with as many threads."""
        import concurrent.futures as cf

        rep_views = [S.byte_view(t) for t in self.rep.values()]
        rep_total = sum(v.nbytes for v in rep_views)
        views = list(rep_views)
        if case == "sharded":
            views += [S.byte_view(local) for local, _a in self.shards.values()]
        shard_total = sum(v.nbytes for v in views) - rep_total

        def split_range(a: int, b: int, n: int) -> list[tuple[int, int]]:
            return [(a + (b - a) * k // n, a + (b - a) * (k + 1) // n) for k in range(n)]

        def files(r: int, n: int) -> list[tuple[str, list[tuple[int, int]]]]:
            """(file name, byte ranges of `views`) of what rank r writes with n threads:
            its share of the replicated bytes, and its own shard, each in n files."""
            a, b = rep_total * r // self.world, rep_total * (r + 1) // self.world
            out = [(f"rep-{r}-{k}", [rg]) for k, rg in enumerate(split_range(a, b, n))]
            if shard_total:
                out += [
                    (f"shard-{r}-{k}", [rg])
                    for k, rg in enumerate(split_range(rep_total, rep_total + shard_total, n))
                ]
            return out

        def write_file(path: Path, rngs: list[tuple[int, int]]) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for x, y in rngs:
                    S.write_all(fd, S.pieces(views, x, y))
                os.fsync(fd)
            finally:
                os.close(fd)

        def read_file(path: Path, rngs: list[tuple[int, int]]) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                for x, y in rngs:
                    off = S.read_all(fd, S.pieces(views, x, y), off)
            finally:
                os.close(fd)

        out: dict[str, Any] = {}
        for n in sorted({1, self.cfg["raw_threads"]}):
            d = self.fresh(f"raw-{case}-{n}")
            mine = files(self.rank, n)
            # restore: every rank's replicated share, and this rank's own shard
            need = [
                job
                for r in range(self.world)
                for job in files(r, n)
                if job[0].startswith("rep-") or r == self.rank
            ]

            def write(n: int = n, d: Path = d, mine: list = mine) -> None:
                with cf.ThreadPoolExecutor(n) as pool:
                    list(pool.map(lambda it: write_file(d / it[0], it[1]), mine))
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

            def read(n: int = n, d: Path = d, need: list = need) -> None:
                with cf.ThreadPoolExecutor(n) as pool:
                    list(pool.map(lambda it: read_file(d / it[0], it[1]), need))

            out[f"write_t{n}"], _ = self.timed(write)
            out[f"read_t{n}"], _ = self.timed(read)
            self.remove(d)
        for kind in ("write", "read"):
            best = min((k for k in out if k.startswith(kind)), key=lambda k: out[k]["s"])
            out[kind] = {**out[best], "threads": int(best.split("_t")[1])}
        return out

    def ckpt_save(self, case: str) -> tuple[dict[str, Any], Path]:
        runs = []
        keep = None
        for i in range(self.cfg["reps"]):
            root = self.fresh(f"ckpt-{case}-{i}")
            mgr = self.manager(root)
            rec, info = self.timed(lambda m=mgr: m.save(1, self.ckpt_state(case)), trace=True)
            rec["info"] = self.gather_obj(asdict(info))
            mgr.close()
            runs.append(rec)
            if keep is not None:
                self.remove(keep)
            keep = root
        assert keep is not None
        best = min(runs, key=lambda r: r["s"])
        return {
            "runs": [{k: v for k, v in r.items() if k != "trace"} for r in runs],
            "best_s": best["s"],
            "best": best,
        }, keep

    def ckpt_restore(self, case: str, root: Path, expected: list[str]) -> dict[str, Any]:
        S.zero(self.tensors(case))
        mgr = self.manager(root)
        st = self.ckpt_state(case)
        rec, step = self.timed(lambda: mgr.restore(st), trace=True)
        mgr.close()
        assert step == 1, step
        self.verify(case, expected, f"ckptstore restore ({case})")
        return rec

    def ckpt_async(self, case: str) -> dict[str, Any]:
        root = self.fresh(f"ckpt-async-{case}")
        mgr = self.manager(root, async_save=True)
        runs = []
        for call in range(self.cfg["async_calls"]):
            if call:
                S.touch(self.tensors(case))  # training changed every chunk
            st = self.ckpt_state(case)
            with self.no_gc():
                self.tracer.reset()
                dist.barrier()
                t0 = time.perf_counter()
                handle = mgr.save(call + 1, st)
                blocked = time.perf_counter() - t0
                info = handle.wait()
                total = time.perf_counter() - t0
            rec = {
                "blocked_s": max(self.gather_f(blocked)),
                "total_s": max(self.gather_f(total)),
                "info": self.gather_obj(asdict(info)),
                "trace": self.gather_obj(self.tracer.summary()),
            }
            runs.append(rec)
        if self.cfg["async_calls"] % 2 == 0:
            S.touch(self.tensors(case))  # back to the original bytes
        mgr.close()
        self.remove(root)
        return _async_summary(runs)

    def dcp_save(self, case: str) -> tuple[dict[str, Any], Path, int]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        by_threads: dict[str, Any] = {}
        best: tuple[float, int, Path] | None = None
        for n in self.cfg["dcp_threads"]:
            runs = []
            for i in range(self.cfg["reps"]):
                d = self.fresh(f"dcp-{case}-t{n}-{i}")
                st = self.dcp_state(case)
                w = FileSystemWriter(str(d), thread_count=n, sync_files=True)
                rec, _ = self.timed(lambda st=st, w=w: dcp.save(st, storage_writer=w))
                self.log(f"{case}: DCP save thread_count={n}: {rec['s']:.2f} s")
                runs.append(rec)
                if best is None or rec["s"] < best[0]:
                    if best is not None:
                        self.remove(best[2])
                    best = (rec["s"], n, d)
                else:
                    self.remove(d)
            by_threads[str(n)] = {"runs": runs, "best_s": min(r["s"] for r in runs)}
        assert best is not None
        by_rank: dict[str, int] = {}
        for f in best[2].iterdir():  # __<rank>_<n>.distcp: the bytes each rank wrote
            if f.name.startswith("__") and f.name.endswith(".distcp"):
                r = f.name[2:].split("_")[0]
                by_rank[r] = by_rank.get(r, 0) + f.stat().st_size
        return (
            {
                "by_threads": by_threads,
                "best_s": best[0],
                "best_threads": best[1],
                "bytes_by_rank": by_rank,
            },
            best[2],
            best[1],
        )

    def dcp_load(self, case: str, d: Path, expected: list[str]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        S.zero(self.tensors(case))
        st = self.dcp_state(case)
        rec, _ = self.timed(lambda: dcp.load(st, storage_reader=FileSystemReader(str(d))))
        self.verify(case, expected, f"DCP load ({case})")
        return rec

    def dcp_async(self, case: str, threads: int) -> dict[str, Any]:
        """dcp.async_save on a group of its own, in two configurations (best kept, by
        steady-state blocked time): ``default`` (the writer stages a fresh CPU copy each
        save) and ``cached_stager`` (DefaultStager with synchronous unpinned staging, which
        keeps its staging copy between saves, like ckptstore's arena)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.dcp_async_group is None:  # its own group, as ckptstore has (and DCP advises)
            self.dcp_async_group = dist.new_group(backend="gloo")
        out: dict[str, Any] = {"threads": threads}
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
                for call in range(self.cfg["async_calls"]):
                    if call:
                        S.touch(self.tensors(case))
                    d = self.fresh(f"dcp-async-{case}-{call}")
                    st = self.dcp_state(case)
                    w = FileSystemWriter(str(d), thread_count=threads, sync_files=True)
                    with self.no_gc():
                        dist.barrier()
                        t0 = time.perf_counter()
                        fut = dcp.async_save(
                            st,
                            storage_writer=w,
                            process_group=self.dcp_async_group,
                            async_stager=stager,
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
                        {
                            "blocked_s": max(self.gather_f(blocked)),
                            "total_s": max(self.gather_f(total)),
                        }
                    )
                    self.remove(d)
            finally:
                if stager is not None:
                    stager.close()
                if self.cfg["async_calls"] % 2 == 0:
                    S.touch(self.tensors(case))  # back to the original bytes
            out[config] = _async_summary(runs)
        best = min(("default", "cached_stager"), key=lambda c: out[c]["steady_blocked_s"])
        out.update({k: v for k, v in out[best].items() if k != "runs"}, config=best)
        return out

    # ------------------------------------------------------------------ phases
    def full(self) -> dict[str, Any]:
        res: dict[str, Any] = {"build_s": self.build_s}
        for case in self.cfg["cases"]:
            exp = S.fingerprint(self.tensors(case))
            r: dict[str, Any] = {"logical_bytes": self.logical_bytes(case)}
            self.log(f"{case}: raw write/read")
            r["raw"] = self.raw(case)
            self.log(f"{case}: ckptstore save")
            ck: dict[str, Any] = {}
            ck["save"], ck_root = self.ckpt_save(case)
            self.log(f"{case}: ckptstore restore")
            ck["restore"] = self.ckpt_restore(case, ck_root, exp)
            self.log(f"{case}: DCP save")
            dc: dict[str, Any] = {}
            dc["save"], dcp_dir, best_n = self.dcp_save(case)
            self.log(f"{case}: DCP load")
            dc["load"] = self.dcp_load(case, dcp_dir, exp)
            self.log(f"{case}: ckptstore async")
            ck["async"] = self.ckpt_async(case)
            self.log(f"{case}: DCP async")
            dc["async"] = self.dcp_async(case, best_n)
            if S.fingerprint(self.tensors(case)) != exp:
                raise AssertionError("the state bytes changed during the case")
            # keep both checkpoints for the resharding phase
            dist.barrier()
            if self.rank == 0:
                for src, name in ((ck_root, "ckpt"), (dcp_dir, "dcp")):
                    dst = self.keep / case / f"{name}-w{self.world}"
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(dst, ignore_errors=True)
                    shutil.move(str(src), dst)
            dist.barrier()
            r["ckptstore"], r["dcp"] = ck, dc
            res[case] = r
        if self.cfg.get("reshard_from"):
            res["reshard"] = self.reshard()
        return res

    def reshard(self) -> dict[str, Any]:
        """Restore in place the checkpoints kept by the world sizes in cfg["reshard_from"]."""
        res: dict[str, Any] = {}
        for src in self.cfg["reshard_from"]:
            by_case: dict[str, Any] = {}
            for case in self.cfg["cases"]:
                exp = S.fingerprint(self.tensors(case))
                self.log(f"{case}: restore checkpoints saved on {src} ranks")
                r: dict[str, Any] = {"logical_bytes": self.logical_bytes(case)}
                r["ckptstore"] = self.ckpt_restore(case, self.keep / case / f"ckpt-w{src}", exp)
                r["dcp"] = self.dcp_load(case, self.keep / case / f"dcp-w{src}", exp)
                by_case[case] = r
            res[str(src)] = by_case
        return res


def _async_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steady = runs[1:] or runs
    best = min(steady, key=lambda r: r["blocked_s"] + r["total_s"])
    return {
        "runs": runs,
        "first_blocked_s": runs[0]["blocked_s"],
        "first_total_s": runs[0]["total_s"],
        "steady_blocked_s": best["blocked_s"],
        "steady_total_s": best["total_s"],
    }


def main(rank: int, world: int, init_file: str, cfg_json: str, out_dir: str) -> None:
    status = Path(out_dir) / f"status-{rank}"
    try:
        cfg = json.loads(cfg_json)
        torch.set_num_threads(cfg["torch_threads"])
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=cfg["pg_timeout_s"]),
        )
        r = Rank(rank, world, cfg)
        result = (
            r.full() if cfg["phase"] == "full" else {"reshard": r.reshard(), "build_s": r.build_s}
        )
        if rank == 0:
            (Path(out_dir) / "result.json").write_text(json.dumps(result))
        dist.barrier()
        status.write_text("ok")
    except BaseException:
        status.write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
