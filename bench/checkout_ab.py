"""Same benchmark, two checkouts, alternated in one run: does a refactor cost time?

    git worktree add /tmp/before <rev>
    python bench/checkout_ab.py /tmp/before . --reps 5

Each repetition runs every case once per checkout, each in its own fresh subprocess (so one
checkout's warm caches or heap never help the other), alternating which checkout goes first.
The cases are the everyday calls: a synchronous save and a verified restore of the ~1 GiB fp32
transformer state and of the 20,000-small-tensor state (bench/ckpt/states.py) into a local
folder, and an overlapped ``save_async`` of the 1 GiB state (time until ``wait()`` returns).
Prints one table of medians and the ratio second/first; ``--out`` writes every time as JSON.
Compare only inside one run: the disk and the other load on the machine change between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CASES = ("save-1g", "restore-1g", "save_async-1g", "save-small20k", "restore-small20k")

_CHILD = r"""
import json, shutil, sys, tempfile, time
root, case, bench = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path[:0] = [root, bench]
from ckpt import states
import ckptstore
what, size = case.rsplit("-", 1)
state = states.build(states.specs(False)[size])
folder = tempfile.mkdtemp(dir=sys.argv[4])
try:
    repo = ckptstore.CheckpointStore(folder)
    if what == "restore":
        repo.save("a", state)
        t0 = time.perf_counter(); repo.load("a"); seconds = time.perf_counter() - t0
    elif what == "save_async":
        t0 = time.perf_counter()
        repo.save_async("a", state, staging="overlap").wait()
        seconds = time.perf_counter() - t0
    else:
        t0 = time.perf_counter(); repo.save("a", state); seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "version": ckptstore.__file__}))
finally:
    shutil.rmtree(folder, ignore_errors=True)
"""


def run_case(checkout: str, case: str, tmp: str) -> float:
    """Seconds of one case in a fresh interpreter that imports ckptstore from `checkout`."""
    bench = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=checkout)
    done = subprocess.run([sys.executable, "-c", _CHILD, checkout, case, bench, tmp],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{case} on {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["version"].startswith(str(Path(checkout).resolve())):
        raise SystemExit(f"{checkout}: imported ckptstore from {result['version']} instead")
    return float(result["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", help="checkout A (e.g. the revision before the change)")
    parser.add_argument("second", help="checkout B (e.g. this working tree)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--tmp", default=None, help="folder for the stores (default: TMPDIR)")
    parser.add_argument("--out", default=None, help="JSON file for every time")
    args = parser.parse_args()
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    checkouts = [str(Path(args.first).resolve()), str(Path(args.second).resolve())]
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    tmp = args.tmp or os.environ.get("TMPDIR", "/tmp")
    times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in checkouts} for c in cases}
    with Progress() as progress:
        task = progress.add_task("alternating checkouts", total=args.reps * len(cases) * 2)
        for rep in range(args.reps):
            order = checkouts if rep % 2 == 0 else checkouts[::-1]
            for case in cases:
                for checkout in order:
                    times[case][checkout].append(run_case(checkout, case, tmp))
                    progress.advance(task)
    table = Table(title=f"median of {args.reps} (seconds); ratio = second / first")
    for column in ("case", args.first, args.second, "ratio"):
        table.add_column(column, justify="right")
    for case in cases:
        a, b = (statistics.median(times[case][k]) for k in checkouts)
        table.add_row(case, f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}")
    Console().print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"checkouts": checkouts, "times": times}, indent=1))


if __name__ == "__main__":
    main()
