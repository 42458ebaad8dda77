#!/usr/bin/env python
"""Host memory and stall of one overlapped async save of a large state (issue 13 targets).

    python bench/async_budget_bench.py                      # 1 GiB and 4 GiB, both writers
    python bench/async_budget_bench.py --gib 1 --budget-mib 1024,256   # stall of a guard

Each case runs in a fresh subprocess: a state of `--gib` GiB (float32 tensors of 64 MiB,
random values) is saved once with `save_async(staging="overlap", max_host_bytes=budget)`
into a fresh local folder, after a warm-up save of the same state (which starts the writer
process when there is one and faults in the staging slots). The tensors are the parameters
of an optimizer (SGD, no gradients: its step changes nothing) that the save guards, as
CheckpointManager does; right after the call, `optimizer.step()` runs and waits until every
tensor is staged. Reported: the call, the guard's wait (their sum is the stall of a
guarded save), the growth of the trainer's peak RSS (ru_maxrss) from before the call to
after the commit, the writer process's private peak (VmHWM less the shared slots, already
in the trainer's RSS), their sum against the target `budget + 64 MiB`, and the time to
durable.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _writer_private_peak() -> int:
    total = 0
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != os.getpid() or \
                    b"writer_process" not in (entry / "cmdline").read_bytes():
                continue
            status = (entry / "status").read_text().splitlines()
        except (OSError, ValueError):
            continue
        kib = {line.split(":")[0]: int(line.split()[1]) for line in status
               if line.endswith("kB")}
        total += (kib.get("VmHWM", 0) - kib.get("RssShmem", 0)) * 1024
    return total


def run_case(gib: float, writer: str, budget: int, folder: str) -> dict[str, Any]:
    import torch

    from ckptstore import CheckpointStore

    torch.manual_seed(0)
    n = max(1, int(gib * 16))  # 64 MiB tensors
    state = {f"w{i}": torch.nn.Parameter(torch.rand(4096, 4096)) for i in range(n)}
    opt = torch.optim.SGD(list(state.values()), lr=0.0)
    repo = CheckpointStore(Path(folder) / "repo", async_writer=writer)
    repo.save_async("warm", state, staging="overlap", max_host_bytes=budget).wait()
    with torch.no_grad():
        for t in state.values():
            t.add_(1.0)  # new bytes: nothing is reused from the warm-up save
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    handle = repo.save_async("big", state, staging="overlap", max_host_bytes=budget)
    call = time.perf_counter() - t0
    handle.guard(opt)
    t1 = time.perf_counter()
    opt.step()  # waits until every tensor is staged
    guard = time.perf_counter() - t1
    info = handle.wait()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    writer_peak = _writer_private_peak()
    repo.close()
    return {"gib": gib, "writer": writer, "budget_mib": budget / MiB, "call_s": call,
            "guard_s": guard,
            "trainer_growth_mib": (after - before) / MiB,
            "writer_private_mib": writer_peak / MiB, "durable_s": info.seconds,
            "peak_extra_bytes_mib": info.peak_extra_bytes / MiB,
            "logical_mib": info.logical_bytes / MiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", default="1,4", help="state sizes in GiB, comma-separated")
    ap.add_argument("--writers", default="thread,process")
    ap.add_argument("--budget-mib", default="256", help="budgets in MiB, comma-separated")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        gib, writer = args.case.split(":")
        print(json.dumps(run_case(float(gib), writer, int(args.budget_mib) * MiB, args.dir)))
        return
    print(f"targets: extra RSS <= budget + 64 MiB; stall <= 0.2 s for 1 GiB; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("| state | budget | writer | stall: call + guard wait | trainer RSS growth "
          "| writer private peak | total extra | call -> durable |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [(g, b, w) for g in args.gib.split(",") for b in args.budget_mib.split(",")
             for w in args.writers.split(",")]
    for gib, budget, writer in cases:
        folder = tempfile.mkdtemp(prefix="async-budget-", dir=args.dir)
        try:
            out = subprocess.run(
                [sys.executable, __file__, "--case", f"{gib}:{writer}", "--budget-mib",
                 budget, "--dir", folder], capture_output=True, text=True,
                env=dict(os.environ, PYTHONPATH=str(REPO)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if out.returncode != 0:
            print(f"{gib} GiB {budget} MiB {writer}: failed: {out.stderr.strip()[-400:]}",
                  file=sys.stderr)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        total = r["trainer_growth_mib"] + r["writer_private_mib"]
        stall = (r["call_s"] + r["guard_s"]) * 1e3
        print(f"| {r['logical_mib'] / 1024:.0f} GiB | {budget} MiB | {writer} | "
              f"{stall:.0f} ms = {r['call_s'] * 1e3:.0f} + {r['guard_s'] * 1e3:.0f} | "
              f"{r['trainer_growth_mib']:.0f} MiB | {r['writer_private_mib']:.0f} MiB | "
              f"{total:.0f} MiB (<= {int(budget) + 64}) | {r['durable_s']:.2f} s |")


if __name__ == "__main__":
    main()
