"""A rank's restore plan over a collective checkpoint of many ranks, in fresh processes, for
one or more source trees side by side (before and after a change).

    python -m scale.restore_plan --world 4096 --source /tmp/before --source /work/main
    (run from bench/; --folder keeps the simulated checkpoint between runs)

The checkpoint is the committed manifest of a simulated collective save by rank plans
(scale/rank_plans.py `simulate`: Llama-2-7B, FSDP-style row shards on W ranks; index
segments and root written, no tensor bytes). Each process, for each source tree in turn,
parses the root and runs rank W/2's restore plan (`rank_plans._restore_refs`: every entry
read, the chunks holding its rows found, their references built): seconds, peak RSS, and
the references built. Segments come from the page cache after the first run; `--reps`
alternates the trees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # bench/


def measure(folder: str, world: int) -> dict[str, float | int]:
    """Worker: parse the root and run rank W/2's restore plan (this process's ckptstore)."""
    from ckptstore.format.hashing import hash_algorithm
    from ckptstore.format.manifest_parse import parse_manifest
    from ckptstore.layout import manifest_key, segments_in
    from ckptstore.stores import open_store

    from .rank_plans import _restore_refs

    t0 = time.perf_counter()
    store = open_store(folder)
    algorithm = hash_algorithm("xxh3-128")
    manifest = parse_manifest(store.get(manifest_key("sim")), "sim", algorithm,
                              segments_in([store], algorithm))
    refs = _restore_refs(manifest, world, world // 2)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "refs": refs,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "segments": len(manifest.segment_refs())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4096)
    ap.add_argument("--source", action="append", default=[],
                    help="a tree holding ckptstore/ (repeat: each is measured in turn)")
    ap.add_argument("--folder", default="/tmp/ckpt-restore-plan")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    folder = f"{args.folder}-{args.world}"
    if args.worker:
        print(json.dumps(measure(folder, args.world)))
        return
    if not args.source:
        ap.error("name at least one --source")
    if not Path(folder, "checkpoints").exists():
        from .rank_plans import simulate

        made = simulate(folder, "7b", False, args.world)
        print(f"simulated save at {args.world:,} ranks: {made['chunks']:,} chunks in "
              f"{made['segments']} segments", file=sys.stderr)
    for rep in range(args.reps):
        for source in args.source:
            env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{HERE}",
                   "PYTHONSAFEPATH": "1"}
            out = subprocess.run([sys.executable, "-m", "scale.restore_plan", "--worker",
                                  "--world", str(args.world), "--folder", args.folder],
                                 env=env, cwd=HERE, check=True, capture_output=True, text=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"rep {rep + 1} {source}: {got['seconds']:.3f} s, peak RSS "
                  f"{got['peak_rss_mib']:.0f} MiB, {got['refs']} chunk refs built, "
                  f"{got['segments']} segments read")


if __name__ == "__main__":
    main()
