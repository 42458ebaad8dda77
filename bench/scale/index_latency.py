"""Operations that read many index blobs (segments, tree pages, manifest roots) from a local
folder whose whole-object reads (`Store.get`) each wait `--latency-ms` first, as a store in
another building would; data reads are not delayed. One or more source trees side by side
(before and after a change), each measurement in a fresh process, trees alternated:

    python -m scale.index_latency --source /tmp/before --source /work/main --latency-ms 20
    (run from bench/; --op load|gc|du|verify|incremental, --tensors N (default 50,000),
    --reps R (default 3))

* load: checkpoint "s" of `--tensors` 1 KiB tensors loaded whole (new tensors);
* incremental: a restarted process's incremental save on top of "s", the last 10% of its
  tensors changed (by a value no earlier repetition used: each writes them anew), its
  parent's chunks learned from the parent's index segments;
* gc: the reference pass of gc (`referenced_blobs()`) over `--checkpoints` checkpoints
  (default 10) of those tensors, each changing some from the one before: `--pattern tail`
  (default) the last 10% in the state's order (a model whose last layers train: the index
  segments of the others are shared by every checkpoint), `spread` 1% at random (nearly
  every segment holds a changed tensor: little is shared);
* du: the space accounting of `ckpt du` (`inspection.live_bytes` over `each_manifest`: the
  pass `ckpt ls` and `ckpt du` make) over the same checkpoints as gc;
* verify: what `ckpt verify` does over all of them (count the blobs to check, check every
  checkpoint, sum the bytes checked); its whole reads of data blobs wait too.

Reported per tree and repetition: the operation's seconds (from opening the repository,
imports excluded), the whole-object reads made, and when the last of them ended. With
0 ms the same runs show what the operation costs without the round trips.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent  # bench/


def _state(tensors: int, g: Any = None) -> dict[str, Any]:
    """The state "s" holds: `tensors` 1 KiB tensors, the same for every tree (drawn from
    `g`, default a generator seeded 0)."""
    import torch

    g = torch.Generator().manual_seed(0) if g is None else g
    return {f"t{i}": torch.randn(256, generator=g) for i in range(tensors)}


def measure(folder: str, latency: float, op: str, tensors: int) -> dict[str, Any]:
    """Worker: `op` on the repository in `folder` (this process's ckptstore)."""
    import ckptstore
    from ckptstore.stores.local import LocalStore

    ends: list[float] = []
    lock = threading.Lock()

    class Far(LocalStore):
        def get(self, key: str) -> bytes:
            time.sleep(latency)
            data = super().get(key)
            with lock:
                ends.append(time.perf_counter())
            return data

    state = _state(tensors) if op == "incremental" else {}
    if state:
        bump = float(time.time_ns() % 1_000_003 + 1)  # a value of this repetition alone
        for i in range(tensors - max(1, tensors // 10), tensors):
            state[f"t{i}"] += bump
    t0 = time.perf_counter()
    repo = ckptstore.CheckpointStore(Far(folder), create=False)
    if op == "load":
        repo.load("s")
    elif op == "incremental":
        repo.save(f"inc-{os.getpid()}", state, parent="s")
    elif op == "verify":
        from ckptstore.maintenance import checks as maintenance
        from ckptstore.tools import inspection

        manifests = [repo.manifest(info.name) for info in repo.list()]
        maintenance.chunk_blobs(manifests)
        assert maintenance.verify(repo.store, manifests, repo.hash).ok
        inspection.blob_extents(manifests)
    elif op == "du":
        from ckptstore.tools import inspection

        inspection.live_bytes(repo.each_manifest([]))
    else:
        repo.referenced_blobs()
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 3), "index_reads": len(ends),
            "last_index_read_s": round(max(ends) - t0, 3)}


def _save(folder: str, tensors: int, checkpoints: int, pattern: str) -> None:
    """Worker: the checkpoints every tree reads (saved once, by the first tree): "s", then
    for gc, du and verify more, each with some tensors changed from the one before (`pattern`)."""
    import torch

    import ckptstore

    g = torch.Generator().manual_seed(0)
    state = _state(tensors, g)
    repo = ckptstore.CheckpointStore(folder)
    repo.save("s", state, parent=None)
    for k in range(1, checkpoints):
        changed = (range(tensors - max(1, tensors // 10), tensors) if pattern == "tail" else
                   torch.randperm(tensors, generator=g)[:max(1, tensors // 100)].tolist())
        for i in changed:
            state[f"t{i}"] = state[f"t{i}"] + 1
        repo.save(f"s{k}", state)


def _env(source: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{HERE}", "PYTHONSAFEPATH": "1"}


def _run(source: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "scale.index_latency", "--worker", *args],
                         env=_env(source), cwd=HERE, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[],
                    help="a source tree to measure (repeat; default: this checkout)")
    ap.add_argument("--tensors", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--op", choices=("load", "gc", "du", "verify", "incremental"),
                    default="load")
    ap.add_argument("--checkpoints", type=int, default=10,
                    help="checkpoints of the gc, du and verify operations (default 10)")
    ap.add_argument("--pattern", choices=("tail", "spread"), default="tail",
                    help="which tensors each checkpoint of gc, du and verify changes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.save:
            _save(args.folder, args.tensors,
                  args.checkpoints if args.op in ("gc", "du", "verify") else 1,
                  args.pattern)
            print(json.dumps({}))
        else:
            print(json.dumps(measure(args.folder, args.latency_ms / 1000, args.op,
                                     args.tensors)))
        return
    sources = args.source or [str(HERE.parent)]
    with tempfile.TemporaryDirectory(prefix="index-latency-") as tmp:
        folder = str(Path(tmp) / "repo")
        _run(sources[0], "--folder", folder, "--save", "--tensors", str(args.tensors),
             "--op", args.op, "--checkpoints", str(args.checkpoints),
             "--pattern", args.pattern)
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in sources}
        for rep in range(args.reps):
            for source in sources:
                got = _run(source, "--folder", folder, "--latency-ms", str(args.latency_ms),
                           "--op", args.op, "--tensors", str(args.tensors))
                results[source].append(got)
                print(f"rep {rep + 1} {source} {args.op}, {args.latency_ms:g} ms per read: "
                      f"{got['seconds']:.3f} s, {got['index_reads']} reads, the last "
                      f"ending at {got['last_index_read_s']:.3f} s", file=sys.stderr)
    print(json.dumps({"op": args.op, "pattern": args.pattern, "tensors": args.tensors,
                      "latency_ms": args.latency_ms, "results": results}))


if __name__ == "__main__":
    main()
