"""A rank's restore plan over a collective checkpoint of many ranks, in fresh processes, for
one or more source trees side by side (before and after a change).

    python -m scale.restore_plan --world 4096 --source /tmp/before --source /work/main
    (run from bench/; --folder keeps the simulated checkpoint between runs; --s3 reads it
    from a SeaweedFS S3 server on 127.0.0.1 instead of the folder; --latency-ms N adds N ms
    to every index blob read, as a remote store's round trip would; with either, each
    tree's plan also runs with its blobs fetched 8 at a time where the tree can)

The checkpoint is the committed manifest of a simulated collective save by rank plans
(scale/rank_plans.py `simulate`: Llama-2-7B, FSDP-style row shards on W ranks; index
segments and root written, no tensor bytes), written by each source tree's own code (its
format may differ) into a folder of its own. Each process, for each source tree in turn,
parses the root and runs rank W/2's restore plan (`rank_plans._restore_refs`: every entry
read, the chunks holding its rows found, their references built): seconds, peak RSS, the
references built, and the index blobs it read (root included) against the whole index.
Blobs come from the page cache after the first run; `--reps` alternates the trees.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent  # bench/


def measure(folder: str, world: int, endpoint: str | None = None, workers: int = 0,
            latency: float = 0.0) -> dict[str, float | int]:
    """Worker: parse the root and run rank W/2's restore plan (this process's ckptstore),
    from the folder or (`endpoint`) the S3 copy of it; `workers`: see _restore_refs;
    `latency`: seconds added to every index blob read (a remote store's round trip)."""
    from ckptstore.format.hashing import hash_algorithm
    from ckptstore.format.manifest_parse import parse_manifest
    from ckptstore.layout import manifest_key, segments_in
    from ckptstore.stores import open_store

    from .rank_plans import _restore_refs

    t0 = time.perf_counter()
    store = (open_store(folder) if endpoint is None else
             open_store(f"s3://plans/{Path(folder).name}", endpoint_url=endpoint))
    algorithm = hash_algorithm("xxh3-128")
    source = segments_in([store], algorithm)
    read: list[int] = []

    def counted(ref: Any) -> bytes:
        time.sleep(latency)
        data = source(ref)
        read.append(len(data))
        return data

    root = store.get(manifest_key("sim"))
    manifest = parse_manifest(root, "sim", algorithm, counted)
    t1 = time.perf_counter()
    refs = _restore_refs(manifest, world, world // 2, workers)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "refs": refs, "after_root_s": time.perf_counter() - t1,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "segments": len(manifest.segment_refs()), "blobs_read": len(read),
            "index_read_bytes": len(root) + sum(read),
            "index_bytes": len(root) + sum(i.size for i in store.list("blobs/"))}


def _upload(folder: str, endpoint: str) -> None:
    """Copy the simulated repository `folder` into bucket "plans" under its folder's name."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        client.create_bucket(Bucket="plans")
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    root = Path(folder)
    for path in root.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "plans", f"{root.name}/{path.relative_to(root)}")


def _folder(base: str, world: int, source: str) -> str:
    return f"{base}-{world}-{hashlib.sha256(source.encode()).hexdigest()[:8]}"


def _env(source: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{HERE}", "PYTHONSAFEPATH": "1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4096)
    ap.add_argument("--source", action="append", default=[],
                    help="a tree holding ckptstore/ (repeat: each is measured in turn)")
    ap.add_argument("--folder", default="/tmp/ckpt-restore-plan")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--s3", action="store_true", help="read from a SeaweedFS S3 server")
    ap.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="add this to every index blob read (a remote store's round trip)")
    args = ap.parse_args()
    if args.worker or args.simulate:  # in a process importing one source tree
        folder = args.folder
        if args.simulate:
            from .rank_plans import simulate

            made = simulate(folder, "7b", False, args.world)
            print(f"simulated save at {args.world:,} ranks: {made['chunks']:,} chunks in "
                  f"{made['segments']} segments", file=sys.stderr)
        else:
            print(json.dumps(measure(folder, args.world, args.endpoint, args.workers,
                                     args.latency_ms / 1000)))
        return
    if not args.source:
        ap.error("name at least one --source")
    for source in args.source:
        folder = _folder(args.folder, args.world, source)
        if not Path(folder, "checkpoints").exists():
            subprocess.run([sys.executable, "-m", "scale.restore_plan", "--simulate",
                            "--world", str(args.world), "--folder", folder],
                           env=_env(source), cwd=HERE, check=True)
    server = None
    extra: list[str] = []
    env_extra: dict[str, str] = {}
    if args.s3:
        spec = importlib.util.spec_from_file_location("bench_servers",
                                                      HERE / "dataloader" / "servers.py")
        assert spec is not None and spec.loader is not None
        servers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(servers)
        server, endpoint, _root = servers.start_seaweed()
        env_extra = {**servers.SEAWEED_KEYS, "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(env_extra)
        for source in args.source:
            _upload(_folder(args.folder, args.world, source), endpoint)
        extra = ["--endpoint", endpoint]
    try:
        for rep in range(args.reps):
            for source in args.source:
                for workers in ([0, 8] if args.s3 or args.latency_ms else [0]):
                    folder = _folder(args.folder, args.world, source)
                    out = subprocess.run(
                        [sys.executable, "-m", "scale.restore_plan", "--worker", "--world",
                         str(args.world), "--folder", folder, "--workers", str(workers),
                         "--latency-ms", str(args.latency_ms), *extra],
                        env={**_env(source), **env_extra}, cwd=HERE,
                        capture_output=True, text=True)
                    if out.returncode:  # (a tree without prefetch cannot fetch 8 at a time)
                        print(f"rep {rep + 1} {source} workers={workers}: failed: "
                              f"{out.stderr.strip().splitlines()[-1][:200]}")
                        continue
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"rep {rep + 1} {source}{' s3' if args.s3 else ''} "
                          f"workers={workers}: {got['seconds']:.3f} s (after the root "
                          f"{got['after_root_s']:.3f} s), peak RSS "
                          f"{got['peak_rss_mib']:.0f} MiB, {got['refs']} chunk refs built, "
                          f"{got['segments']} segments; read {got['blobs_read']} index "
                          f"blobs, {got['index_read_bytes'] / 1e6:.2f} MB of "
                          f"{got['index_bytes'] / 1e6:.1f} MB")
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
