"""A whole load of many 1 KiB tensors from a local folder whose whole-object reads (the root,
index segments, tree pages: `Store.get`) each wait `--latency-ms` first, as a store in
another building would; data reads are not delayed. One or more source trees side by side
(before and after a change), each measurement in a fresh process, trees alternated:

    python -m scale.load_latency --source /tmp/before --source /work/main --latency-ms 20
    (run from bench/; --tensors N, default 50,000; --reps R, default 3)

Reported per tree and repetition: the load's seconds (from opening the repository to the
state returned, imports excluded), the index reads made, and when the last of them ended.
With 0 ms the same runs show what the load costs without the round trips.
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


def measure(folder: str, latency: float) -> dict[str, Any]:
    """Worker: load checkpoint "s" of `folder` whole (this process's ckptstore)."""
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

    t0 = time.perf_counter()
    ckptstore.CheckpointStore(Far(folder), create=False).load("s")
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 3), "index_reads": len(ends),
            "last_index_read_s": round(max(ends) - t0, 3)}


def _save(folder: str, tensors: int) -> None:
    """Worker: the checkpoint every tree loads (saved once, by the first tree)."""
    import torch

    import ckptstore

    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(256, generator=g) for i in range(tensors)}
    ckptstore.CheckpointStore(folder).save("s", state, parent=None)


def _env(source: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{HERE}", "PYTHONSAFEPATH": "1"}


def _run(source: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "scale.load_latency", "--worker", *args],
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
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.save:
            _save(args.folder, args.tensors)
            print(json.dumps({}))
        else:
            print(json.dumps(measure(args.folder, args.latency_ms / 1000)))
        return
    sources = args.source or [str(HERE.parent)]
    with tempfile.TemporaryDirectory(prefix="load-latency-") as tmp:
        folder = str(Path(tmp) / "repo")
        _run(sources[0], "--folder", folder, "--save", "--tensors", str(args.tensors))
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in sources}
        for rep in range(args.reps):
            for source in sources:
                got = _run(source, "--folder", folder, "--latency-ms", str(args.latency_ms))
                results[source].append(got)
                print(f"rep {rep + 1} {source}, {args.latency_ms:g} ms per index read: "
                      f"{got['seconds']:.3f} s, {got['index_reads']} index reads, the last "
                      f"ending at {got['last_index_read_s']:.3f} s", file=sys.stderr)
    print(json.dumps({"tensors": args.tensors, "latency_ms": args.latency_ms,
                      "results": results}))


if __name__ == "__main__":
    main()
