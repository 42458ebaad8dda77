"""Dataloader benchmark: this project's StreamingLoader vs litdata vs mosaicml-streaming.

One command::

    python bench/dataloader_bench.py [--scale 1.0] [--storage local,s3]
        [--contestants ours,litdata,mosaic] [--out bench/results/dataloader.json]

Data (bench/dataloader/synth.py, identical for every contestant): ~256M tokens in 2,049-token
int32 samples, and ~2 GB of byte samples of 1-63 KiB (x --scale). Each contestant writes its own
format (to a local folder, or to a moto S3 server this script starts on 127.0.0.1), then reads
one shuffled epoch in a fresh subprocess: samples/s over the epoch (first batch included), time
to first batch, time to the first batch after resuming from a state taken at 50% of the epoch
(new dataset + loader objects), and the peak memory of the reader's whole process tree (sum
of PSS, sampled every 50 ms). Local reads come from the page cache (the data was just
written); moto serves S3 from the same 2 cores, so S3 numbers are ratios, not absolutes.

mosaicml-streaming needs torchvision matching torch: it runs from a separate venv
(--mosaic-python, default /tmp/msvenv/bin/python; set up with
``python -m venv /tmp/msvenv && /tmp/msvenv/bin/pip install torch==2.14.1 torchvision==0.29.1
mosaicml-streaming``). A contestant that is not installed is reported as skipped.
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
    python: str, name: str, phase: str, cfg: dict[str, Any], timeout: float
) -> dict[str, Any]:
    cmd = [python, str(RUNNERS / f"run_{name}.py"), phase, json.dumps(cfg)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
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
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def start_moto() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


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
    ap.add_argument("--mosaic-python", default="/tmp/msvenv/bin/python")
    ap.add_argument("--workdir", default="/tmp/dataloader-bench")
    ap.add_argument("--out", default=str(HERE / "results" / "dataloader.json"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    pythons = {"ours": sys.executable, "litdata": sys.executable, "mosaic": args.mosaic_python}
    modules = {"ours": "dataloader", "litdata": "litdata", "mosaic": "streaming"}
    contestants = [c for c in args.contestants.split(",") if c]
    storages = [s for s in args.storage.split(",") if s]
    kinds = [k for k in args.kinds.split(",") if k]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server, endpoint = (None, None)
    if "s3" in storages:
        server, endpoint = start_moto()
    rows: list[dict[str, Any]] = []
    try:
        for kind in kinds:
            n = synth.count(kind, args.scale)
            nbytes = (
                n * synth.SEQ * 4 if kind == "tokens" else int(synth.byte_sizes(args.scale).sum())
            )
            for storage in storages:
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
                    w = run_runner(pythons[c], c, "write", cfg, args.timeout)
                    if "error" in w:
                        rows.append({**row, "error": "write: " + w["error"]})
                        print("   ", rows[-1]["error"], flush=True)
                        continue
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
                    shutil.rmtree(cwork, ignore_errors=True)
                    if storage == "s3":
                        _drop_bucket(endpoint, uri)
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
    table = fmt_table(rows)
    cmd = "python bench/dataloader_bench.py " + " ".join(sys.argv[1:])
    print()
    print(f"command: {cmd.strip()}")
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"command": cmd.strip(), "scale": args.scale, "rows": rows, "table": table}, indent=2
        )
    )
    print(f"\nwrote {out}")
    return 0


def _drop_bucket(endpoint: str, uri: str) -> None:
    """Free moto's memory between contestants."""
    import boto3

    bucket = uri[len("s3://") :].split("/")[0]
    s3 = boto3.resource("s3", endpoint_url=endpoint).Bucket(bucket)
    s3.objects.all().delete()
    s3.delete()


if __name__ == "__main__":
    sys.exit(main())
