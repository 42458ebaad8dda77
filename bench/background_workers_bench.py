#!/usr/bin/env python
"""Time to durable of `save_async` by the number of background threads (issue 13).

    python bench/background_workers_bench.py --state 1g --settings 1/0,1/4,8/0 --reps 5

A save that runs beside training works on `background_workers` threads at once (default 1,
so that it takes one core from the training step) while up to `background_io` more wait in
writes (default 4); before issue 13 it ran 8 threads, all working (8/0 below). This
measures what that costs when nothing else runs: the same state (bench/ckpt/states.py) is
saved with save_async, staging "copy" and "overlap", alternating the settings within each
repetition (load from elsewhere then hits every setting alike). Reported: median (min..max)
of the call (blocked) and of call -> durable, and the process CPU time per save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", default="1g", help="1g, 4g, small20k or bf16")
    ap.add_argument("--settings", default="1/0,1/4,8/0",
                    help="background_workers/background_io pairs")
    ap.add_argument("--stagings", default="copy,overlap")
    ap.add_argument("--writers", default="thread", help="async_writer values")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="states scaled down 8x, 2 reps")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if args.quick:
        args.reps = 2

    from ckpt import states

    from ckptstore import CheckpointStore

    spec = states.specs(args.quick)[args.state]
    state = states.build(spec, args.quick)
    size = states.nbytes(state)
    pairs = [tuple(int(x) for x in p.split("/")) for p in args.settings.split(",")]
    settings = [(s, w, io, wr) for s in args.stagings.split(",") for w, io in pairs
                for wr in args.writers.split(",") if not (wr == "process" and s == "copy")]
    figures: dict[tuple[str, int, int, str], list[tuple[float, float, float]]] = {
        k: [] for k in settings}
    root = Path(tempfile.mkdtemp(prefix="bg-workers-", dir=args.dir))
    try:
        repos = {k: CheckpointStore(root / "-".join(map(str, k)), background_workers=k[1],
                                    background_io=k[2], async_writer=k[3]) for k in settings}
        for rep in range(args.reps + 1):  # the first repetition warms up (not counted)
            states.touch(state)  # new bytes: nothing is reused from the previous save
            for key in settings:
                staging = key[0]
                os.sync()
                cpu0 = time.process_time()
                t0 = time.perf_counter()
                handle = repos[key].save_async(f"s{rep}", state, staging=staging)
                blocked = time.perf_counter() - t0
                handle.wait()
                total = time.perf_counter() - t0
                cpu = time.process_time() - cpu0
                if rep:
                    figures[key].append((blocked, total, cpu))
        for repo in repos.values():
            repo.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def cell(values: list[float], fmt: str) -> str:
        return (f"{format(statistics.median(values), fmt)} "
                f"({format(min(values), fmt)}..{format(max(values), fmt)})")

    print(f"state {args.state}: {size / 2**30:.2f} GiB, {len(state)} tensors, {args.reps} "
          f"reps, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("| staging | writer | background workers / io | call (blocked) s | call -> durable s "
          "| GB/s | CPU per save s (this process) |")
    print("|---|---|---|---|---|---|---|")
    for key in settings:
        blocked, total, cpu = zip(*figures[key])
        print(f"| {key[0]} | {key[3]} | {key[1]} / {key[2]} | {cell(list(blocked), '.3f')} | "
              f"{cell(list(total), '.2f')} | {size / statistics.median(total) / 1e9:.2f} | "
              f"{cell(list(cpu), '.2f')} |")


if __name__ == "__main__":
    main()
