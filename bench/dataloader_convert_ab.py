"""Conversion only, contestants alternated over several rounds (a shared machine's load drifts).

    python bench/dataloader_convert_ab.py --scale 0.1 --rounds 3 \\
        --peer-python /tmp/data-peers-venv/bin/python [--before /tmp/tree-before] \\
        [--storage local,s3] [--write-workers 1,2,p2] [--out bench/results/convert-ab.json]

Each round runs, for each data set and storage, mosaic's `MDSWriter` and ours (each
--write-workers entry: N threads, or pN forked processes that generate their own partitions),
and with --before also ours from another source tree (a `git archive` of an older commit whose
bench/dataloader/ runners are replaced by this tree's), each in a fresh subprocess, in an order
rotated every round. Prints a table per cell: median MB/s over the rounds and the ratio of
medians to mosaic, and the raw limits measured at the start of every round (200 MB of 16 MiB
files written and fsynced by 1 and 2 threads; 16 MiB puts to the moto server by 2
threads). Storage `s3`: a moto server on 127.0.0.1 (mosaic writes locally, then uploads with
boto3; ours writes to S3).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dataloader"))
sys.path.insert(0, str(HERE))

import limits  # noqa: E402
import servers  # noqa: E402
import synth  # noqa: E402
from dataloader_bench import run_runner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--storage", default="local,s3")
    ap.add_argument("--kinds", default="tokens,bytes")
    ap.add_argument("--write-workers", default="1,2,p2")
    ap.add_argument("--peer-python", default=sys.executable)
    ap.add_argument("--before", default=None, help="another tree's ours, as 'before'")
    ap.add_argument("--workdir", default="/tmp/dataloader-convert-ab")
    ap.add_argument("--out", default=str(HERE / "results" / "convert-ab.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ww: list[int | str] = [w if w.startswith("p") else int(w)
                           for w in args.write_workers.split(",")]
    contestants: list[tuple[str, str, Path | None]] = [("mosaic", args.peer_python, None),
                                                       ("ours", sys.executable, None)]
    if args.before:
        before = Path(args.before)
        shutil.rmtree(before / "bench" / "dataloader", ignore_errors=True)
        shutil.copytree(HERE / "dataloader", before / "bench" / "dataloader")
        contestants.append(("ours-before", sys.executable, before))
    server, endpoint = servers.start_moto() if "s3" in args.storage else (None, None)
    times: dict[tuple[str, str, str], list[float]] = {}
    sizes: dict[str, int] = {}
    raw: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            for t in (1, 2):
                raw.setdefault(f"disk write+fsync, {t} thread(s)", []).append(
                    limits.disk_write_mb_s(work / "raw", 200_000_000, t))
            if endpoint is not None:
                import boto3

                bucket = f"raw-{uuid.uuid4().hex[:10]}"
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
                raw.setdefault("moto put 16 MiB, 2 threads", []).append(
                    limits.s3_put_mb_s(endpoint, bucket, 200_000_000, 2))
            print("raw limits so far:", {k: [round(v) for v in vs] for k, vs in raw.items()},
                  flush=True)
            for kind in args.kinds.split(","):
                n = synth.count(kind, args.scale)
                sizes[kind] = (n * synth.SEQ * 4 if kind == "tokens"
                               else int(synth.byte_sizes(args.scale).sum()))
                for storage in args.storage.split(","):
                    k = r % len(contestants)
                    for name, python, tree in contestants[k:] + contestants[:k]:
                        cwork = work / f"{r}-{kind}-{storage}-{name}"
                        cwork.mkdir()
                        uri = str(cwork / "data")
                        if storage == "s3":
                            import boto3

                            bucket = f"ab-{uuid.uuid4().hex[:10]}"
                            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
                            uri = f"s3://{bucket}/data"
                        cfg: dict[str, Any] = {"kind": kind, "scale": args.scale, "uri": uri,
                                               "work": str(cwork), "batch_size": 32,
                                               "endpoint": endpoint if storage == "s3" else None}
                        runner = "mosaic" if name == "mosaic" else "ours"
                        if runner == "ours":
                            cfg["write_workers"] = ww
                        runners = (tree / "bench" / "dataloader") if tree else None
                        res = run_runner(python, runner, "write", cfg, 1800, runners=runners)
                        if "error" in res:
                            print(f"{name} {kind}/{storage}: {res['error']}", flush=True)
                            continue
                        got = ({f"{name}, workers={w}": res[f"write_s_w{w}"] for w in ww}
                               if runner == "ours" else {name: res["write_s"]})
                        for label, secs in got.items():
                            times.setdefault((kind, storage, label), []).append(secs)
                            print(f"round {r} {kind}/{storage} {label}: {secs:.2f} s, "
                                  f"{sizes[kind] / secs / 1e6:,.0f} MB/s", flush=True)
                        shutil.rmtree(cwork, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
    rows = []
    for (kind, storage, label), secs in sorted(times.items()):
        mosaic = statistics.median(times.get((kind, storage, "mosaic"), [float("nan")]))
        med = statistics.median(secs)
        rows.append({"kind": kind, "storage": storage, "writer": label, "runs_s": secs,
                     "median_mb_per_s": sizes[kind] / med / 1e6, "vs_mosaic": mosaic / med})
    print("\n| data | storage | writer | runs, s | median MB/s | vs mosaic |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        runs = ", ".join(f"{s:.2f}" for s in row["runs_s"])
        print(f"| {row['kind']} | {row['storage']} | {row['writer']} | {runs} | "
              f"{row['median_mb_per_s']:,.0f} | {row['vs_mosaic']:.2f}x |")
    for name, vals in raw.items():
        print(f"raw limit, {name}: {', '.join(f'{v:,.0f}' for v in vals)} MB/s "
              f"(median {statistics.median(vals):,.0f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cells": rows, "raw_mb_per_s": raw}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
