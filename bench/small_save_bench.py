"""Synchronous saves of the small20k state (20,000 small fp32 tensors) in one process: five
saves into fresh local repositories, their times and median. Compares checkouts:

    PYTHONPATH=<checkout> python bench/small_save_bench.py <checkout> [nogc]

`nogc` disables Python's cyclic garbage collector for the whole run (to separate its cost).
"""

from __future__ import annotations

import gc
import shutil
import statistics
import sys
import tempfile
import time


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    sys.path.insert(0, root)
    sys.path.insert(0, f"{root}/bench")
    from ckpt import states

    import ckptstore

    if len(sys.argv) > 2 and sys.argv[2] == "nogc":
        gc.disable()
    state = states.build(states.specs(False)["small20k"])
    times = []
    for _ in range(5):
        folder = tempfile.mkdtemp()
        repo = ckptstore.CheckpointStore(folder)
        t0 = time.perf_counter()
        repo.save("a", state, parent=None)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(folder)
    print(root, [round(t, 3) for t in times], "median", round(statistics.median(times), 3))


if __name__ == "__main__":
    main()
