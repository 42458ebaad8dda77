#!/usr/bin/env python
"""What an async checkpoint costs a CPU training loop (issue 13).

    python bench/async_step_bench.py --layers 10            # the docs/performance.md run
    python bench/async_step_bench.py --quick                # one short round: a sanity run
    python bench/async_step_bench.py --modes none,overlap:thread,overlap:process,dcp --rounds 5

A fixed-seed MLP (`--layers` square layers of `--width`, AdamW; checkpoint = weights + two
moments) trains on one thread (torch.set_num_threads(1): the other core is the
checkpointer's) and is checkpointed every `--every` steps into a fresh local folder. Each
(round, mode) runs in its own subprocess so that RSS is clean, and the modes alternate within
every round so that a burst of load from elsewhere hits one round, not one mode:

* none             no checkpointing: the step time every other mode is compared with
* copy             CheckpointManager(async_save=True, staging="copy")
* overlap          the same with staging="overlap", max_host_bytes=--max-host-mib (written
                   by a writer process: the default for local folders)
* <mode>:thread    ... with async_writer="thread" (blobs written by a thread of the trainer)
* <mode>:process   ... with async_writer="process" (written by a writer process from the
                   shared staging slots; overlap only)
* <mode>@N         ... with max_host_bytes = N MiB (e.g. overlap:process@512)
* <mode>+buffered  ... the writer process writes every blob buffered, not with O_DIRECT
                   (what it did before O_DIRECT: an A/B within one process)
* <mode>+ioN, +wN  ... with background_io = N, background_workers = N (e.g. copy+w8+io0,
                   what every async save did before issue 13)
* dcp              torch.distributed.checkpoint.async_save (gloo group of world size 1)

Per mode (median over rounds, spread = min..max over rounds): the stall per save, i.e. the
save call plus the time the next `optimizer.step()` waited for the save's guard; the
step-time inflation while a save runs in the background, mean and p95, as the step time
(guard waits excluded: they are in the stall) over the mean step of the round's `none`
run, minus one, and the mean over the mean of the same run's steps without a save running
(interleaved in time with the busy ones, so less exposed to load from elsewhere); peak
extra RSS (ru_maxrss growth from after the warm-up to the end, plus the writer process's
peak RSS less the shared slots already counted); the time from the call until the
checkpoint is durable (committed); the CPU time of the save per save (the process's and
its writer's, less the training thread's, less the same for the `none` run). Two figures
resist load from elsewhere (a shared machine): the training thread's CPU time per step
while a save runs over its CPU time per step otherwise (what the save's memory traffic
costs the step; waits are not in it), and the save's CPU time.
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
MODES = ("none", "copy", "overlap", "overlap:thread", "dcp")
MiB = 1 << 20


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _writer_private_peak() -> int:
    """Peak RSS of this process's writer processes, less the shared staging slots they map
    (already counted in this process's RSS): /proc/<pid>/status VmHWM - RssShmem."""
    total = 0
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != os.getpid() or \
                    b"writer_process" not in (entry / "cmdline").read_bytes():
                continue
            status = dict(line.split(":", 1) for line in
                          (entry / "status").read_text().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue
        kib = {k: int(v.split()[0]) for k, v in status.items() if v.strip().endswith("kB")}
        total += (kib.get("VmHWM", 0) - kib.get("RssShmem", 0)) * 1024
    return total


def _cpu_seconds(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _p95(values: list[float]) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _trainer(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, optimizer, train_step) of the fixed-seed MLP, warmed up."""
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
    return model, opt, train_step


def _manager(spec: str, args: argparse.Namespace, folder: Path) -> Any:
    """The CheckpointManager of a ckptstore mode ("overlap:process@512+io4"), warmed up."""
    import torch

    from ckptstore import CheckpointManager

    spec, *tweaks = spec.split("+")
    spec, _, budget = spec.partition("@")
    mode, _, writer = spec.partition(":")
    options: dict[str, Any] = {"staging": mode,
                               "max_host_bytes": int(budget or args.max_host_mib) * MiB}
    if writer:
        options["async_writer"] = writer
    if args.workers:
        options["workers"] = args.workers
    buffered = "buffered" in tweaks
    for tweak in tweaks:  # +io4: background_io=4, +w2: background_workers=2
        if tweak != "buffered":
            name = "background_io" if tweak.startswith("io") else "background_workers"
            options[name] = int(tweak.lstrip("iow"))
    mgr = CheckpointManager(folder, async_save=True, **options)
    # a first tiny save starts what a save needs once (the writer process, if any)
    if buffered:  # bench-only: the pool's writer process is started with direct=False
        import functools
        from unittest import mock

        from ckptstore.pipeline import overlap, writer_process
        with mock.patch.object(overlap, "WriterProcess", functools.partial(
                writer_process.WriterProcess, direct=False)):
            mgr.repo.save_async("warm", {"x": torch.ones(1)}, staging="overlap",
                                max_host_bytes=options["max_host_bytes"]).wait()
        sink = mgr.repo._pool.sink if mgr.repo._pool is not None else None
        assert sink is not None and not sink.direct, "+buffered needs a writer process"
    else:
        mgr.repo.save_async("warm", {"x": torch.ones(1)}).wait()
    return mgr


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    model, opt, train_step = _trainer(args)
    folder = Path(tempfile.mkdtemp(prefix="async-bench-", dir=args.dir))
    mode = args.mode.split("+")[0].partition("@")[0].partition(":")[0]
    mgr: Any = None
    if mode in ("copy", "overlap"):
        mgr = _manager(args.mode, args, folder)
    elif mode == "dcp":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0,
                                world_size=1)
    rss0 = _maxrss()
    cpu0 = _cpu_seconds(resource.RUSAGE_SELF)
    calls: list[float] = []
    busy_steps: list[float] = []  # guard waits excluded
    idle_steps: list[float] = []
    busy_cpu: list[float] = []  # CPU time of the training thread per step (no waits in it)
    idle_cpu: list[float] = []
    handles: list[Any] = []
    first_busy: list[int] = []  # index in busy_steps of the first step after each save
    dcp_future: Any = None
    pending_dcp: list[tuple[Any, float]] = []
    done_at: dict[int, float] = {}
    t_loop = time.perf_counter()
    for step in range(1, args.steps + 1):
        if mgr is not None:
            busy = bool(handles) and not handles[-1].done()
        else:
            busy = dcp_future is not None and not dcp_future.done()
        t0, c0 = time.perf_counter(), time.thread_time()
        train_step(step)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        (busy_steps if busy else idle_steps).append(dt)
        (busy_cpu if busy else idle_cpu).append(dc)
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
            calls.append(time.perf_counter() - t1)
            first_busy.append(len(busy_steps))
    durable: list[float] = []
    waits: list[float] = []
    writer_rss = 0
    if mgr is not None:
        mgr.wait()
        infos = [h.wait() for h in handles]
        durable = [i.seconds for i in infos]
        waits = [i.guard_wait_seconds for i in infos]
        writer_rss = _writer_private_peak()
        mgr.close()
    else:
        for key, (fut, t1) in enumerate(pending_dcp):
            fut.result()
            durable.append(done_at.get(key, time.perf_counter()) - t1)
    total = time.perf_counter() - t_loop
    cpu = _cpu_seconds(resource.RUSAGE_SELF) - cpu0 + _cpu_seconds(resource.RUSAGE_CHILDREN)
    # (the writer process's CPU time counts once it has exited: mgr.close() above)
    rss1 = _maxrss()
    # a guard waits in the first step after its save (that step's optimizer.step() runs only
    # once every tensor it changes is staged): the wait is the save's stall, not the step's
    for index, wait in zip(first_busy, waits):
        if index < len(busy_steps):
            busy_steps[index] -= wait
    if mode == "dcp":
        import torch.distributed as dist

        dist.destroy_process_group()
    shutil.rmtree(folder, ignore_errors=True)
    ckpt_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"mode": args.mode, "checkpoint_bytes": ckpt_bytes, "saves": len(calls),
            "call_ms": [s * 1e3 for s in calls], "guard_wait_ms": [w * 1e3 for w in waits],
            "busy_step_ms": [s * 1e3 for s in busy_steps],
            "idle_step_ms": [s * 1e3 for s in idle_steps],
            "durable_s": durable, "extra_rss_bytes": rss1 - rss0,
            "writer_rss_bytes": writer_rss, "loop_s": total, "cpu_s": cpu,
            "busy_cpu_ms": [c * 1e3 for c in busy_cpu],
            "idle_cpu_ms": [c * 1e3 for c in idle_cpu],
            "train_cpu_s": sum(busy_cpu) + sum(idle_cpu)}


def run_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode in one process, taking turns: per cycle, each mode (in a rotated order)
    saves once and trains `--every` steps (longer if its save is still running); `none`
    only trains. Load from elsewhere then falls on every mode alike, at a granularity of
    seconds. Returns per mode: call, guard wait, durable times, busy steps (guard waits
    excluded) and the `none` blocks' steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model, opt, train_step = _trainer(args)
    root = Path(tempfile.mkdtemp(prefix="async-bench-", dir=args.dir))
    modes = args.modes.split(",")
    managers = {m: _manager(m, args, root / f"m{i}") for i, m in enumerate(modes)
                if m.split(":")[0].split("@")[0].split("+")[0] in ("copy", "overlap")}
    if "dcp" in modes:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0,
                                world_size=1)
    out: dict[str, dict[str, list[float]]] = {
        m: {"call_ms": [], "guard_wait_ms": [], "durable_s": [], "busy_step_ms": [],
            "idle_step_ms": []} for m in modes}
    step = 0
    for cycle in range(args.cycles):
        order = modes[cycle % len(modes):] + modes[: cycle % len(modes)]
        for mode in order:
            rec = out[mode]
            handle: Any = None
            t1 = time.perf_counter()
            if mode in managers:
                handle = managers[mode].save(step, {"model": model, "optim": opt})
            elif mode == "dcp":
                sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                handle = dcp.async_save(sd, checkpoint_id=str(root / f"dcp-{step}"))
            if handle is not None:
                rec["call_ms"].append((time.perf_counter() - t1) * 1e3)
            first = len(rec["busy_step_ms"])
            done_at = None
            n = 0
            while n < args.every or (handle is not None and not handle.done()):
                busy = handle is not None and not handle.done()
                if handle is not None and not busy and done_at is None:
                    done_at = time.perf_counter()
                t0 = time.perf_counter()
                train_step(step)
                dt = (time.perf_counter() - t0) * 1e3
                (rec["busy_step_ms"] if busy else rec["idle_step_ms"]).append(dt)
                step += 1
                n += 1
            if handle is None:
                continue
            if mode in managers:
                info = handle.wait()
                rec["durable_s"].append(info.seconds)
                rec["guard_wait_ms"].append(info.guard_wait_seconds * 1e3)
                if first < len(rec["busy_step_ms"]):
                    rec["busy_step_ms"][first] -= info.guard_wait_seconds * 1e3
            else:
                handle.result()
                rec["durable_s"].append((done_at or time.perf_counter()) - t1)
    for mgr in managers.values():
        mgr.close()
    if "dcp" in modes:
        dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    ckpt_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"checkpoint_bytes": ckpt_bytes, "modes": out}


def interleaved_table(rounds: list[dict[str, Any]], modes: list[str]) -> None:
    """Print the table of --interleave runs: inflation against the `none` blocks of the same
    process, median (min..max) over rounds."""
    def cell(values: list[float], fmt: str) -> str:
        vals = [v for v in values if v == v]
        if not vals:
            return "-"
        med = statistics.median(vals)
        return format(med, fmt) if len(vals) == 1 else \
            f"{format(med, fmt)} ({format(min(vals), fmt)}..{format(max(vals), fmt)})"

    print("| mode | stall: call + guard wait | inflation mean | inflation p95 | busy steps "
          "| extra step time per save | call -> durable |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        if mode == "none":
            base = [_mean(r["modes"]["none"]["idle_step_ms"]) for r in rounds]
            print(f"| none | - | {cell(base, '.0f')} ms per step | - | - | - | - |")
            continue
        figs = []
        for r in rounds:
            rec, base = r["modes"][mode], _mean(r["modes"]["none"]["idle_step_ms"])
            waits = rec["guard_wait_ms"] or [0.0] * len(rec["call_ms"])
            figs.append({"stall": _mean([c + w for c, w in zip(rec["call_ms"], waits)]),
                         "call": _mean(rec["call_ms"]), "guard": _mean(waits),
                         "mean": _mean(rec["busy_step_ms"]) / base - 1,
                         "p95": _p95(rec["busy_step_ms"]) / base - 1,
                         "n": len(rec["busy_step_ms"]), "durable": _mean(rec["durable_s"]),
                         # what a save costs the steps beside it in all (its stall apart)
                         "extra": sum(b - base for b in rec["busy_step_ms"])
                         / max(1, len(rec["call_ms"]))})

        def col(name: str, fmt: str, figs: list[dict[str, float]] = figs) -> str:
            return cell([f[name] for f in figs], fmt)

        print(f"| {mode} | {col('stall', '.0f')} ms = {col('call', '.0f')} + "
              f"{col('guard', '.0f')} | {col('mean', '+.0%')} | {col('p95', '+.0%')} | "
              f"{col('n', '.0f')} | {col('extra', '.0f')} ms | {col('durable', '.2f')} s |")


def round_figures(r: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """One run's figures; inflation is relative to the round's `none` mean step, and the
    CPU time of a save is the run's CPU time beyond the `none` run's, per save."""
    base_step_ms = _mean(base["idle_step_ms"])
    saves = max(1, len(r["call_ms"]))
    waits = r["guard_wait_ms"] or [0.0] * len(r["call_ms"])
    stalls = [c + w for c, w in zip(r["call_ms"], waits)]
    busy = r["busy_step_ms"]
    return {"stall_ms": _mean(stalls[1:] or stalls), "call_ms": _mean(r["call_ms"][1:]
                                                                        or r["call_ms"]),
            "guard_ms": _mean(waits[1:] or waits),
            "infl_mean": _mean(busy) / base_step_ms - 1 if busy else float("nan"),
            "infl_p95": _p95(busy) / base_step_ms - 1 if busy else float("nan"),
            "infl_own": _mean(busy) / _mean(r["idle_step_ms"]) - 1
            if busy and r["idle_step_ms"] else float("nan"),
            "busy_n": len(busy), "step_ms": _mean(r["idle_step_ms"] + busy),
            "rss_mib": r["extra_rss_bytes"] / MiB, "writer_rss_mib": r["writer_rss_bytes"] / MiB,
            "durable_s": _mean(r["durable_s"]), "loop_s": r["loop_s"],
            "step_cpu_own": _mean(r["busy_cpu_ms"]) / _mean(r["idle_cpu_ms"]) - 1
            if r["busy_cpu_ms"] and r["idle_cpu_ms"] else float("nan"),
            "cpu_per_save_s": ((r["cpu_s"] - r["train_cpu_s"])
                               - (base["cpu_s"] - base["train_cpu_s"])) / saves}


def _child(args: argparse.Namespace, mode: str) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--mode", mode, "--width", str(args.width),
           "--layers", str(args.layers), "--batch", str(args.batch),
           "--steps", str(args.steps), "--every", str(args.every),
           "--warmup", str(args.warmup), "--max-host-mib", str(args.max_host_mib),
           "--workers", str(args.workers), "--modes", args.modes, "--cycles", str(args.cycles),
           "--port", str(args.port)] + (["--dir", args.dir] if args.dir else [])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"{mode}: failed: {out.stderr.strip().splitlines()[-3:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _cell(values: list[float], fmt: str, scale: float = 1.0) -> str:
    """median (min..max) of one figure over the rounds."""
    vals = [v * scale for v in values if v == v]
    if not vals:
        return "-"
    med = statistics.median(vals)
    if len(vals) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(vals), fmt)}..{format(max(vals), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="each mode once per round")
    ap.add_argument("--quick", action="store_true",
                    help="one round of 30 steps, a save every 10: a sanity run")
    ap.add_argument("--max-host-mib", type=int, default=256)
    ap.add_argument("--workers", type=int, default=0,
                    help="ckptstore save threads (0: the library's default)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: $TMPDIR)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--interleave", action="store_true",
                    help="every mode in one process per round, taking turns (no RSS)")
    ap.add_argument("--cycles", type=int, default=6, help="--interleave: saves per mode")
    ap.add_argument("--table", default=None,
                    help="print the table of an --interleave run's --json file, and exit")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29531, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        rounds = json.loads(Path(args.table).read_text())
        interleaved_table(rounds, list(rounds[0]["modes"]))
        return
    if args.mode == "interleaved":  # child
        print(json.dumps(run_interleaved(args)))
        return
    if args.mode:  # child
        print(json.dumps(run_mode(args)))
        return
    if args.quick:
        args.rounds, args.steps, args.cycles = 1, 30, 3
    modes = args.modes.split(",")
    if "none" not in modes:
        modes.insert(0, "none")
    if args.interleave:
        args.modes = ",".join(modes)
        rounds = []
        for rnd in range(args.rounds):
            r = _child(args, "interleaved")
            if r is not None:
                rounds.append(r)
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(rounds, indent=1))
        if rounds:
            print(f"checkpoint {rounds[0]['checkpoint_bytes'] / MiB:.0f} MiB, modes taking "
                  f"turns in one process, {args.cycles} saves each per round, a save every "
                  f"{args.every} steps, budget {args.max_host_mib} MiB, {os.cpu_count()} "
                  f"cores, {len(rounds)} round(s), load average at the end "
                  f"{os.getloadavg()[0]:.1f}; median (min..max) over rounds")
            interleaved_table(rounds, modes)
        return
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    figures: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        results = {}
        for mode in modes:
            r = _child(args, mode)
            if r is not None:
                results[mode] = r
                runs[mode].append(r)
        if "none" not in results:
            continue
        for mode, r in results.items():
            figures[mode].append(round_figures(r, results["none"]))
        print(f"round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    some = next((rs[0] for rs in runs.values() if rs), None)
    if some is None:
        return
    load = os.getloadavg()[0]
    print(f"checkpoint {some['checkpoint_bytes'] / MiB:.0f} MiB (weights + AdamW moments), "
          f"{args.steps} steps, a save every {args.every}, budget {args.max_host_mib} MiB, "
          f"torch threads 1, {os.cpu_count()} cores, {args.rounds} round(s), "
          f"load average at the end {load:.1f}; median (min..max) over rounds")
    print("| mode | step | stall: call + guard wait | inflation mean | inflation p95 "
          "| inflation vs own idle steps | step CPU vs own idle steps | busy steps "
          "| peak extra RSS | call -> durable | save CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        f = figures[mode]
        if not f:
            continue

        def col(name: str, fmt: str, scale: float = 1.0, f: list[dict[str, float]] = f) -> str:
            return _cell([x[name] for x in f], fmt, scale)

        if mode == "none":
            print(f"| none | {col('step_ms', '.0f')} ms | - | - | - | - | - | - | "
                  f"{col('rss_mib', '.0f')} MiB | - | - |")
            continue
        writer = (f" + {col('writer_rss_mib', '.0f')} MiB writer"
                  if any(x["writer_rss_mib"] for x in f) else "")
        print(f"| {mode} | {col('step_ms', '.0f')} ms | {col('stall_ms', '.0f')} ms = "
              f"{col('call_ms', '.0f')} + {col('guard_ms', '.0f')} | "
              f"{col('infl_mean', '+.0%')} | {col('infl_p95', '+.0%')} | "
              f"{col('infl_own', '+.0%')} | {col('step_cpu_own', '+.0%')} | "
              f"{col('busy_n', '.0f')} | {col('rss_mib', '.0f')} MiB{writer} | "
              f"{col('durable_s', '.2f')} s | {col('cpu_per_save_s', '.2f')} s |")


if __name__ == "__main__":
    main()
