#!/usr/bin/env python
"""torch.distributed.checkpoint storage backends on the same state and process groups:
ckptstore.dcp (StorageWriter / StorageReader) against DCP's own FileSystemWriter / Reader.

    python bench/dcp_bench.py                 # ~5-8 min on this loaded 2-core machine
    python bench/dcp_bench.py --dense-mib 256 --small-count 5000 --reps 1   # a quick look

States: "dense", float32 tensors of 32 MiB, --dense-mib in all (default 1 GiB); "small",
--small-count tensors (default 20,000) of 64-1,024 float32 elements (about 20 MiB), as a
model's norms, biases and optimizer scalars would be. World sizes 1 and 2 (--ranks): one
gloo process group per world size (torch.multiprocessing, spawn); on 2 ranks every tensor
is a DTensor sharded on dim 0 over both (FSDP2's layout), so each rank writes and reads its
half.

For each state and world size, on the same process group: dcp.save with our StorageWriter,
dcp.save with FileSystemWriter (sync_files=True, thread_count 1 and 4: the better one is
reported), dcp.load in place with our StorageReader and with FileSystemReader, into zeroed
tensors checked against the saved ones afterwards (outside the timing). DCP's default
planners both ways. Every time is rank 0's wall time between two barriers; the best of
--reps (dense) or --small-reps repetitions, each into a fresh folder. Then ckptstore's
incremental save: the same state with 10% of its tensors changed, saved again into the
same repository: bytes written (summed over ranks) over the state's bytes, and how much
the repository grew (the manifest included).

Prints a table, then one JSON line (`{"bench": "dcp", ...}`) with every figure. Ratios are
DCP seconds / ckptstore seconds: above 1 means ckptstore is faster. Targets: save >= 1.0x,
load >= 1.5x, incremental writes <= 12%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense-mib", type=int, default=1024, help="dense state, MiB (1 GiB)")
    p.add_argument("--small-count", type=int, default=20_000, help="small tensors (20,000)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes")
    p.add_argument("--reps", type=int, default=2,
                   help="repetitions of the dense state; the best is kept (2)")
    p.add_argument("--small-reps", type=int, default=1,
                   help="repetitions of the small state (1: DCP's planning dominates there)")
    p.add_argument("--scratch", default=None, help="scratch folder (default: a temp folder)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ the states
def make_state(kind: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """This rank's part of the state: plain tensors on 1 rank, DTensor Shard(0) on more."""
    import torch

    g = torch.Generator().manual_seed(1234)
    if kind == "dense":
        n = max(1, args.dense_mib // 32)
        shapes: list[tuple[int, ...]] = [(2048, 4096)] * n  # 32 MiB of float32 each
    else:
        shapes = [(2 * (32 + (i * 37) % 481),) for i in range(args.small_count)]
    fulls = [torch.randn(s, generator=g) for s in shapes]
    if world == 1:
        return {"model": {f"p{i}": t for i, t in enumerate(fulls)}}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i, t in enumerate(fulls):
        local = t.chunk(world)[rank].clone()  # even sizes: every rank holds rows
        out[f"p{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"model": out}


def locals_of(state: dict[str, Any]) -> list[Any]:
    return [v.to_local() if hasattr(v, "to_local") else v for v in state["model"].values()]


def zeroed(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for k, v in state["model"].items():
        if hasattr(v, "to_local"):
            from torch.distributed.tensor import DTensor

            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh,
                                        v.placements, run_check=False)
        else:
            out[k] = torch.zeros_like(v)
    return {"model": out}


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------ a rank
def timed(fn: Any) -> float:
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, init: str, scratch: str, args: argparse.Namespace,
           out: str) -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import ckptstore.dcp as cdcp

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world)
    results: list[dict[str, Any]] = []
    try:
        for kind in ("dense", "small"):
            state = make_state(kind, args, rank, world)
            base = Path(scratch) / f"{kind}-{world}"
            best: dict[str, float] = {}
            dcp_threads = 1
            for rep in range(args.reps if kind == "dense" else args.small_reps):
                # --- ckptstore
                repo = base / f"ours-{rep}"
                writer = cdcp.StorageWriter(repo, "s")
                t = timed(partial(dcp_save, state, storage_writer=writer))
                writer.close()
                best["save_ours"] = min(best.get("save_ours", t), t)
                dest = zeroed(state)
                reader = cdcp.StorageReader(repo, "s")
                t = timed(partial(dcp_load, dest, storage_reader=reader))
                reader.close()
                best["load_ours"] = min(best.get("load_ours", t), t)
                check(dest, state, "ckptstore")
                # --- DCP's own, thread_count 1 and 4
                for threads in (1, 4):
                    folder = base / f"dcp-{rep}-{threads}"
                    fsw = FileSystemWriter(str(folder), thread_count=threads, sync_files=True)
                    t = timed(partial(dcp_save, state, storage_writer=fsw))
                    if t < best.get("save_dcp", float("inf")):
                        best["save_dcp"], dcp_threads = t, threads
                dest = zeroed(state)
                fsr = FileSystemReader(str(base / f"dcp-{rep}-1"))
                t = timed(partial(dcp_load, dest, storage_reader=fsr))
                best["load_dcp"] = min(best.get("load_dcp", t), t)
                check(dest, state, "DCP")
                dist.barrier()
                if rank == 0:
                    for p in base.glob(f"dcp-{rep}-*"):
                        shutil.rmtree(p)
                    if rep:
                        shutil.rmtree(base / f"ours-{rep}")
                dist.barrier()
            # --- incremental: 10% of the tensors changed, saved into the same repository
            repo = base / "ours-0"
            before = tree_bytes(repo) if rank == 0 else 0
            tensors = locals_of(state)
            changed = max(1, len(tensors) // 10)
            with torch.no_grad():
                for t_ in tensors[:changed]:
                    t_.add_(1.0)
            writer = cdcp.StorageWriter(repo, "s-incremental")
            t = timed(partial(dcp_save, state, storage_writer=writer))
            writer.close()
            if rank == 0:
                info = writer.last_save
                assert info is not None
                grown = tree_bytes(repo) - before
                total = info.logical_bytes
                results.append({
                    "state": kind, "ranks": world, "bytes": total,
                    "tensors": len(state["model"]), "dcp_save_threads": dcp_threads,
                    "save_ours_s": best["save_ours"], "save_dcp_s": best["save_dcp"],
                    "load_ours_s": best["load_ours"], "load_dcp_s": best["load_dcp"],
                    "save_ratio": best["save_dcp"] / best["save_ours"],
                    "load_ratio": best["load_dcp"] / best["load_ours"],
                    "incremental_s": t, "incremental_changed": changed,
                    "incremental_written_fraction": info.written_bytes / total,
                    "incremental_repo_growth_fraction": grown / total,
                })
                shutil.rmtree(base)
            del state
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def check(dest: dict[str, Any], state: dict[str, Any], who: str) -> None:
    import torch

    for a, b in zip(locals_of(dest), locals_of(state)):
        if not torch.equal(a, b):
            raise AssertionError(f"{who}: a loaded tensor differs from the saved one")


# ------------------------------------------------------------------------------ main
def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'state':<6} {'ranks':>5} {'MiB':>7} {'op':<5} {'ckptstore s':>11} {'DCP s':>8} "
            f"{'DCP/ckpt':>8} {'ckpt GB/s':>9} {'DCP GB/s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        mib = r["bytes"] / 2**20
        for op in ("save", "load"):
            ours, theirs = r[f"{op}_ours_s"], r[f"{op}_dcp_s"]
            lines.append(f"{r['state']:<6} {r['ranks']:>5} {mib:>7.1f} {op:<5} {ours:>11.3f} "
                         f"{theirs:>8.3f} {theirs / ours:>7.2f}x {r['bytes'] / ours / 1e9:>9.2f}"
                         f" {r['bytes'] / theirs / 1e9:>8.2f}")
        lines.append(f"{r['state']:<6} {r['ranks']:>5} {mib:>7.1f} incr  "
                     f"{r['incremental_s']:>11.3f}  ({r['incremental_changed']} of "
                     f"{r['tensors']} tensors changed: wrote "
                     f"{100 * r['incremental_written_fraction']:.1f}% of the bytes, repository "
                     f"grew {100 * r['incremental_repo_growth_fraction']:.1f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from torch.multiprocessing.spawn import start_processes

    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="dcp-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for world in args.ranks:
            out = scratch / f"results-{world}.json"
            init = scratch / f"pg-{world}"
            spawn: Any = start_processes  # torch leaves it unannotated
            spawn(worker, args=(world, str(init), str(scratch), args, str(out)), nprocs=world,
                  join=True, start_method="spawn")
            results.extend(json.loads(out.read_text()))
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(table(results))
    saves = [r["save_ratio"] for r in results]
    loads = [r["load_ratio"] for r in results]
    incr = [r["incremental_written_fraction"] for r in results]
    summary = {
        "bench": "dcp", "command": "python bench/dcp_bench.py " + " ".join(argv or sys.argv[1:]),
        "seconds": time.perf_counter() - t0, "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "results": results,
        "targets": {"save_ratio_min": 1.0, "load_ratio_min": 1.5,
                    "incremental_written_max": 0.12},
        "met": {"save": min(saves) >= 1.0, "load": min(loads) >= 1.5,
                "incremental": max(incr) <= 0.12},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
