"""Time to first batch from a moto S3 server, this tree vs an older one, alternated.

    python bench/dataloader_ttfb_ab.py --scale 0.1 --runs 5 --before /tmp/tree-before \\
        [--kinds tokens,bytes] [--write-workers 2] [--server moto|seaweed] \\
        [--out bench/results/ttfb-ab.json]

Each tree writes each data set to the same moto (or SeaweedFS) server (partitioned,
`write_dataset(workers=--write-workers)`), then the two trees take turns timing a fresh
process that opens the dataset and takes its first shuffled batch (batch 32, 4 threads:
run_ours.py's `ttfb` phase).
--before: a `git archive` of the older commit (its bench/dataloader/ runners are replaced by
this tree's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dataloader"))
sys.path.insert(0, str(HERE))

import servers  # noqa: E402
from dataloader_bench import run_runner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--kinds", default="tokens,bytes")
    ap.add_argument("--write-workers", default="2")
    ap.add_argument("--before", required=True)
    ap.add_argument("--server", choices=("moto", "seaweed"), default="moto")
    ap.add_argument("--out", default=str(HERE / "results" / "ttfb-ab.json"))
    args = ap.parse_args()
    before = Path(args.before)
    shutil.rmtree(before / "bench" / "dataloader", ignore_errors=True)
    shutil.copytree(HERE / "dataloader", before / "bench" / "dataloader")
    trees = {"after": HERE / "dataloader", "before": before / "bench" / "dataloader"}
    ww = args.write_workers
    keys: dict[str, str] | None = None
    if args.server == "seaweed":
        proc, endpoint, root = servers.start_seaweed()
        keys = servers.SEAWEED_KEYS
    else:
        server, endpoint = servers.start_moto()
    rows = []
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              **{k.lower(): v for k, v in (keys or {}).items()})
        for kind in args.kinds.split(","):
            cfgs = {}
            for name, runners in trees.items():
                bucket = f"ttfb-{uuid.uuid4().hex[:10]}"
                client.create_bucket(Bucket=bucket)
                cfgs[name] = {"kind": kind, "scale": args.scale, "uri": f"s3://{bucket}/d",
                              "work": "/tmp", "endpoint": endpoint, "batch_size": 32,
                              "write_workers": [ww if ww.startswith("p") else int(ww)]}
                w = run_runner(sys.executable, "ours", "write", cfgs[name], 1800, keys,
                               runners=runners)
                assert "error" not in w, w
            got: dict[str, list[float]] = {n: [] for n in trees}
            for r in range(args.runs):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for name in order:
                    t = run_runner(sys.executable, "ours", "ttfb", cfgs[name], 600, keys,
                                   runners=trees[name])
                    assert "error" not in t, t
                    got[name].append(t["ttfb_s"])
                    print(f"{kind} {name}: {t['ttfb_s']:.2f} s", flush=True)
            for name, secs in got.items():
                rows.append({"kind": kind, "server": args.server, "tree": name, "runs_s": secs,
                             "median_s": statistics.median(secs)})
    finally:
        if args.server == "seaweed":
            servers.stop_seaweed(proc, root)
        else:
            server.stop()
    print("\n| data | tree | runs, s | median s |\n|---|---|---|---|")
    for row in rows:
        runs = ", ".join(f"{s:.2f}" for s in row["runs_s"])
        print(f"| {row['kind']} | {row['tree']} | {runs} | {row['median_s']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
