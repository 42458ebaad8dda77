"""Dataloader benchmark: conversion and reading, this project vs litdata vs mosaicml-streaming.

One command::

    python bench/dataloader_bench.py [--scale 1.0] [--storage local,s3]
        [--contestants ours,litdata,mosaic] [--write-workers 1,2] [--seaweed]
        [--out bench/results/dataloader.json]

Data (bench/dataloader/synth.py, identical for every contestant): ~256M tokens in 2,049-token
int32 samples, and ~2 GB of byte samples of 1-63 KiB (x --scale). Each contestant converts
the data into its own format (to a local folder, or to a moto S3 server this script starts on
127.0.0.1): ours with `write_dataset(workers=N)` for each N of --write-workers, litdata with
`optimize(num_workers=--peer-write-workers)`, mosaic with `MDSWriter` (peers write locally,
then upload with boto3 for S3). Conversion figures: seconds, MB/s, samples/s, and the fraction
of the raw limits (files of 16 MiB written and fsynced by 1/2 threads; 16 MiB puts by 2
threads to the same S3 server). Then each reads one shuffled epoch in a fresh subprocess:
samples/s over the epoch (first batch included), time to first batch, time to the first
batch after resuming from a state taken at 50% of the epoch (new dataset + loader objects),
and the peak memory of the reader's process tree (sum of PSS, sampled every 50 ms). Local
reads come from the page cache; moto serves S3 from the same 2 cores, so S3 numbers are
ratios, not absolutes. Before a local epoch every file of the dataset it reads is read once,
for every contestant alike: ours writes shards with O_DIRECT, which leaves no page cache
behind, and the peers' buffered writes do. Shuffle quality (bench/dataloader/shuffle_stats.py)
is measured on a small id dataset for every contestant's shuffle. With --seaweed, ours' time
to first batch is also measured against a SeaweedFS server (fresh process each time, 3 runs).

mosaicml-streaming imports torchvision at import time; where the installed torchvision does
not load beside this torch, its runner stands in an empty torchvision module (its vision
datasets are not used). Peers may run from another venv (--peer-python, e.g. one made with
``python -m venv --system-site-packages V && V/bin/pip install -c C litdata
mosaicml-streaming`` where C pins torch==2.13.0). A contestant that is not installed is
reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "dataloader"
sys.path.insert(0, str(RUNNERS))

import limits  # noqa: E402
import servers  # noqa: E402
import shuffle_stats  # noqa: E402
import synth  # noqa: E402

# Dummy credentials for the local moto server only (the standard boto3 chain reads them).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeMemory:
    """Samples the summed PSS of a process and all its descendants; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval, self.peak_kb = pid, interval, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids, todo = [], [self.pid]
            while todo:
                p = todo.pop()
                pids.append(p)
                todo += _children(p)
            self.peak_kb = max(self.peak_kb, sum(_pss_kb(p) for p in pids))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak_kb


def run_runner(
    python: str, name: str, phase: str, cfg: dict[str, Any], timeout: float,
    env_extra: dict[str, str] | None = None, runners: Path | None = None,
) -> dict[str, Any]:
    cmd = [python, str((runners or RUNNERS) / f"run_{name}.py"), phase, json.dumps(cfg)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env_extra or {}))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    mem = TreeMemory(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        mem.stop()
        return {"error": f"timeout after {timeout:.0f}s"}
    peak = mem.stop()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
            res["peak_mem_mb"] = peak / 1024
            res["wall_s"] = time.perf_counter() - t0
            return res
    tail = (err or out).strip().splitlines()[-5:]
    return {"error": " | ".join(tail) or f"exit code {proc.returncode}"}


def available(python: str, module: str) -> bool:
    """Installed for `python` (found, not imported: the runner makes mosaic importable)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def fmt_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "data",
        "storage",
        "loader",
        "samples/s",
        "MB/s",
        "vs best peer",
        "first batch s",
        "resume@50% s",
        "peak mem MB",
        "write s",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['kind']} | {r['storage']} | {r['loader']} | "
                + "skipped: "
                + r["error"][:80].replace("|", "/")
                + " |"
                + " |" * (len(head) - 4)
            )
            continue
        ratio = f"{r['ratio']:.1f}x" if r.get("ratio") else ""
        lines.append(
            f"| {r['kind']} | {r['storage']} | {r['loader']} | {r['samples_per_s']:,.0f} | "
            f"{r['mb_per_s']:,.0f} | {ratio} | {r['ttfb_s']:.2f} | {r['resume_s']:.2f} | "
            f"{r['peak_mem_mb']:,.0f} | {r.get('write_s', 0):.1f} |"
        )
    return "\n".join(lines)


def warm_page_cache(root: Path) -> int:
    """Read every file under `root` once, 16 MiB at a time; returns the bytes read."""
    total = 0
    buf = bytearray(16 << 20)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the full data sizes")
    ap.add_argument("--storage", default="local,s3")
    ap.add_argument("--contestants", default="ours,litdata,mosaic")
    ap.add_argument("--kinds", default="tokens,bytes")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader workers (default: ours 4 threads, peers 2 processes)",
    )
    ap.add_argument("--peer-python", default=sys.executable,
                    help="the Python that runs litdata and mosaic (another venv, say)")
    ap.add_argument("--write-workers", default="1,2,p2",
                    help="ours: write_dataset(workers=N) for each N, threads; pN: N forked "
                    "processes that generate their own partitions (the last one is read)")
    ap.add_argument("--peer-write-workers", type=int, default=2,
                    help="litdata optimize(num_workers=N)")
    ap.add_argument("--seaweed", action="store_true",
                    help="also time ours' first batch against a SeaweedFS server")
    ap.add_argument("--workdir", default="/tmp/dataloader-bench")
    ap.add_argument("--out", default=str(HERE / "results" / "dataloader.json"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    pythons = {"ours": sys.executable, "litdata": args.peer_python, "mosaic": args.peer_python}
    write_workers: list[int | str] = [
        w if w.startswith("p") else int(w) for w in args.write_workers.split(",") if w
    ]
    conv: list[dict[str, Any]] = []
    limit_rows: list[dict[str, Any]] = []
    ttfb_rows: list[dict[str, Any]] = []
    modules = {"ours": "dataloader", "litdata": "litdata", "mosaic": "streaming"}
    contestants = [c for c in args.contestants.split(",") if c]
    storages = [s for s in args.storage.split(",") if s]
    kinds = [k for k in args.kinds.split(",") if k]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server, endpoint = (None, None)
    if "s3" in storages:
        server, endpoint = servers.start_moto()
    rows: list[dict[str, Any]] = []
    shuffle: list[dict[str, Any]] = []
    try:
        for kind in kinds:
            n = synth.count(kind, args.scale)
            nbytes = (
                n * synth.SEQ * 4 if kind == "tokens" else int(synth.byte_sizes(args.scale).sum())
            )
            for storage in storages:
                raw = min(nbytes, 512 << 20)
                if storage == "local":
                    lim = {f"disk write, {t} thread(s)":
                           limits.disk_write_mb_s(work / "raw", raw, t) for t in (1, 2)}
                else:
                    import boto3

                    rb = f"raw-{uuid.uuid4().hex[:10]}"
                    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=rb)
                    lim = {"S3 put 16 MiB, 2 threads": limits.s3_put_mb_s(endpoint, rb, raw, 2)}
                    _drop_bucket(endpoint, f"s3://{rb}")
                limit_rows += [{"kind": kind, "storage": storage, "limit": k, "mb_per_s": v}
                               for k, v in lim.items()]
                print(f"[{kind}/{storage}] raw limits: {lim}", flush=True)
                for c in contestants:
                    row: dict[str, Any] = {
                        "kind": kind,
                        "storage": storage,
                        "loader": c,
                        "num_samples": n,
                        "data_bytes": nbytes,
                    }
                    print(f"[{kind}/{storage}/{c}] ...", flush=True)
                    if not (Path(pythons[c]).exists() and available(pythons[c], modules[c])):
                        rows.append(
                            {**row, "error": f"{modules[c]} not installed for {pythons[c]}"}
                        )
                        continue
                    cwork = work / f"{kind}-{storage}-{c}"
                    cwork.mkdir()
                    if storage == "s3":
                        import boto3

                        bucket = f"bench-{uuid.uuid4().hex[:10]}"
                        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
                        uri = f"s3://{bucket}/{c}"
                    else:
                        uri = str(cwork / "data")
                    cfg = {
                        "kind": kind,
                        "scale": args.scale,
                        "uri": uri,
                        "work": str(cwork),
                        "endpoint": endpoint if storage == "s3" else None,
                        "batch_size": args.batch_size,
                    }
                    if args.workers is not None:
                        cfg["workers"] = args.workers
                    if c == "ours":
                        cfg["write_workers"] = write_workers
                    cfg["peer_write_workers"] = args.peer_write_workers
                    w = run_runner(pythons[c], c, "write", cfg, args.timeout)
                    if "error" in w:
                        rows.append({**row, "error": "write: " + w["error"]})
                        print("   ", rows[-1]["error"], flush=True)
                        continue
                    writers = (
                        {_ours_writer(k): w[f"write_s_w{k}"] for k in write_workers}
                        if c == "ours"
                        else {"litdata optimize, num_workers="
                              f"{args.peer_write_workers}" if c == "litdata"
                              else "mosaic MDSWriter": w["write_s"]}
                    )
                    for name, secs in writers.items():
                        conv.append({"kind": kind, "storage": storage, "writer": name,
                                     "contestant": c, "write_s": secs,
                                     "mb_per_s": nbytes / secs / 1e6, "samples_per_s": n / secs})
                        print(f"    convert {name}: {secs:.1f} s, {nbytes / secs / 1e6:,.0f} MB/s",
                              flush=True)
                    if storage == "local":
                        read_dir = (f"{uri}-w{write_workers[-1]}" if c == "ours" and write_workers
                                    else uri)
                        warm_page_cache(Path(read_dir))
                    r = run_runner(pythons[c], c, "read", cfg, args.timeout)
                    if "error" in r:
                        rows.append({**row, "error": "read: " + r["error"]})
                        print("   ", rows[-1]["error"], flush=True)
                        continue
                    r["mb_per_s"] = nbytes / r["epoch_s"] / 1e6
                    rows.append({**row, **r, "write_s": w["write_s"]})
                    print(
                        f"    {r['samples_per_s']:,.0f} samples/s, first batch {r['ttfb_s']:.2f}s, "
                        f"resume {r['resume_s']:.2f}s, peak {r['peak_mem_mb']:,.0f} MB",
                        flush=True,
                    )
                    if c == "ours" and storage == "s3":
                        for _ in range(3):  # fresh processes: open + first batch only
                            t = run_runner(pythons[c], c, "ttfb", cfg, args.timeout)
                            ttfb_rows.append({"kind": kind, "server": "moto", **t})
                    if storage == "local" and kind == kinds[0]:
                        o = run_runner(pythons[c], c, "order", cfg, args.timeout)
                        for mode, order in o.items():
                            if isinstance(order, list):
                                shuffle.append({"loader": c, "mode": mode,
                                                **shuffle_stats.stats(order)})
                    shutil.rmtree(cwork, ignore_errors=True)
                    if storage == "s3":
                        _drop_bucket(endpoint, uri)
        if args.seaweed and "ours" in contestants:
            ttfb_rows += seaweed_ttfb(kinds, args, work)
    finally:
        if server is not None:
            server.stop()
    for r in rows:
        if r["loader"] == "ours" and "error" not in r:
            peers = [
                p["samples_per_s"]
                for p in rows
                if p["kind"] == r["kind"]
                and p["storage"] == r["storage"]
                and p["loader"] != "ours"
                and "error" not in p
            ]
            if peers:
                r["ratio"] = r["samples_per_s"] / max(peers)
    for r in conv:
        peers = [p["mb_per_s"] for p in conv if p["kind"] == r["kind"]
                 and p["storage"] == r["storage"] and p["contestant"] != "ours"]
        r["vs_faster_peer"] = r["mb_per_s"] / max(peers) if peers else None
        lims = {x["limit"]: x["mb_per_s"] for x in limit_rows
                if x["kind"] == r["kind"] and x["storage"] == r["storage"]}
        r["of_raw_limit"] = r["mb_per_s"] / max(lims.values()) if lims else None
    table = "\n\n".join([fmt_table(rows), fmt_conv(conv, limit_rows), fmt_shuffle(shuffle),
                          fmt_ttfb(ttfb_rows)])
    cmd = "python bench/dataloader_bench.py " + " ".join(sys.argv[1:])
    print()
    print(f"command: {cmd.strip()}")
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"command": cmd.strip(), "scale": args.scale, "rows": rows, "conversion": conv,
             "limits": limit_rows, "shuffle": shuffle, "ttfb": ttfb_rows, "table": table},
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


def seaweed_ttfb(kinds: list[str], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Ours on a SeaweedFS server: write (last --write-workers), then 3 fresh first batches."""
    import boto3

    out: list[dict[str, Any]] = []
    try:
        proc, endpoint, root = servers.start_seaweed()
    except RuntimeError as exc:
        return [{"kind": k, "server": "seaweedfs", "error": str(exc)} for k in kinds]
    try:
        keys = servers.SEAWEED_KEYS
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"]
                     ).create_bucket(Bucket="bench-ttfb")
        for kind in kinds:
            cfg = {"kind": kind, "scale": args.scale, "uri": f"s3://bench-ttfb/{kind}",
                   "work": str(work), "endpoint": endpoint, "batch_size": args.batch_size,
                   "write_workers": [w if w.startswith("p") else int(w)
                                     for w in args.write_workers.split(",")][-1:]}
            w = run_runner(sys.executable, "ours", "write", cfg, args.timeout, keys)
            if "error" in w:
                out.append({"kind": kind, "server": "seaweedfs", "error": w["error"]})
                continue
            for _ in range(3):
                t = run_runner(sys.executable, "ours", "ttfb", cfg, args.timeout, keys)
                out.append({"kind": kind, "server": "seaweedfs", **t})
    finally:
        servers.stop_seaweed(proc, root)
    return out


def _ours_writer(w: int | str) -> str:
    if isinstance(w, str):
        return f"ours, workers={w[1:]} processes"
    return f"ours, workers={w}"


def fmt_conv(conv: list[dict[str, Any]], lims: list[dict[str, Any]]) -> str:
    lines = ["| data | storage | writer | s | MB/s | samples/s | vs faster peer | of raw limit |",
             "|---|---|---|---|---|---|---|---|"]
    for r in conv:
        vs = f"{r['vs_faster_peer']:.2f}x" if r.get("vs_faster_peer") else ""
        of = f"{r['of_raw_limit']:.0%}" if r.get("of_raw_limit") else ""
        lines.append(f"| {r['kind']} | {r['storage']} | {r['writer']} | {r['write_s']:.1f} | "
                     f"{r['mb_per_s']:,.0f} | {r['samples_per_s']:,.0f} | {vs} | {of} |")
    for x in lims:
        lines.append(f"| {x['kind']} | {x['storage']} | raw limit: {x['limit']} | | "
                     f"{x['mb_per_s']:,.0f} | | | |")
    return "\n".join(lines)


def fmt_shuffle(rows: list[dict[str, Any]]) -> str:
    lines = ["| loader | shuffle | Spearman rho | neighbour spread (1.0 = uniform) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['loader']} | {r['mode']} | {r['spearman']:+.3f} | "
                     f"{r['neighbour_spread']:.3f} |")
    return "\n".join(lines)


def fmt_ttfb(rows: list[dict[str, Any]]) -> str:
    lines = ["| data | server | first batch s (fresh process) |", "|---|---|---|"]
    for r in rows:
        cell = f"{r['ttfb_s']:.3f}" if "ttfb_s" in r else "error: " + r.get("error", "")[:80]
        lines.append(f"| {r['kind']} | {r['server']} | {cell} |")
    return "\n".join(lines)


def _drop_bucket(endpoint: str, uri: str) -> None:
    """Free moto's memory between contestants."""
    import boto3

    bucket = uri[len("s3://") :].split("/")[0]
    s3 = boto3.resource("s3", endpoint_url=endpoint).Bucket(bucket)
    s3.objects.all().delete()
    s3.delete()


if __name__ == "__main__":
    sys.exit(main())
