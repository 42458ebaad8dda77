#!/usr/bin/env python
"""The scale benchmark of issue 26: what ckptstore's costs do as tensors, checkpoints and ranks
grow, against the issue's targets, in one run.

    python bench/scale_bench.py                                  # every part (~10 min here,
                                                # and ~13 min more for peers at load 5)
    python bench/scale_bench.py --quick                          # small sizes, 1 rep (~1 min)
    python bench/scale_bench.py --parts manifest,keys --sizes 1000,20000
    python bench/scale_bench.py --parts peers --peers-sizes 20000   # ckptstore vs DCP, TC
    python bench/scale_bench.py --source /tmp/ckpt-main          # measure another checkout
    python bench/scale_bench.py --parts incremental,ls --ls-also after=/tmp/ckpt-after
                                 # ls, du, gc, list() with two checkouts, alternated
    python bench/scale_bench.py --report bench/results/scale.json   # tables of a saved run

Parts (`--parts`, comma-separated; default all), each in fresh subprocesses (bench/scale/):

    manifest     manifest bytes, parse time and memory, read + plan of a partial restore,
                 load(keys=[one]) in-process and from a fresh process (--sizes tensors)
    keys         load(keys=[K]) for K = 1 .. 10,000 against load() (--keys-tensors)
    incremental  incremental saves (10% changed) from restarted processes vs a full save
    small        1 KiB tensors: save and restore against the raw write / read limit
    ls           ckpt ls / du / gc --dry-run and list() / latest() over the incremental
                 part's repository (--history-count checkpoints of --history-tensors)
    many         a save's cost in a repository of 10 vs 500 checkpoints (--many-counts)
    collective   collective saves of a 7B FSDP-style state simulated for --ranks, by the
                 general protocol and by rank plans (one run: before and after), 70B with
                 Adam by rank plans at the largest, and a real 4-rank gloo save beside its
                 simulation
    peers        ckptstore vs DCP vs torch_checkpointing on the same states (MoE with Adam at
                 --peers-sizes tensors, --small-tensors 1 KiB tensors): full save, full load
                 into the same structure, one tensor from a fresh process, metadata bytes;
                 ratios ckptstore / peer (--peers picks the contestants)

Prints progress as it goes, then rich tables and the targets (met / missed), and writes every
raw number to --out (JSON) and the tables to <out>.md. `--source DIR` puts DIR first on the
children's PYTHONPATH (a `git archive` of a commit: the tree measured; the bench's own modules
always come from this checkout). docs/performance-scale.md explains the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import collective, history, keys, manifest, many, peers, report, small  # noqa: E402
from scale.common import (  # noqa: E402
    REPO,
    Ctx,
    imported_from,
    load_snapshot,
    machine_facts,
    worker_main,
)

PARTS = ("manifest", "keys", "incremental", "small", "ls", "many", "collective", "peers")
DEFAULT_OUT = REPO / "bench" / "results" / "scale.json"


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _labelled(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError("expected LABEL=DIR")
    return label, Path(path).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts (default all: {','.join(PARTS)})")
    p.add_argument("--sizes", type=_ints, default=[1000, 20000, 200000],
                   help="tensor counts of the manifest part (default 1000,20000,200000)")
    p.add_argument("--shapes", default="moe",
                   help="states of the manifest part: moe, small or both (default moe)")
    p.add_argument("--keys-tensors", type=int, default=50000,
                   help="tensors of the keys part's checkpoint (default 50000)")
    p.add_argument("--history-tensors", type=int, default=200000,
                   help="tensors per checkpoint of the incremental and ls parts (200000)")
    p.add_argument("--history-count", type=int, default=5,
                   help="checkpoints of the incremental and ls parts (default 5)")
    p.add_argument("--small-tensors", type=int, default=50000,
                   help="1 KiB tensors of the small part (default 50000)")
    p.add_argument("--many-counts", type=_ints, default=[10, 500],
                   help="checkpoints in the repository, many part (default 10,500)")
    p.add_argument("--ranks", type=_ints, default=[8, 64, 512, 4096],
                   help="simulated world sizes of the collective part (default 8,64,512,4096)")
    p.add_argument("--peers-sizes", type=_ints, default=[20000, 200000],
                   help="MoE tensor counts of the peers part (default 20000,200000)")
    p.add_argument("--peers", default=",".join(peers.CONTESTANTS),
                   help="contestants of the peers part (default all: "
                        f"{','.join(peers.CONTESTANTS)})")
    p.add_argument("--reps", type=int, default=2, help="repetitions, best reported (2)")
    p.add_argument("--ls-reps", type=int, default=1,
                   help="repetitions of each command of the ls part (default 1: each takes "
                        "tens of seconds at 200k tensors on main)")
    p.add_argument("--ls-also", type=_labelled, action="append", default=[],
                   metavar="LABEL=DIR",
                   help="ls part: also run every command with the checkout DIR, alternated "
                        "with --source's over the same repository (repeatable)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and 1 repetition: a check that every part runs")
    p.add_argument("--profile", action="store_true",
                   help="also cProfile / tracemalloc the biggest case of some parts")
    p.add_argument("--source", type=Path, default=None,
                   help="a ckptstore checkout to measure (put first on PYTHONPATH)")
    p.add_argument("--scratch", type=Path, default=None,
                   help="folder for the repositories (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results ({DEFAULT_OUT})")
    p.add_argument("--report", type=Path, default=None,
                   help="print the tables of a saved results file and exit")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    args.peers = [x for x in args.peers.split(",") if x]
    unknown = [x for x in args.peers if x not in peers.CONTESTANTS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {', '.join(peers.CONTESTANTS)}")
    if args.quick:
        args.reps = 1
        args.sizes = [1000, 5000]
        args.keys_tensors = 5000
        args.history_tensors = 5000
        args.history_count = 3
        args.small_tensors = 5000
        args.many_counts = [10, 50]
        args.ranks = [8, 64]
        args.peers_sizes = [1000, 5000]
    args.ls_reps = min(args.ls_reps, args.reps)
    return args


def run_parts(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    wanted = [p for p in PARTS if p in args.parts]
    hist: history.History | None = None
    for index, part in enumerate(wanted, start=1):
        ctx.note(f"--- part {index}/{len(wanted)}: {part}")
        t0 = time.perf_counter()
        if part == "manifest":
            shapes = ["moe", "small"] if args.shapes == "both" else [args.shapes]
            parts[part] = manifest.run(ctx, args.sizes, shapes)
        elif part == "keys":
            parts[part] = keys.run(ctx, args.keys_tensors)
        elif part in ("incremental", "ls"):
            if hist is None:
                hist = history.build_history(ctx, args.history_tensors, args.history_count)
            others = {label: dataclasses.replace(ctx, env=dict(ctx.env, PYTHONPATH=str(path)))
                      for label, path in args.ls_also}
            parts[part] = (history.run_incremental(ctx, hist) if part == "incremental"
                           else history.run_ls(ctx, hist, args.ls_reps, others))
        elif part == "small":
            parts[part] = small.run(ctx, args.small_tensors)
        elif part == "many":
            parts[part] = many.run(ctx, args.many_counts)
        elif part == "collective":
            parts[part] = collective.run(ctx, args.ranks)
        elif part == "peers":
            parts[part] = peers.run(ctx, args.peers_sizes, args.small_tensors, args.peers)
        seconds[part] = time.perf_counter() - t0
        ctx.note(f"    {part} done in {seconds[part]:.0f} s")
    return {"parts": parts, "part_seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker)
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    if args.report is not None:
        report.render(json.loads(args.report.read_text()), console)
        return 0
    start = time.perf_counter()

    def note(message: str) -> None:
        elapsed = time.perf_counter() - start
        console.print(f"[dim]{int(elapsed // 60):2d}:{int(elapsed % 60):02d}[/] {message}",
                      highlight=False)

    with tempfile.TemporaryDirectory(prefix="scale-", dir=args.scratch) as scratch:
        ctx = Ctx(root=Path(scratch), reps=args.reps, quick=args.quick, profile=args.profile,
                  note=note)
        source = args.source.resolve() if args.source is not None else REPO
        ctx.env["PYTHONPATH"] = str(source)
        facts = machine_facts(Path(scratch))
        if args.source is not None:
            facts["source"] = str(source)
        facts["ls_also"] = {label: str(path) for label, path in args.ls_also}
        facts["ckptstore_imported_from"] = imported_from(ctx)
        note(f"measuring ckptstore from {facts['ckptstore_imported_from']}")
        results: dict[str, Any] = {"argv": sys.argv[1:], "machine": facts,
                                   "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                for k, v in vars(args).items()
                                                if k not in ("worker", "report", "ls_also")},
                                   "load_before": load_snapshot()}
        results.update(run_parts(args, ctx))
        results["load_after"] = load_snapshot()
        results["seconds"] = time.perf_counter() - start
    results["targets"] = [t.__dict__ for t in report.targets(results)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(report.markdown(results))
    report.render(results, console)
    console.print(f"results: {args.out} (tables: {args.out.with_suffix('.md')}); "
                  f"{results['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
