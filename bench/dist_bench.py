#!/usr/bin/env python
"""Multi-rank checkpoint benchmark: ckptstore's CheckpointManager against
torch.distributed.checkpoint (DCP) on the same gloo process groups and the same state.

    python bench/dist_bench.py --ranks 2 4 --out bench/results/dist.json  # ~8 min here
    python bench/dist_bench.py --ranks 2 4 --size-mib 256 --out /tmp/dist.json  # ~5 min
    python bench/dist_bench.py --proposed-fixes ...  # ckptstore with bench/dist/proposed.py

For each world size it spawns one gloo process group on the CPU (torch.multiprocessing,
start method spawn, file:// rendezvous in a temp folder) and measures, on the same process
group and state (bench/dist/state.py; DDP-like replicated model of --size-mib, plus in the
"sharded" case a row-sharded part of --shard-mib, ckptstore.Shard / DTensor Shard(0)):

* raw limit: every rank write+fsyncs its 1/world share of the bytes in parallel (1 or 4
  threads and files per rank, best); every rank reads back what a restore needs;
* ckptstore: collective CheckpointManager.save (sync), async save (blocked / total), restore
  in place on the same world size and on another one (saved on 4, restored on 2, and back);
* DCP: dcp.save with FileSystemWriter(thread_count=1/2/4 -> best, sync_files=True),
  dcp.load in place, dcp.async_save (blocked / total; default staging and a DefaultStager
  that keeps its copy between saves, best), the same restores.

Each measurement starts after a barrier (Python's collector off during it); its time is the
max over ranks. Restores start from zeroed tensors and are checked against digests of the
original bytes. Target folders are fresh for every save and removed afterwards; the scratch
folder is removed at the end. Prints a rich table and rank 0's breakdown of ckptstore's
collective save, and writes everything (per-rank times, every rank's SaveInfo, a wall-time
trace of ckptstore's protocol, load averages and pressure) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes")
    p.add_argument(
        "--size-mib",
        type=int,
        default=512,
        help="replicated (DDP-like) model state, MiB in total (default 512: about "
        "7-8 minutes for 2 and 4 ranks on this 2-core machine)",
    )
    p.add_argument(
        "--shard-mib",
        type=int,
        default=None,
        help="global size of the row-sharded part of the 'sharded' case "
        "(default: --size-mib; 0 runs the replicated case only)",
    )
    p.add_argument("--layers", type=int, default=8, help="layers of the replicated model")
    p.add_argument(
        "--reps", type=int, default=1, help="sync saves per contestant/config (best kept)"
    )
    p.add_argument(
        "--async-calls",
        type=int,
        default=2,
        help="async saves per contestant (the first allocates; steady = later)",
    )
    p.add_argument(
        "--dcp-threads",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="FileSystemWriter thread_count values (best reported)",
    )
    p.add_argument(
        "--raw-threads",
        type=int,
        default=4,
        help="raw limit: also write/read each rank's share with this many threads "
        "and files (best of 1 and this reported)",
    )
    p.add_argument(
        "--ckpt-workers",
        type=int,
        default=8,
        help="ckptstore I/O threads per rank (library default 8)",
    )
    p.add_argument(
        "--shard-kind",
        choices=["shard", "dtensor"],
        default="shard",
        help="how ckptstore gets the sharded part: ckptstore.Shard (default) or the "
        "same DTensor Shard(0) objects DCP gets",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads per rank (torchrun's default OMP_NUM_THREADS=1)",
    )
    p.add_argument(
        "--proposed-fixes",
        action="store_true",
        help="experiment: run ckptstore with the fixes of bench/dist/proposed.py "
        "monkeypatched in (parallel folder fsync; the balanced plan is now built in)",
    )
    p.add_argument("--no-reshard", action="store_true", help="skip cross-world restores")
    p.add_argument(
        "--dtensor",
        action="store_true",
        help="run the DTensor resharding benchmark instead (bench/dist/dtensor.py): a 2x2 "
        "mesh FSDP+TP-like state saved on 4 ranks, restored on 2 and 4 with other placements",
    )
    p.add_argument("--dt-width", type=int, default=1024, help="--dtensor: model width")
    p.add_argument("--dt-hidden", type=int, default=2048, help="--dtensor: MLP hidden size")
    p.add_argument("--dt-layers", type=int, default=4, help="--dtensor: layers")
    p.add_argument("--dt-rounds", type=int, default=2, help="--dtensor: restores per phase")
    p.add_argument(
        "--tmp",
        default="",
        help="scratch folder (default: a new folder in /tmp); removed afterwards",
    )
    p.add_argument("--out", default="bench/results/dist.json", help="JSON file to write")
    p.add_argument("--markdown", default="", help="also write the table as markdown here")
    p.add_argument("--phase-timeout", type=float, default=1200, help="seconds per phase")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def loadavg() -> dict[str, Any]:
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    psi = {}
    for kind in ("cpu", "io", "memory"):  # pressure stall information: share of time waiting
        try:
            with open(f"/proc/pressure/{kind}") as f:
                psi[kind] = f.read().split("\n")[0]
        except OSError:
            pass
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg": list(os.getloadavg()),
        "uptime": up,
        "pressure_some": psi,
    }


def machine() -> dict[str, Any]:
    import torch

    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def run_phase(
    cfg: dict[str, Any], world: int, scratch: Path, tag: str, timeout: float
) -> dict[str, Any]:
    import torch.multiprocessing as mp
    from dist import worker

    out = scratch / f"out-{tag}"
    out.mkdir(parents=True)
    init = scratch / f"pg-{tag}"
    t0 = time.perf_counter()
    start = loadavg()
    ctx = mp.start_processes(
        worker.main,
        args=(world, str(init), json.dumps(cfg), str(out)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        while not ctx.join(timeout=2):
            if time.perf_counter() - t0 > timeout:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()  # our own children, by handle
                raise TimeoutError(f"phase {tag} took more than {timeout:.0f} s")
    except Exception:
        for r in range(world):
            f = out / f"status-{r}"
            if f.exists() and f.read_text() != "ok":
                print(f"--- rank {r} of phase {tag} failed:\n{f.read_text()}", file=sys.stderr)
        raise
    result = json.loads((out / "result.json").read_text())
    return {
        "result": result,
        "seconds": time.perf_counter() - t0,
        "load_start": start,
        "load_end": loadavg(),
    }


def run_dtensor(args: argparse.Namespace) -> int:
    from dist import dtensor

    scratch = Path(args.tmp or tempfile.mkdtemp(prefix="dt-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        res = dtensor.run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t0
    res["load_end"] = loadavg()
    res["command"] = "python " + " ".join(sys.argv)
    lines = dtensor.summary(res)
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dtensor:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
        return run_dtensor(args)
    shard_mib = args.size_mib if args.shard_mib is None else args.shard_mib
    worlds = list(dict.fromkeys(args.ranks))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))

    from dist import report
    from dist.state import Spec

    spec = Spec(args.size_mib, shard_mib, args.layers, tuple(worlds))
    cpus = os.cpu_count() or 1
    notes = []
    over = [w for w in worlds if w > cpus]
    if over:
        notes.append(
            f"{', '.join(map(str, over))} ranks on {cpus} cores oversubscribe the CPU "
            f"(each rank also runs {args.ckpt_workers} ckptstore I/O threads or DCP's "
            "thread_count writers, plus gloo): those numbers measure contention as much "
            "as the libraries."
        )
    notes.append(
        "Restores read from the page cache (checkpoints just written; caches are not "
        "dropped), for both contestants. ckptstore verifies every chunk's digest on "
        "restore; DCP does not verify."
    )
    notes.append(
        "Python's garbage collector is frozen after the imports and off during each "
        "measurement (a full collection of torch's ~260k objects takes ~0.5 s here and "
        "stalls every rank at the next collective), for both contestants."
    )
    if args.proposed_fixes:
        notes.insert(
            0,
            "EXPERIMENT: ckptstore ran with the fixes of bench/dist/proposed.py "
            "monkeypatched in; these are not the library's numbers.",
        )
    notes.append("Other jobs may share this machine: see the load averages in the JSON.")

    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-distbench-", dir=args.tmp or None))
    cfg_base = {
        "size_mib": args.size_mib,
        "shard_mib": shard_mib,
        "layers": args.layers,
        "worlds": worlds,
        "reps": args.reps,
        "async_calls": args.async_calls,
        "dcp_threads": args.dcp_threads,
        "ckpt_workers": args.ckpt_workers,
        "raw_threads": args.raw_threads,
        "shard_kind": args.shard_kind,
        "torch_threads": args.torch_threads,
        "proposed_fixes": args.proposed_fixes,
        "cases": ["replicated", "sharded"] if shard_mib else ["replicated"],
        "work": str(scratch / "work"),
        "keep": str(scratch / "keep"),
        "pg_timeout_s": int(args.phase_timeout),
        "verbose": not args.quiet,
    }
    disk = shutil.disk_usage(scratch)
    meta: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "machine": machine(),
        "scratch": str(scratch),
        "scratch_free_bytes": disk.free,
        "replicated_bytes": spec.replicated_bytes(),
        "shard_global_bytes": spec.shard_global_bytes(),
        "model_width": spec.d,
        "shard_rows": spec.shard_rows,
        "notes": notes,
        "load_start": loadavg(),
        "ckptstore_options": {
            "chunk_bytes": 16 << 20,
            "workers": args.ckpt_workers,
            "compression": None,
        },
    }
    print(
        f"scratch {scratch} ({disk.free / 2**30:.0f} GiB free); replicated "
        f"{spec.replicated_bytes() / 2**20:.0f} MiB, sharded part "
        f"{spec.shard_global_bytes() / 2**20:.0f} MiB; load {meta['load_start']['loadavg']}"
    )
    results: dict[str, Any] = {"meta": meta, "phases": [], "full": {}, "reshard": {}}
    t_all = time.perf_counter()
    try:
        for i, w in enumerate(worlds):
            srcs = [] if args.no_reshard else worlds[:i]
            print(
                f"phase full, {w} ranks" + (f", then restores of {srcs}" if srcs else ""),
                flush=True,
            )
            ph = run_phase(
                {**cfg_base, "phase": "full", "reshard_from": srcs},
                w,
                scratch,
                f"full-{w}",
                args.phase_timeout,
            )
            res = ph.pop("result")
            if "reshard" in res:
                results["reshard"][str(w)] = res.pop("reshard")
            results["full"][str(w)] = res
            results["phases"].append({"phase": "full", "world": w, "reshard_from": srcs, **ph})
        for i, w in enumerate(worlds):
            srcs = [] if args.no_reshard else worlds[i + 1 :]
            if not srcs:
                continue
            print(f"phase reshard, {w} ranks, restores of {srcs}", flush=True)
            ph = run_phase(
                {**cfg_base, "phase": "reshard", "reshard_from": srcs},
                w,
                scratch,
                f"reshard-{w}",
                args.phase_timeout,
            )
            res = ph.pop("result")
            results["reshard"].setdefault(str(w), {}).update(res["reshard"])
            results["phases"].append({"phase": "reshard", "world": w, "reshard_from": srcs, **ph})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta["load_end"] = loadavg()
    meta["total_seconds"] = time.perf_counter() - t_all
    results["rows"] = report.rows(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    report.print_table(results, notes)
    print(report.save_breakdown(results))
    print(
        f"load average: start {meta['load_start']['loadavg']}, end "
        f"{meta['load_end']['loadavg']}; total {meta['total_seconds']:.0f} s; wrote {out}"
    )
    if args.markdown:
        Path(args.markdown).write_text(report.markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
