"""What the cryptographic hash option costs: save and restore of one state into a local
repository named by xxh3-128 vs sha256-128, beside the raw speed of each hash on one core.

    python bench/hash_bench.py [--gib 1.0] [--repeat 3]

Prints a table of medians and the sha256/xxh3 ratios (same run, same disk, same state).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from ckptstore import CheckpointStore
from ckptstore.format.hashing import ALGORITHMS


def hash_speed(name: str, data: bytes, repeat: int) -> float:
    """GB/s of one core hashing `data`."""
    fn = ALGORITHMS[name].digest
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
    return len(data) / min(times) / 1e9


def save_load(name: str, state: dict, root: str, repeat: int) -> tuple[float, float]:
    """Median seconds of a full (non-incremental) save and of a restore into new tensors."""
    saves, loads = [], []
    for i in range(repeat):
        path = os.path.join(root, f"{name}-{i}")
        repo = CheckpointStore(path, hash=name)
        t0 = time.perf_counter()
        repo.save("s", state, parent=None)
        saves.append(time.perf_counter() - t0)
        fresh = CheckpointStore(path)
        t0 = time.perf_counter()
        fresh.load("s")
        loads.append(time.perf_counter() - t0)
        shutil.rmtree(path)
    return statistics.median(saves), statistics.median(loads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    torch.manual_seed(0)
    state = {f"layer{i}": torch.randn(n // 8) for i in range(8)}
    nbytes = sum(t.nbytes for t in state.values())
    sample = os.urandom(256 << 20)
    print(f"state {nbytes / 2**30:.2f} GiB, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for name in ("xxh3-128", "sha256-128"):
            speed = hash_speed(name, sample, args.repeat)
            save_s, load_s = save_load(name, state, root, args.repeat)
            rows[name] = (speed, nbytes / save_s / 1e9, nbytes / load_s / 1e9)
    print(f"{'hash':<12} {'hash GB/s (1 core)':>18} {'save GB/s':>10} {'restore GB/s':>13}")
    for name, (speed, save, load) in rows.items():
        print(f"{name:<12} {speed:>18.2f} {save:>10.2f} {load:>13.2f}")
    x, s = rows["xxh3-128"], rows["sha256-128"]
    print(f"sha256/xxh3: save {s[1] / x[1]:.2f}x, restore {s[2] / x[2]:.2f}x the throughput")


if __name__ == "__main__":
    main()
