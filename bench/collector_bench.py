"""20,000 small tensors: save, save_async (blocked / total) and load, medians of 3, in a process
holding 300,000 other live objects (as a trainer does). Compares the garbage-collector policy
of two checkouts: run it once per checkout, same machine, same minute, alternating.

    PYTHONPATH=<checkout> python bench/collector_bench.py <label>
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time

import torch

import ckptstore


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ckptstore.__file__
    g = torch.Generator().manual_seed(0)
    ballast = [{"a": [i, str(i)], "b": (i,)} for i in range(300_000)]  # the host's objects
    state = {f"t{i}": torch.randn(16 + (i * 37) % 4000, generator=g) for i in range(20_000)}
    times: dict[str, list[float]] = {"save": [], "async blocked": [], "async total": [],
                                      "load": []}
    for _ in range(3):
        folder = tempfile.mkdtemp()
        repo = ckptstore.CheckpointStore(folder)
        t0 = time.perf_counter()
        repo.save("a", state, parent=None)
        times["save"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        handle = repo.save_async("b", state, parent=None)
        times["async blocked"].append(time.perf_counter() - t0)
        handle.wait()
        times["async total"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckptstore.CheckpointStore(folder).load("a")
        times["load"].append(time.perf_counter() - t0)
        shutil.rmtree(folder)
    print(label, {k: round(statistics.median(v), 3) for k, v in times.items()}, len(ballast))


if __name__ == "__main__":
    main()
