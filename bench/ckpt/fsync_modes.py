"""Durability strategies for writing N chunk files, measured on the disk under test:

* ``fsync_each``: write + fsync every file, then fsync each folder one after another
  (what LocalStore does today: fsync in `put`, folder fsyncs in `sync()` at commit);
* ``fsync_each_dirs_parallel``: the same, folder fsyncs spread over the thread pool;
* ``fsync_each_flat``: write + fsync every file into ONE folder, one folder fsync
  (the raw-write limit of ckpt_bench);
* ``syncfs_once``: write every file without fsync, then one syncfs(2) of the file system
  (flushes data and metadata of every file at once; since Linux 5.8 it reports writeback
  errors, but it also flushes other processes' dirty data on that file system).

    python bench/ckpt/fsync_modes.py --mib 1024 --chunk-mib 16 --threads 8 --dir /tmp/fsm
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import os
import shutil
import time
import uuid

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run(mode: str, root: str, data: np.ndarray, chunk: int, threads: int) -> float:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    n = len(data) // chunk
    names = [uuid.uuid4().hex for _ in range(n)]
    flat = mode == "fsync_each_flat"
    folders = sorted({root if flat else os.path.join(root, h[:2]) for h in names})
    for f in folders:
        os.makedirs(f, exist_ok=True)
    fsync_dir(root)
    os.sync()

    def one(i: int) -> None:
        h = names[i]
        folder = root if flat else os.path.join(root, h[:2])
        tmp = os.path.join(folder, ".tmp-" + h)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, memoryview(data[i * chunk : (i + 1) * chunk]))
            if mode != "syncfs_once":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(folder, h))

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
        if mode == "fsync_each_dirs_parallel":
            list(pool.map(fsync_dir, folders))
    if mode == "syncfs_once":
        syncfs(root)
    elif mode in ("fsync_each", "fsync_each_flat"):
        for f in folders:
            fsync_dir(f)
    dt = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp/fsync-modes")
    a = p.parse_args()
    data = np.random.default_rng(0).integers(0, 255, a.mib << 20, dtype=np.uint8)
    modes = ["fsync_each", "fsync_each_dirs_parallel", "fsync_each_flat", "syncfs_once"]
    best: dict[str, float] = {}
    for _ in range(a.reps):  # interleaved, so slow phases of a shared machine hit every mode
        for m in modes:
            dt = run(m, a.dir, data, a.chunk_mib << 20, a.threads)
            best[m] = min(best.get(m, float("inf")), dt)
    for m in modes:
        print(f"{m:26} {best[m]:6.2f}s  {len(data) / best[m] / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
