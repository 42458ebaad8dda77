#!/usr/bin/env python
"""What an async checkpoint costs a CPU training loop (issue 13).

    python bench/async_step_bench.py                         # the docs/performance.md run
    python bench/async_step_bench.py --width 1024 --steps 30 # a quick one

A fixed-seed MLP (`--layers` square layers of `--width`, AdamW; checkpoint = weights + two
moments) trains on one thread (torch.set_num_threads(1)) and is checkpointed every `--every`
steps into a fresh local folder, once per mode, each mode in its own subprocess so that RSS is
clean:

* none      no checkpointing (the step time to compare with)
* copy      CheckpointManager(async_save=True, staging="copy")
* overlap   CheckpointManager(async_save=True, staging="overlap", max_host_bytes=256 MiB)
* dcp       torch.distributed.checkpoint.async_save (gloo group of world size 1)

Reported per mode: stall per save (the save call), mean and p95 step time while a save runs
in the background (guards waiting included) and otherwise, peak extra RSS (ru_maxrss growth
from after the warm-up steps to the end), time from the save call until the checkpoint is
durable (committed), and the total wall time of the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODES = ("none", "copy", "overlap", "dcp")
MiB = 1 << 20


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _p95(values: list[float]) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.LayerNorm(args.width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(args.batch, args.width, generator=gen) for _ in range(8)]

    def train_step(i: int) -> None:
        loss = model(data[i % len(data)]).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    for i in range(args.warmup):  # optimizer state allocated, allocator warm
        train_step(i)
    folder = Path(tempfile.mkdtemp(prefix=f"async-bench-{args.mode}-", dir=args.dir))
    rss0 = _maxrss()
    mode = args.mode
    mgr: Any = None
    dcp_future: Any = None
    if mode in ("copy", "overlap"):
        from ckptstore import CheckpointManager

        mgr = CheckpointManager(folder, async_save=True, staging=mode,
                                max_host_bytes=args.max_host_mib * MiB, workers=args.workers)
    elif mode == "dcp":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0,
                                world_size=1)
    stalls: list[float] = []
    durable: list[float] = []
    busy_steps: list[float] = []
    idle_steps: list[float] = []
    handles: list[Any] = []
    pending_dcp: list[tuple[Any, float]] = []
    done_at: dict[int, float] = {}
    t_loop = time.perf_counter()
    for step in range(1, args.steps + 1):
        if mode in ("copy", "overlap"):
            busy = bool(handles) and not handles[-1].done()
        elif mode == "dcp":
            busy = dcp_future is not None and not dcp_future.done()
        else:
            busy = False
        t0 = time.perf_counter()
        train_step(step)
        dt = time.perf_counter() - t0
        (busy_steps if busy else idle_steps).append(dt)
        if mode != "none" and step % args.every == 0:
            t1 = time.perf_counter()
            if mgr is not None:
                handles.append(mgr.save(step, {"model": model, "optim": opt}))
            else:
                if dcp_future is not None:
                    dcp_future.result()
                sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp_future = dcp.async_save(sd, checkpoint_id=str(folder / f"step-{step}"))
                key = len(pending_dcp)
                dcp_future.add_done_callback(
                    lambda _f, key=key: done_at.__setitem__(key, time.perf_counter()))
                pending_dcp.append((dcp_future, t1))
            stalls.append(time.perf_counter() - t1)
    if mgr is not None:
        mgr.wait()
        for h in handles:
            info = h.wait()
            durable.append(info.seconds)
        waits = [h.wait().guard_wait_seconds for h in handles]
        mgr.close()
    else:
        waits = []
        for key, (fut, t1) in enumerate(pending_dcp):
            fut.result()
            durable.append(done_at.get(key, time.perf_counter()) - t1)
    total = time.perf_counter() - t_loop
    rss1 = _maxrss()
    if mode == "dcp":
        import torch.distributed as dist

        dist.destroy_process_group()
    shutil.rmtree(folder, ignore_errors=True)
    ckpt_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"mode": mode, "checkpoint_bytes": ckpt_bytes, "saves": len(stalls),
            "stall_ms": [s * 1e3 for s in stalls],
            "busy_step_ms": [s * 1e3 for s in busy_steps],
            "idle_step_ms": [s * 1e3 for s in idle_steps],
            "durable_s": durable, "guard_wait_ms": [w * 1e3 for w in waits],
            "extra_rss_bytes": rss1 - rss0, "loop_s": total}


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    def mean(v: list[float]) -> float:
        return statistics.fmean(v) if v else float("nan")

    return {"mode": r["mode"], "stall_ms": mean(r["stall_ms"][1:] or r["stall_ms"]),
            "first_stall_ms": r["stall_ms"][0] if r["stall_ms"] else float("nan"),
            "busy_mean": mean(r["busy_step_ms"]), "busy_p95": _p95(r["busy_step_ms"]),
            "idle_mean": mean(r["idle_step_ms"]), "busy_n": len(r["busy_step_ms"]),
            "rss_mib": r["extra_rss_bytes"] / MiB, "durable_s": mean(r["durable_s"]),
            "guard_ms": mean(r["guard_wait_ms"]), "loop_s": r["loop_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-host-mib", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8, help="ckptstore save threads")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: $TMPDIR)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29531, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:  # child
        print(json.dumps(run_mode(args)))
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode, "--width", str(args.width),
               "--layers", str(args.layers), "--batch", str(args.batch),
               "--steps", str(args.steps), "--every", str(args.every),
               "--warmup", str(args.warmup), "--max-host-mib", str(args.max_host_mib),
               "--workers", str(args.workers),
               "--port", str(args.port)] + (["--dir", args.dir] if args.dir else [])
        env = dict(os.environ, PYTHONPATH=str(REPO))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"{mode}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not results:
        return
    size = results[0]["checkpoint_bytes"] / MiB
    print(f"checkpoint {size:.0f} MiB (weights + AdamW moments), {args.steps} steps, a save "
          f"every {args.every}, torch threads 1, {os.cpu_count()} cores")
    print("| mode | stall per save (first) | step during saves: mean / p95 (n) | step otherwise"
          " | guard wait per save | peak extra RSS | call -> durable | loop |")
    print("|---|---|---|---|---|---|---|---|")
    for r in map(summarize, results):
        print(f"| {r['mode']} | {r['stall_ms']:.1f} ms ({r['first_stall_ms']:.0f} ms) | "
              f"{r['busy_mean']:.0f} / {r['busy_p95']:.0f} ms ({r['busy_n']}) | "
              f"{r['idle_mean']:.0f} ms | {r['guard_ms']:.0f} ms | {r['rss_mib']:.0f} MiB | "
              f"{r['durable_s']:.2f} s | {r['loop_s']:.1f} s |")


if __name__ == "__main__":
    main()
